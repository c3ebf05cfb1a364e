"""A burst of remote hits larger than the KV pool, through SGLang's own bench harness.

The scenario of issue 21: ``generated-shared-prefix`` at ``--request-rate inf`` on a small CPU KV pool,
after a restart so every shared prefix comes from the store. Phase 1 (server A) serves the workload once
and writes its prefixes back; phase 2 (server B, fresh process, same store) serves it again as one burst.
What must hold: every request completes, most prefixes are fetched, none fails for lack of staging rows
while waiting is allowed, and no request waits for staging rows longer than ``slot_wait_s``.

Prints a table and writes ``docs/results/burst.json``. Run: ``make bench-burst`` (about 5-10 minutes on
the 2-core box).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from benchmarks.e2e_server import Workload, delta, metric, run_harness, scrape, wait_writeback_idle
from benchmarks.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.model import ensure_model

logger = logging.getLogger(__name__)

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "burst.json"


def _server(model: str, store: str, pool_tokens: int) -> SGLangServer:
    args = ("--enable-metrics", "--enable-cache-report", "--remote-kv", "dpu", "--remote-kv-store", store)
    return SGLangServer(ServerSpec(model_path=model, extra_args=args, max_total_tokens=pool_tokens))


def _failures(d: dict[str, float], kind: str) -> float:
    return sum(v for k, v in d.items() if "remote_kv_failures_total" in k and f'kind="{kind}"' in k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--pool-tokens", type=int, default=4096, help="--max-total-tokens of the server")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = str(ensure_model())
    wl = Workload(
        groups=a.groups, per_group=a.per_group, system_len=a.system_len, question_len=64, output_len=8
    )
    with tempfile.TemporaryDirectory(prefix="srkv-burst-") as tmp:
        work = Path(tmp)
        store = f"file://{work / 'store'}"
        with _server(model, store, a.pool_tokens) as srv:  # phase 1: compute and write back
            first = run_harness(
                srv.base_url, model, wl, work / "a.jsonl", float("inf"), False, work / "h.log"
            )
            written = wait_writeback_idle(srv.base_url)
        with _server(model, store, a.pool_tokens) as srv:  # phase 2: the burst, from the store
            before = scrape(srv.base_url)
            burst = run_harness(
                srv.base_url, model, wl, work / "b.jsonl", float("inf"), False, work / "h.log"
            )
            d = delta(scrape(srv.base_url), before)
    n = a.groups * a.per_group
    waits = metric(d, "remote_kv_slot_waits_total")
    row = {
        "requests": n,
        "completed": int(burst.get("completed", 0)),
        "pool_tokens": a.pool_tokens,
        "burst_prefix_tokens": n * a.system_len,
        "written_bytes_phase1": written,
        "hit_tokens": metric(d, "remote_kv_hit_tokens_total"),
        "hit_chunks": metric(d, "remote_kv_hit_chunks_total"),
        "failures_no_staging_rows": _failures(d, "no_staging_rows"),
        "slot_waits": waits,
        "slot_wait_mean_s": metric(d, "remote_kv_slot_wait_seconds_sum") / waits if waits else 0.0,
        "slot_waits_over_10s": waits
        - sum(v for k, v in d.items() if k.endswith('slot_wait_seconds_bucket{le="10.0"}')),
        "kv_wait_mean_s": metric(d, "remote_kv_kv_wait_seconds_sum")
        / max(1.0, metric(d, "remote_kv_kv_wait_seconds_count")),
        "ttft_p50_ms_cold": first.get("median_ttft_ms"),
        "ttft_p50_ms_burst": burst.get("median_ttft_ms"),
        "ttft_p99_ms_burst": burst.get("p99_ttft_ms"),
        "ttft_max_s_burst": max([t for t in burst.get("ttfts", []) if t] or [0.0]),
        "e2e_p99_ms_burst": burst.get("p99_e2e_latency_ms"),
        "storage_tokens_burst": sum(
            int((d or {}).get("storage", 0) or 0) for d in burst.get("cached_tokens_details", [])
        ),
        "errors_burst": sum(1 for e in burst.get("errors", []) if e),
        "duration_s_cold": first.get("duration"),
        "duration_s_burst": burst.get("duration"),
    }
    print(f"\n{'metric':32s} value")
    for k, v in row.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    a.out.write_text(json.dumps({"workload": wl.args(), "result": row}, indent=2) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
