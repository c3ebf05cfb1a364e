"""The foundation e2e: a real CPU SGLang server with the real model and ``--remote-kv dpu``."""

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sgl_remote_kv.launcher import ServerSpec, SGLangServer

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
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
