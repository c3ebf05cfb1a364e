"""Adaptive resolution on a real server under a changing link (issue 37): adaptive vs each fixed resolution.

Setup: Redis in its own network namespace behind a ``tc tbf``-shaped veth (``benchmarks/netshape.py`` via
``e2e_server.shaped_store``); real CPU SGLang servers (SmolLM2-135M, ``--remote-kv nvdec``, 256-token
chunks, the default resolutions 16, 64 tokens/frame and full, FFmpeg's software HEVC decoder pool of 2,
the CPU platform's default attention backend).

1. A writer server answers the prompt cold (recompute) and writes every chunk back at each resolution;
   the bytes of each version (``nvdec_written_bytes{resolution}``) are the store cost.
2. One server per configuration -- ``adaptive`` (Alg. 1) and ``--remote-kv-nvdec-fetch`` ``full``/``16``/
   ``64`` -- each: one unmeasured warm-up fetch, then ``--reps`` measured fetches of the same prompt
   (local cache flushed before each, policy margin 1e9 so every one is a remote hit).
3. During each measured fetch the link follows the paper's Fig. 17/23 trace (6 -> 3 -> 4 Gbps) *scaled*
   to what this CPU's decoder pool keeps up with: ``unit = R_full / 4`` where ``R_full`` is the rate at
   which the link delivers full-frame chunks as fast as the server's fetch consumes them (the writer
   server, ``--remote-kv-nvdec-fetch full``, fetches the prompt twice over the unshaped link: seconds per
   chunk of the second fetch, ``kv_wait_seconds``; chunk bytes from the writer's metrics). So 6 units is
   decode-bound, 3 link-bound, 4 balanced. Each phase lasts a third of that calibration fetch
   (``tc qdisc replace`` from a thread while the fetch runs; the last phase holds until the end).

Per fetch: TTFT (first streamed token), the server's NVDEC bubbles (decoder waiting for bytes, link
waiting for the decoder), bytes and resolutions fetched (``/metrics`` deltas), tokens vs cold.
Reported: medians over the reps; ``adaptive_ttft_s``, ``best_fixed_ttft_s``, ``worst_fixed_ttft_s`` in
``docs/results/adaptive_resolution.json``. Needs root (network namespaces). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.e2e_server import delta, flush_device_cache, metric, scrape, shaped_store, stream_generate
from benchmarks.launcher import ServerSpec, SGLangServer
from benchmarks.netshape import netns_supported
from sgl_remote_kv.model import ensure_model

logger = logging.getLogger("bench_adaptive_resolution")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "adaptive_resolution.json"
CHUNK = 256
TRACE = ((6.0, "6"), (3.0, "3"), (4.0, "4"))  # the paper's Gbps, in units
CONFIGS = ("adaptive", "full", "16", "64")
LABELS = ("full", "16", "64")
P = "sglang:remote_kv_"


def _prompt(model: str, chunks: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lines, ids = [], []
    i = 0
    while len(ids) < chunks * CHUNK + 8:
        lines.append(f"Log {i}: station {i % 17} reported {i * 37 % 101} units of cargo, status {i % 5}.")
        i += 1
        ids = tok(" ".join(lines), add_special_tokens=False)["input_ids"]
    return ids[: chunks * CHUNK + 8]


def _server(model: str, store_url: str, fetch: str, workdir: Path) -> SGLangServer:
    # the platform's own CPU attention (``cpu_prefix``), not ``torch_native``: that one pads every extend's
    # query to the whole sequence, so the prefill after a 2,304-token hit cost ~3.5 s here (a local hit
    # too), a constant that hid the fetch the benchmark compares
    args = (
        "--enable-metrics",
        "--enable-cache-report",
        "--remote-kv",
        "nvdec",
        "--remote-kv-store",
        store_url,
        "--remote-kv-chunk-size",
        str(CHUNK),
        "--remote-kv-policy-margin",
        "1e9",
        "--remote-kv-nvdec-fetch",
        fetch,
    )
    return SGLangServer(ServerSpec(model_path=model, extra_args=args, max_total_tokens=16384))


class Trace(threading.Thread):
    """Apply the scaled trace on ``store``'s link from now: phase i lasts ``phase_s`` (the last: until stop)."""

    def __init__(self, store, unit_mbit: float, phase_s: float) -> None:
        super().__init__(daemon=True)
        self.store, self.unit, self.phase_s = store, unit_mbit, phase_s
        self.stop = threading.Event()
        self.changes: list[tuple[float, float]] = []

    def run(self) -> None:
        t0 = time.perf_counter()
        for i, (units, _) in enumerate(TRACE):
            if i:
                if self.stop.wait(self.phase_s):
                    return
                self.store.set_rate(units * self.unit)
            self.changes.append((round(time.perf_counter() - t0, 3), round(units * self.unit, 2)))


def _static_neighbours(store) -> None:
    """Permanent ARP entries on both ends of our own veth: under a saturated ``tbf`` queue the namespace's
    ARP replies wait behind 100 ms of data and can be dropped, and the next connect then fails with
    "No route to host" (seen once on this loaded box). Only our namespace's addresses are touched."""
    import subprocess

    link = store.link

    def mac(dev: str, netns: str | None) -> str:
        pre = ["ip", "netns", "exec", netns] if netns else []
        out = subprocess.run([*pre, "cat", f"/sys/class/net/{dev}/address"], capture_output=True, text=True)
        return out.stdout.strip()

    host_mac, ns_mac = mac(link.host_if, None), mac(link.ns_if, link.netns)
    subprocess.run(
        ["ip", "neigh", "replace", link.ns_addr, "lladdr", ns_mac, "dev", link.host_if, "nud", "permanent"],
        check=True,
    )
    subprocess.run(
        ["ip", "netns", "exec", link.netns, "ip", "neigh", "replace", link.host_addr, "lladdr", host_mac]
        + ["dev", link.ns_if, "nud", "permanent"],
        check=True,
    )


def _unit(model: str, written: dict, chunk_s: float, instances: int = 2) -> tuple[float, dict]:
    """The trace unit (Mbit/s): a quarter of the rate at which full-frame chunks arrive as fast as the
    server's fetch consumes them (``chunk_s``: seconds per chunk of an unshaped full-frame fetch, measured
    in the server); chunk bytes from the writer's per-resolution written bytes. The servers' measured
    decode profile (a cache-file hit) is recorded beside it."""
    from sgl_remote_kv.nvdec.hevc_codec import HevcCodec
    from sgl_remote_kv.nvdec.pool import DecoderPool
    from sgl_remote_kv.nvdec.profile import serving_table

    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.types import KVLayout, ModelFingerprint

    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    # the table's cache key depends on the KV layout only (what the server profiled for this model)
    fp = ModelFingerprint(cfg["architectures"][0], KVLayout(cfg["num_hidden_layers"], heads, dim, dtype), "")
    with DecoderPool(instances=instances) as pool:
        table = serving_table(pool, HevcCodec(), RemoteKVConfig(chunk_size=CHUNK).nvdec_versions, fp, CHUNK)
    sizes = {}
    for lab in LABELS:
        n = written.get(f'{P}nvdec_written_chunks_total{{resolution="{lab}"}}', 0)
        sizes[lab] = written.get(f'{P}nvdec_written_bytes_total{{resolution="{lab}"}}', 0) / max(n, 1)
    r_full = sizes["full"] / chunk_s  # bytes/s at which the link keeps the server's full-frame fetch busy
    info = {
        "profile_key": table.key,
        "decode_s_per_chunk_load1": {
            ("full" if r == 0 else str(r)): round(row[0], 4)
            for r, row in zip(table.resolutions, table.latency, strict=True)
        },
        "decode_s_per_chunk_full_load": {
            ("full" if r == 0 else str(r)): round(row[-1], 4)
            for r, row in zip(table.resolutions, table.latency, strict=True)
        },
        "chunk_bytes": {k: int(v) for k, v in sizes.items()},
        "fetch_s_per_chunk_full_unshaped": round(chunk_s, 3),
        "balanced_full_mbit": round(r_full * 8 / 1e6, 2),
    }
    return r_full * 8 / 1e6 / 4, info


def _fetch(srv, store, ids, unit, phase_s, cold_ids, new_tokens) -> dict:
    store.set_rate(TRACE[0][0] * unit)
    flush_device_cache(srv.base_url)
    before = scrape(srv.base_url)
    trace = Trace(store, unit, phase_s)
    trace.start()
    out = stream_generate(srv.base_url, ids, new_tokens)
    trace.stop.set()
    trace.join()
    time.sleep(0.5)  # the fetch's metrics land after the response
    d = delta(scrape(srv.base_url), before)
    per = {lab: int(d.get(f'{P}nvdec_chunks_total{{resolution="{lab}"}}', 0)) for lab in LABELS}
    return {
        "ttft_s": round(out["ttft_s"], 3),
        "fetch_s": round(metric(d, "remote_kv_kv_wait_seconds_sum"), 3),  # parked -> KV in the pool
        "link_s": round(metric(d, "remote_kv_fetch_seconds_sum"), 3),  # the fetch thread's transfers
        "storage_tokens": out["storage_tokens"],
        "decoder_wait_s": round(d.get(f'{P}nvdec_bubble_seconds_total{{kind="decoder_wait"}}', 0.0), 3),
        "link_wait_s": round(d.get(f'{P}nvdec_bubble_seconds_total{{kind="link_wait"}}', 0.0), 3),
        "bytes_fetched": int(metric(d, "remote_kv_fetched_bytes_total")),
        "chunks_by_resolution": per,
        "fallbacks": int(metric(d, "remote_kv_nvdec_fallbacks_total")),
        "store_errors": int(metric(d, "remote_kv_store_errors_total")),
        "same_tokens_as_cold": out["output_ids"] == cold_ids,
        "rate_changes": trace.changes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=9, help="remote chunks in the prompt (256 tokens each)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ok, why = netns_supported()
    if not ok:
        sys.exit(f"needs network namespaces + tc (root): {why}")
    model = str(ensure_model("float32"))
    ids = _prompt(model, a.chunks)
    configs = a.configs.split(",")
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="srkv-adaptive-") as tmp, shaped_store(Path(tmp)) as store:
        _static_neighbours(store)
        # 1. cold answer + write-back of every version (unshaped link)
        with _server(model, store.url, "full", Path(tmp)) as w:
            t0 = time.perf_counter()
            cold = stream_generate(w.base_url, ids, a.new_tokens)
            deadline = time.monotonic() + 1800  # every chunk at 3 resolutions: libx265 on a loaded CPU
            while metric(scrape(w.base_url), "remote_kv_nvdec_written_chunks_total") < len(LABELS) * a.chunks:
                if time.monotonic() > deadline:
                    sys.exit("the write-back did not store every chunk")
                time.sleep(2.0)
            writeback_s = time.perf_counter() - t0
            written = scrape(w.base_url)
            # calibration: unshaped full-frame fetches (the first warms the pool); seconds per chunk
            for _ in range(2):
                flush_device_cache(w.base_url)
                before = scrape(w.base_url)
                stream_generate(w.base_url, ids, 1)
                time.sleep(0.5)
                calib_s = metric(delta(scrape(w.base_url), before), "remote_kv_kv_wait_seconds_sum")
        unit, info = _unit(model, written, calib_s / a.chunks)
        phase_s = a.chunks / 3 * calib_s / a.chunks  # a third of the chunks per phase, at the balanced rate
        cost = {
            lab: int(written.get(f'{P}nvdec_written_bytes_total{{resolution="{lab}"}}', 0)) for lab in LABELS
        }
        logger.info("trace unit %.1f Mbit/s, phase %.2f s; store cost per version %s", unit, phase_s, cost)
        # 2./3. every configuration's server up at once (idle servers sleep); one warm-up fetch each, then
        # the measured fetches interleaved (rep-major, the order rotated per rep: load drifts on this box)
        store.set_rate(TRACE[0][0] * unit)
        with contextlib.ExitStack() as stack:
            servers = {cfg: stack.enter_context(_server(model, store.url, cfg, Path(tmp))) for cfg in configs}
            for cfg, srv in servers.items():
                warm = _fetch(srv, store, ids, unit, phase_s, cold["output_ids"], a.new_tokens)
                logger.info("%s warm-up: %s", cfg, warm)
                rows[cfg] = []
            for rep in range(a.reps):
                order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
                for cfg in order:
                    r = _fetch(servers[cfg], store, ids, unit, phase_s, cold["output_ids"], a.new_tokens)
                    logger.info("%s rep %d: %s", cfg, rep, r)
                    rows[cfg].append(r)
        store.set_rate(None)
    med = {
        cfg: {
            k: statistics.median(r[k] for r in rs)
            for k in ("ttft_s", "fetch_s", "link_s", "decoder_wait_s", "link_wait_s", "bytes_fetched")
        }
        for cfg, rs in rows.items()
    }
    fixed = {c: m["ttft_s"] for c, m in med.items() if c != "adaptive"}
    fixed_fetch = {c: m["fetch_s"] for c, m in med.items() if c != "adaptive"}
    result = {
        "adaptive_ttft_s": med.get("adaptive", {}).get("ttft_s"),
        "best_fixed_ttft_s": min(fixed.values()) if fixed else None,
        "best_fixed": min(fixed, key=fixed.get) if fixed else None,
        "worst_fixed_ttft_s": max(fixed.values()) if fixed else None,
        "worst_fixed": max(fixed, key=fixed.get) if fixed else None,
        "adaptive_fetch_s": med.get("adaptive", {}).get("fetch_s"),
        "best_fixed_fetch_s": min(fixed_fetch.values()) if fixed_fetch else None,
        "worst_fixed_fetch_s": max(fixed_fetch.values()) if fixed_fetch else None,
        "cold_ttft_s": round(cold["ttft_s"], 3),
        "medians": med,
        "runs": rows,
        "every_hit_full": all(r["storage_tokens"] == a.chunks * CHUNK for rs in rows.values() for r in rs),
        "store_errors": sum(r["store_errors"] for rs in rows.values() for r in rs),
        "tokens_equal_cold": bool(cold["output_ids"])
        and all(r["same_tokens_as_cold"] for rs in rows.values() for r in rs),
        "cold_output_ids": cold["output_ids"],
        "store_bytes_per_version": cost,
        "writeback_s": round(writeback_s, 1),
        "trace": {
            "paper_gbps": [u for u, _ in TRACE],
            "unit_mbit": round(unit, 2),
            "rates_mbit": [round(u * unit, 2) for u, _ in TRACE],
            "phase_s": round(phase_s, 2),
        },
        "profile": info,
        "setup": {
            "model": "SmolLM2-135M-Instruct float32",
            "chunk_tokens": CHUNK,
            "chunks": a.chunks,
            "reps": a.reps,
            "decoder": "FFmpeg software hevc (PyAV), pool of 2",
            "command": "python -m benchmarks.bench_adaptive_resolution " + " ".join(sys.argv[1:]),
        },
    }
    if result["adaptive_ttft_s"] and fixed:
        result["adaptive_vs_worst"] = round(1 - result["adaptive_ttft_s"] / result["worst_fixed_ttft_s"], 3)
        result["adaptive_over_best"] = round(result["adaptive_ttft_s"] / result["best_fixed_ttft_s"], 3)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\n{'config':<10} {'TTFT s':>8} {'fetch s':>8} {'dec wait s':>11} {'link wait s':>12} "
        f"{'MB fetched':>11}  resolutions"
    )
    for cfg, rs in rows.items():
        m = med[cfg]
        res = rs[len(rs) // 2]["chunks_by_resolution"]
        print(
            f"{cfg:<10} {m['ttft_s']:>8.2f} {m['fetch_s']:>8.2f} {m['decoder_wait_s']:>11.2f} "
            f"{m['link_wait_s']:>12.2f} "
            f"{m['bytes_fetched'] / 1e6:>11.2f}  {res}"
        )
    print(
        json.dumps(
            {
                k: result.get(k)
                for k in (
                    "adaptive_ttft_s",
                    "best_fixed_ttft_s",
                    "worst_fixed_ttft_s",
                    "adaptive_fetch_s",
                    "best_fixed_fetch_s",
                    "worst_fixed_fetch_s",
                    "adaptive_vs_worst",
                    "adaptive_over_best",
                    "tokens_equal_cold",
                )
            }
        )
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
