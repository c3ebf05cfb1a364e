"""The offline ``sglang.Engine`` with the tier: ``sglang.Engine(..., remote_kv="dpu", remote_kv_store=...)``
keywords or ``sgl_remote_kv.configure(...)`` before it; the CLI's validation and errors; a shutdown that
drains the write-back; README's Engine example run as a script.

1. a bad option (``remote_kv="gpu"``, a bad chunk size, an unknown ``remote_kv_bogus``) is a
   ``ValueError`` naming the flag, from ``configure`` and from ``sglang.Engine(...)`` alike, and nothing
   is exported;
2. engine A (keywords) computes a prompt ending mid-chunk cold and shuts down right after ``generate``:
   the shutdown drains the write-back, tail sub-chunks included;
3. engine B (``configure``; a new process: nothing local) serves the prompt's whole stored prefix from
   the store, token-identical to A;
4. README's ``<!-- engine-example -->`` block runs as a script (``test_readme_engine_example``).

Each engine runs in its own Python process (an Engine owns scheduler subprocesses and process-wide
state), with the CPU platform plugin on, float32 and the lossless codec.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sgl_remote_kv import env
from tests.fixtures.remote_kv_server import CHUNK

pytestmark = [pytest.mark.e2e]

TAIL = 16  # tail sub-chunk tokens
# The CPU dev platform's engine options (every engine here, README's example included, gets them).
CPU = dict(
    device="cpu",
    dtype="float32",
    max_total_tokens=4096,
    attention_backend="torch_native",
    cuda_graph_backend_decode="disabled",
    cuda_graph_backend_prefill="disabled",
    enable_cache_report=True,
    log_level="warning",
)

SCRIPT = textwrap.dedent(
    """
    import glob, json, os, sys, tempfile
    import psutil
    import sglang as sgl
    import sgl_remote_kv

    model, store, mode, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    cpu = %(cpu)r
    tier = dict(remote_kv="dpu", remote_kv_store=f"file://{store}", remote_kv_chunk_size=%(chunk)d,
                remote_kv_tail_tokens=%(tail)d, remote_kv_codec="lossless", remote_kv_policy_margin=1e9)
    if mode == "write":  # the tier as Engine keywords; shut down right after generate
        engine = sgl.Engine(model_path=model, **cpu, **tier)
    else:  # the tier through configure()
        sgl_remote_kv.configure(**tier)
        engine = sgl.Engine(model_path=model, **cpu)
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8})
    pids = [os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]
    engine.shutdown()  # drains the write-back (at most 10 s): no waiting here
    # what the tier named after a process of this engine (regions, data-plane run dirs): none may remain
    left = [p for d in ("/dev/shm", tempfile.gettempdir()) for i in pids for p in glob.glob(f"{d}/srkv-dpu-{i}-*")]
    out = {"output_ids": out["output_ids"], "cached": out["meta_info"]["cached_tokens"], "left": left}
    print(json.dumps(out))
    """
) % {"chunk": CHUNK, "tail": TAIL, "cpu": CPU}


def _run(model_dir: str, store: str, mode: str, ids: list[int]) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, store, mode, json.dumps(ids)],
        env=dict(os.environ, **{env.CPU_PLATFORM: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["seconds"] = time.monotonic() - t0
    return out


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"remote_kv": "gpu"}, "--remote-kv"),
        ({"remote_kv": "dpu", "remote_kv_chunk_size": 100}, "--remote-kv-chunk-size"),
        ({"remote_kv_bogus": 1}, "remote_kv_bogus"),
        ({"remote_kv": "dpu", "remote_kv_flush": "all"}, "--remote-kv-flush"),
    ],
)
def test_configure_validates_like_the_cli(monkeypatch, options, named):
    import sgl_remote_kv

    monkeypatch.setenv(env.CONFIG_JSON, "")  # restored after the test, whatever configure exports
    with pytest.raises(ValueError, match=named):
        sgl_remote_kv.configure(**options)
    assert env.config_json() is None  # nothing exported


def test_configure_exports_the_config(monkeypatch):
    import sgl_remote_kv
    from sgl_remote_kv.config import RemoteKVConfig

    monkeypatch.setenv(env.CONFIG_JSON, "")  # restored after the test, whatever configure exports
    cfg = sgl_remote_kv.configure(remote_kv="dpu", remote_kv_store="file:///tmp/x", remote_kv_layerwise=True)
    assert RemoteKVConfig.current() == cfg and cfg.layerwise and cfg.mode == "dpu"


ENGINE_ERRORS = textwrap.dedent(
    """
    import json, os, sys
    import sglang as sgl

    model, seen = sys.argv[1], {}
    for name, kwargs in json.loads(sys.argv[2]).items():
        try:
            sgl.Engine(model_path=model, **kwargs)
            seen[name] = "started"
        except Exception as e:
            seen[name] = f"{type(e).__name__}: {e}"
    seen["exported"] = os.environ.get("SRKV_CONFIG")
    print(json.dumps(seen))
    """
)


def test_engine_keywords_validate_like_the_cli(model_dir):
    """``sglang.Engine(remote_kv=...)`` keywords: bad values are the CLI's ``ValueError`` naming the flag,
    raised before anything starts and with nothing exported; SGLang's own unknown keywords stay its
    ``TypeError``."""
    cases = {
        "mode": {"remote_kv": "gpu"},
        "chunk": {"remote_kv": "dpu", "remote_kv_chunk_size": 100},
        "unknown": {"remote_kv": "dpu", "remote_kv_bogus": 1},
        "sglang": {"remote_kv": "dpu", "bogus_sglang_option": 1},
    }
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_ERRORS, model_dir, json.dumps(cases)],
        env={k: v for k, v in os.environ.items() if k != env.CONFIG_JSON},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["mode"].startswith("ValueError") and "--remote-kv" in seen["mode"], seen
    assert seen["chunk"].startswith("ValueError") and "--remote-kv-chunk-size" in seen["chunk"], seen
    assert seen["unknown"].startswith("ValueError") and "remote_kv_bogus" in seen["unknown"], seen
    assert seen["sglang"].startswith("TypeError") and "bogus_sglang_option" in seen["sglang"], seen
    assert seen["exported"] is None, "a refused Engine must not export the tier's config"


# make test-slow (default run kept near 30 min): ~100 s; the drain is in test_shutdown_drain_server
@pytest.mark.slow
def test_engine_restart_hit(model_dir, tmp_path):
    """A (keywords) shuts down right after generating a prompt that ends mid-chunk; B (configure) gets
    the prompt's whole stored prefix: the shutdown drained the write-back, tail sub-chunks included."""
    from transformers import AutoTokenizer

    from tests.fixtures.faults import make_case

    store = str(tmp_path / "store")
    ids = make_case(AutoTokenizer.from_pretrained(model_dir), "engine-api", n_chunks=4).ids
    ids = ids[: 3 * CHUNK + 2 * TAIL + 9]  # 3 chunks, 2 tail sub-chunks, 9 tokens left over
    a = _run(model_dir, store, "write", ids)
    assert a["cached"] == 0
    b = _run(model_dir, store, "read", ids)
    assert b["cached"] == 3 * CHUNK + 2 * TAIL, "the shut-down engine's write-back must be in the store"
    assert b["output_ids"] == a["output_ids"]
    assert a["left"] == b["left"] == [], "Engine.shutdown() left the tier's shm regions or run dirs behind"
    print(f"engine A (keywords, shutdown right after generate) {a['seconds']:.1f} s, B {b['seconds']:.1f} s")


# -- README's Engine example ----------------------------------------------------------------------------
README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- engine-example -->"
# Run as a script: README's own CPU keywords (its ``<!-- engine-cpu-keywords -->`` block, nothing more but
# a quieter log) go to every sglang.Engine the example builds (its own keywords win), so the keywords it
# tells a CPU user to add are shown to be enough. Re-run in SGLang's spawned children, where it is harmless.
PREAMBLE = textwrap.dedent(
    """
    import functools
    import sglang

    sglang.Engine = functools.partial(sglang.Engine, **%(cpu)r)
    """
)


def readme_cpu_options() -> dict:
    from tests.test_docs import readme_cpu_keywords

    kw = readme_cpu_keywords()
    return {k: v for k, v in kw.items() if k != "model_path" and not k.startswith("remote_kv")} | {
        "log_level": "warning"
    }


def readme_engine_example() -> str:
    """The ```python block right after README's ``<!-- engine-example -->`` line."""
    text = README.read_text()
    at = text.find(MARKER)
    assert at >= 0, f"README.md has no {MARKER} line followed by the Engine example (```python block)"
    block = re.match(r"[ \t]*\n```python\n(.*?)\n```", text[at + len(MARKER) :], re.S)
    assert block, f"README.md: the line after {MARKER} must open a ```python block"
    return block.group(1)


def test_readme_engine_example(model_dir, tmp_path):
    """README's Engine example, as a user runs it (``python example.py``): the ``"<model>"`` placeholder
    becomes the real model and its ``remote_kv_store="..."`` URL a tmp ``file://`` store; it must start
    the engine with the tier on, generate, print the answer and exit cleanly."""
    code = readme_engine_example()
    assert 'if __name__ == "__main__":' in code, "SGLang spawns processes: a script needs the guard"
    assert code.count('"<model>"') == 1, 'the example names its model as "<model>" once'
    stores = re.findall(r'remote_kv_store="[^"]*"', code)
    assert len(stores) == 1, 'the example passes the store once, as remote_kv_store="<url>"'
    store = tmp_path / "store"
    code = code.replace('"<model>"', repr(model_dir)).replace(stores[0], f'remote_kv_store="file://{store}"')
    script = tmp_path / "example.py"
    script.write_text(PREAMBLE % {"cpu": readme_cpu_options()} + code + "\n")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if k != env.CONFIG_JSON}, env.CPU_PLATFORM: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, f"the example prints the answer; got {proc.stdout!r}"
    assert store.is_dir(), "the example's store URL was not the tier's store (is the tier on?)"
    print(f"README Engine example: {seconds:.1f} s")
