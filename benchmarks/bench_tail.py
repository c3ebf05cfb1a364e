"""The chunk-boundary cost, and what tail sub-chunks buy back (issue 21).

A prompt of ``--tokens`` tokens (default 3,243: 12 chunks of 256 and 171 tokens) is served once by a
server that writes it back, then, after a restart, again from the store (a remote hit), then once more on
the same server (a local hit of the whole prompt: the reference). Both settings run side by side in one
session: ``--remote-kv-tail-tokens 0`` (only full chunks are stored: the last 171 tokens are recomputed)
and the default tail sub-chunks of 64 tokens (the last 43 are). Real prompts cut from license texts, real
SmolLM2, float32, default codec, DPU path, embedded store; TTFT = time of a 1-token ``/generate``.

Prints a table and writes ``docs/results/tail.json``. Run: ``make bench-tail`` (~5 minutes).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.e2e_probe import generate, probe_prompts
from benchmarks.e2e_server import metric, scrape, wait_writeback_idle
from benchmarks.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.model import ensure_model

logger = logging.getLogger(__name__)

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "tail.json"


def _server(model: str, store: str, tail: int) -> SGLangServer:
    args = (
        "--enable-metrics",
        "--enable-cache-report",
        "--remote-kv",
        "dpu",
        "--remote-kv-store",
        store,
        "--remote-kv-tail-tokens",
        str(tail),
    )
    return SGLangServer(ServerSpec(model_path=model, extra_args=args))


def _ttft(base_url: str, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = generate(base_url, ids, 1)
    details = out.get("meta_info", {}).get("cached_tokens_details") or {}
    return time.perf_counter() - t0, int(details.get("storage", 0) or 0)


def run(model: str, prompts: list[list[int]], tail: int, work: Path) -> dict:
    store = f"file://{work / f'store-{tail}'}"
    with _server(model, store, tail) as srv:
        for ids in prompts:
            generate(srv.base_url, ids, 1)
        wait_writeback_idle(srv.base_url)
    remote, local, hit = [], [], []
    with _server(model, store, tail) as srv:
        for ids in prompts:
            t, storage = _ttft(srv.base_url, ids)
            remote.append(t)
            hit.append(storage)
            local.append(_ttft(srv.base_url, ids)[0])
        hits = metric(scrape(srv.base_url), "remote_kv_hit_tokens_total")
    return {
        "tail_tokens": tail,
        "remote_ttft_s": remote,
        "local_ttft_s": local,
        "storage_tokens": hit,
        "hit_tokens_total": hits,
        "ratio_remote_over_local": [r / loc for r, loc in zip(remote, local, strict=True)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=3243)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = str(ensure_model())
    chunks, extra = divmod(a.tokens - 1, 256)
    prompts = [p[: a.tokens] for p in probe_prompts(model, a.prompts, chunks + 1)]
    with tempfile.TemporaryDirectory(prefix="srkv-tail-") as tmp:
        rows = [run(model, prompts, tail, Path(tmp)) for tail in (0, 64)]
    print(f"\nprompt {a.tokens} tokens = {chunks} chunks of 256 + {extra} (+1 computed); {a.prompts} prompts")
    print(
        f"{'tail tokens':>12} {'storage tokens':>15} {'remote TTFT s':>14} {'local TTFT s':>13} {'remote/local':>13}"
    )
    for r in rows:
        print(
            f"{r['tail_tokens']:>12} {statistics.median(r['storage_tokens']):>15.0f} "
            f"{statistics.median(r['remote_ttft_s']):>14.3f} {statistics.median(r['local_ttft_s']):>13.3f} "
            f"{statistics.median(r['ratio_remote_over_local']):>13.2f}"
        )
    a.out.write_text(json.dumps({"tokens": a.tokens, "prompts": a.prompts, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
