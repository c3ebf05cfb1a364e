"""Run the issue 39 linker spike once on this CPU: cold, /flush_cache, hit; then a restart, hit.

    .venv/bin/python spikes/linker/run_spike.py [--page 64] [--out /tmp/linker_spike.json]

Real SGLang server (CPU platform plugin, SmolLM2-135M float32, ``cpu_prefix`` attention), a file://
store in a fresh temp dir, the spike linker loaded through SGLang's stock linker flags. Prints a table
and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sgl_remote_kv.launcher import ServerSpec, SGLangServer
from tests.fixtures.remote_kv_server import flush_cache

HERE = Path(__file__).resolve().parent
DOC = " ".join(
    f"Section {i}: the quick brown fox number {i} jumps over the lazy dog and studies topic {i * 7 % 13}."
    for i in range(48)
)
PROMPT = DOC + "\nQuestion: Which topic does section 3 study?\nAnswer:"


def model_dir() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sgl_remote_kv.model", "--dtype", "float32"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def warm_up(srv) -> None:
    """One short unrelated request (under one page: nothing to store or load) so the first measured
    request does not pay the process's first-forward costs."""
    body = {"text": "Hello there.", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    req = urllib.request.Request(
        srv.base_url + "/generate",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=600).read()


def ask(srv) -> dict:
    """One greedy streamed request: TTFT = time to the first streamed chunk; the answer and the cache
    report come from the last one."""
    body = {"text": PROMPT, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    req = urllib.request.Request(
        srv.base_url + "/generate",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            last = json.loads(line[5:])
    meta = last["meta_info"]
    return {
        "ttft_s": round(ttft, 3),
        "total_s": round(time.perf_counter() - t0, 3),
        "prompt_tokens": meta["prompt_tokens"],
        "cached_tokens": meta.get("cached_tokens"),
        "cached_tokens_details": meta.get("cached_tokens_details"),
        "answer": last["text"],
    }


def wait_offloaded(srv, at_least: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    store = Path(srv.spec.env["SPIKE_STORE"])
    n = 0
    while time.monotonic() < deadline:
        n = sum(1 for p in store.rglob("*") if p.is_file())
        if n >= at_least:
            break
        time.sleep(0.5)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--out", default="/tmp/linker_spike.json")
    a = ap.parse_args()
    store_dir = tempfile.mkdtemp(prefix="linker-spike-store-")
    cfg = {
        "linker": "RemoteKVSpikeLinker",
        "linker_module_path": "linker_spike",
        "linker_extra_config": {"store": f"file://{store_dir}", "codec": "lossless"},
    }
    args = (
        "--enable-cache-report",
        "--page-size",
        str(a.page),
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps(cfg),
    )
    spec = ServerSpec(
        model_path=model_dir(),
        extra_args=args,
        max_total_tokens=8192,
        env={"PYTHONPATH": f"{HERE}:{HERE.parent.parent}", "SPIKE_STORE": store_dir},
    )
    rows = {}
    with SGLangServer(spec) as srv:
        print("command:", " ".join(srv.command()))
        warm_up(srv)
        rows["cold"] = ask(srv)
        rows["device_hit"] = ask(srv)
        pages = rows["cold"]["prompt_tokens"] // a.page
        rows["stored_files"] = wait_offloaded(srv, pages)
        flush_cache(srv)
        rows["after_flush"] = ask(srv)
        log1 = srv.log_text()
    with SGLangServer(spec) as srv:
        warm_up(srv)
        rows["after_restart"] = ask(srv)
        log2 = srv.log_text()
    for name in ("cold", "device_hit", "after_flush", "after_restart"):
        r = rows[name]
        print(
            f"{name:14s} ttft {r['ttft_s']:6.3f} s  prompt {r['prompt_tokens']}  cached {r['cached_tokens']}"
            f"  details {r['cached_tokens_details']}  answer {r['answer']!r}"
        )
    rows["stats"] = re.findall(r"spike linker (?:reset; )?stats (\{.*\})", log1 + log2)
    rows["same_answer"] = (
        rows["cold"]["answer"] == rows["after_flush"]["answer"] == rows["after_restart"]["answer"]
    )
    print("same answer:", rows["same_answer"], " stored files:", rows["stored_files"])
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
