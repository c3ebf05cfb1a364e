"""The foundation e2e: a real CPU SGLang server with the real model and ``--remote-kv dpu`` (the chat, the
multi-turn and the shared-document examples run against it); a normal run logs no WARNING of ours, and a
SIGTERM leaves nothing of ours in /dev/shm or the temp dir (the last test)."""

import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest

from benchmarks.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.contract import shm_names

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import shared_document_qa as qa  # noqa: E402

pytestmark = pytest.mark.e2e
# SGLang's own log lines carry no level; its documented logging hook gives every line one.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"leveled": {"format": "[%(asctime)s] %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "leveled"}},
    "root": {"level": "INFO", "handlers": ["stderr"]},
}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    logging_config = tmp_path_factory.mktemp("logging") / "logging.json"
    logging_config.write_text(json.dumps(LOGGING))
    spec = ServerSpec(
        model_path=model_dir,
        extra_args=(
            "--remote-kv",
            "dpu",
            "--remote-kv-store",
            f"file://{store}",
            "--enable-metrics",
            "--enable-cache-report",
        ),
        env={"SGLANG_LOGGING_CONFIG_PATH": str(logging_config)},
        log_path=str(tmp_path_factory.mktemp("log") / "server.log"),
    )
    with SGLangServer(spec) as srv:
        yield srv
    assert srv.proc.poll() is not None, "server still running after teardown"


def _post(url, payload):
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_flag_is_accepted_and_reported(server):
    assert "sgl-remote-kv: --remote-kv dpu" in server.log_text()


def test_chat_names_paris(server):
    out = _post(
        server.base_url + "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    assert "Paris" in out["choices"][0]["message"]["content"]


def test_metrics_endpoint_answers(server):
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert "sglang:max_total_num_tokens" in text


def test_multi_turn_example_reports_ttft_and_cached_tokens(server, tmp_path):
    out = tmp_path / "turns.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "multi_turn_chat.py"),
            "--base-url",
            server.base_url,
            "--turns",
            "3",
            "--max-tokens",
            "16",
            "--json",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    turns = json.loads(out.read_text())
    assert len(turns) == 3 and all(t["answer"] and t["ttft_s"] > 0 for t in turns)
    assert turns[1]["cached_tokens"] > 0  # turn 2 reuses turn 1's prefix from the device radix cache


def test_shared_document_qa_two_questions(server):
    doc = qa.load_document(qa.DEFAULT_DOC, 6000)
    first = qa.run(server.base_url, clients=2, questions=2, max_tokens=8, document=doc)
    assert len(first) == 2
    for a in first:
        assert a.prompt_tokens > 1000
        assert 0 < a.ttft_s <= a.total_s
        assert a.text
    # the document is now in the device cache: a new question reuses it
    (again,) = qa.run(server.base_url, clients=1, questions=1, max_tokens=8, document=doc)
    assert again.cached_tokens > 1000
    assert again.by_tier.get("device", 0) > 1000


def test_shared_document_qa_main_prints_per_question(server, capsys):
    assert (
        qa.main(["--base-url", server.base_url, "--clients", "2", "--questions", "2", "--max-tokens", "4"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("TTFT") == 2 and "cached" in out


def test_bad_flag_value_fails_at_start_with_one_clear_error(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--remote-kv", "gpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "SRKV_CPU_PLATFORM": "1"},
    )
    assert proc.returncode != 0
    assert "--remote-kv" in proc.stderr and "invalid choice" in proc.stderr


# What SGLang itself warns about on this CPU box whatever the plugins (a line containing one of these is
# not ours): the deprecated entry point and module imports probing for CUDA kernels (awq, gguf, fla), the
# box's file limit, no CUDA (CPU all-reduce, JIT arch), model modules and APIs whose optional packages
# are not installed (mamba kernels, cutlass, torchaudio, openai_harmony), FastAPI's deprecation of
# ORJSONResponse that SGLang's HTTP server uses.
SGLANG_CPU_WARNINGS = (
    "UserWarning: 'python -m sglang.launch_server' is still supported",
    "UserWarning: Only CUDA, HIP and XPU support AWQ currently",
    "UserWarning: Only CUDA, MUSA and NPU support GGUF quantization currently",
    "UserWarning: Triton is not supported on current platform, roll back to CPU",
    "WARNING sglang.srt.utils.common: Fail to set RLIMIT_NOFILE",
    "WARNING sglang.srt.distributed.bootstrap: init_cpu_threads_env and shared memory based AllReduce is disabled",
    "WARNING sglang.kernels.jit.utils.arch: Cannot detect CUDA architecture.",
    "WARNING sglang.srt.models.registry: Ignore import error when loading sglang.srt.models.",
    "WARNING sglang.srt.entrypoints.http_server: OpenAI Responses API (/v1/responses) disabled",
    "FastAPIDeprecationWarning: ORJSONResponse is deprecated",
    # SGLang's linker wrapper hashes pages with its JIT-built native module; SGLang 0.5.23's loader takes the
    # ``lock`` file torch >= 2.12 keeps (an OS-level FileLock, no longer removed on release) for one left by a
    # dead build, and says so at each load after the first build
    "WARNING sglang.srt.utils.cpp_extension_loader: Removing stale PyTorch extension lock for hicache_hash_cpp",
)
# A warning or worse: a leveled log line (LOGGING's format, our data plane's ``dpu[pid] LEVEL``, uvicorn's
# ``LEVEL:``) or a Python warning (``file:line: SomethingWarning: ...``).
WARNED = re.compile(
    r"^\[[^\]]+\] (WARNING|ERROR|CRITICAL) |dpu\[\d+\] (WARNING|ERROR|CRITICAL) |^(WARNING|ERROR|CRITICAL):"
    r"|^\S+:\d+: \w*Warning: "
)


def _created_by(pids: set[int]) -> set[str]:
    """Our entries (regions, data-plane run directories) in /dev/shm and the temp dir named after one of
    ``pids`` (their creator)."""
    dirs = (Path("/dev/shm"), Path(tempfile.gettempdir()))
    found = {p for d in dirs for p in d.glob(f"{shm_names.PREFIX}*")}
    named = re.compile(rf"^{re.escape(shm_names.PREFIX)}(\d+)-")
    return {str(p) for p in found if (m := named.match(p.name)) and int(m.group(1)) in pids}


def test_a_normal_run_warns_nothing_and_sigterm_leaves_nothing_behind(server):
    """Last test of the module (it stops the server). Everything above was a normal run: no WARNING (or
    worse) line from any logger, our data plane's included, and no Python warning beyond SGLang's own on
    CPU. Then SIGTERM (what an operator sends; SGLang SIGKILLs what is left of its process tree, our data
    plane included): nothing named after any of the server's processes remains in /dev/shm or the temp
    dir, and the write-back's encoder process (the host encode runs there) is gone."""
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    pids = {server.proc.pid} | {p.pid for p in procs}
    assert len(pids) >= 4, pids  # launcher, scheduler, its data plane, its write-back encoder, ...
    encoders = [p for p in procs if "writeback.encoder_process" in " ".join(p.cmdline())]
    assert len(encoders) == 1, procs  # the write-back's host encode left the scheduler process
    running = server.log_text().splitlines()
    assert any("write-back encodes in 1 process(es)" in ln for ln in running)
    server.stop()
    assert server.proc.poll() is not None
    assert not any(p.is_running() for p in encoders)
    stopping = server.log_text().splitlines()[len(running) :]  # SGLang warns "SIGTERM received" itself
    bad = [ln for ln in running if WARNED.search(ln) and not any(w in ln for w in SGLANG_CPU_WARNINGS)]
    bad += [ln for ln in stopping if WARNED.search(ln) and ("sgl_remote_kv" in ln or " dpu[" in ln)]
    assert not bad, "\n".join(bad)
    assert _created_by(pids) == set()
