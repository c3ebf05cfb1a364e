"""A fetch under a changing bandwidth: simulated transmission, real decoding (used by ``bench_nvdec``).

The link sends one chunk at a time; its transmission time is computed from the chunk's bytes and a
piecewise-constant bandwidth trace and spent with ``time.sleep`` (so the pool decodes concurrently, for
real, on this machine's cores). When a chunk has "arrived" it is submitted to the decoder pool, whose
``SlotWriter`` restores it into a KV pool tensor. Before each transmission the policy picks the chunk's
resolution: a fixed one, or Alg. 1 (``adaptive.choose``) with the last chunk's bandwidth, the pool load
and the profiled table. The fetch time is from the first byte to the last restored frame.
"""

from __future__ import annotations

import time
from concurrent.futures import wait

import numpy as np
from sgl_remote_kv.nvdec.pool import DecoderPool, SlotWriter

from benchmarks import nvdec_adaptive as adaptive

TRACE_DOC = (
    "piecewise-constant bandwidth: 'high' (2x the fastest balanced rate of any resolution) until t_switch, "
    "then 'low' (0.5x the slowest); t_switch = the time the decode stage needs for half the chunks at the "
    "fastest resolution. A resolution's balanced rate = mean blob bytes / decode service time, the service "
    "time = latency at full load / instances (profiled). The link stops while the bitstream buffer (chunks "
    "queued or decoding in the pool) holds BUFFER_PER_INSTANCE x instances chunks."
)
BUFFER_PER_INSTANCE = 2


def make_trace(table: adaptive.ProfileTable, n_chunks: int) -> list[tuple[float, float]]:
    """[(start_s, bytes_per_s), ...] derived from the profiled table (see TRACE_DOC)."""
    full = table.loads[-1]
    rates = [
        s / (table.lookup(r, full)[0] / table.instances)
        for r, s in zip(table.resolutions, table.size_bytes, strict=True)
    ]
    hi, lo = 2.0 * max(rates), 0.5 * min(rates)
    pace = min(
        max(s / hi, table.lookup(r, full)[0] / table.instances)
        for r, s in zip(table.resolutions, table.size_bytes, strict=True)
    )
    return [(0.0, hi), (pace * n_chunks / 2, lo)]


def transmit_time(nbytes: int, start: float, trace: list[tuple[float, float]]) -> float:
    """Seconds to send ``nbytes`` starting at ``start`` under the piecewise-constant ``trace``."""
    t, left = start, float(nbytes)
    for i, (seg_start, bw) in enumerate(trace):
        seg_end = trace[i + 1][0] if i + 1 < len(trace) else float("inf")
        if t >= seg_end:
            continue
        t = max(t, seg_start)
        can = (seg_end - t) * bw
        if left <= can:
            return t + left / bw - start
        left -= can
        t = seg_end
    raise AssertionError("unreachable: the last segment is unbounded")


def fetch(order: list[int], blobs: dict, fp, table, trace, instances: int, policy) -> dict:
    """One fetch of chunks ``order`` (indices into each ``blobs[res]``); ``policy`` is a resolution or
    ``"stage"``/``"bubble"``. Returns fetch time, bytes sent, resolutions chosen."""
    lay = fp.layout
    tokens = 256
    k_pool = np.zeros((lay.num_layers, len(order) * tokens, lay.num_kv_heads, lay.head_dim), np.uint16)
    v_pool = np.zeros_like(k_pool)
    est = adaptive.BandwidthEstimator(trace[0][1])
    chosen, futs, sent, active = [], [], 0, None
    with DecoderPool(instances) as pool:
        t0 = time.perf_counter()
        link = 0.0
        for n, idx in enumerate(order):
            while pool.load() >= BUFFER_PER_INSTANCE * instances:  # bounded bitstream buffer
                time.sleep(0.002)
            if isinstance(policy, int):
                res = policy
            else:
                sizes = {r: len(blobs[r][idx]) for r in blobs}
                res = adaptive.choose(
                    sizes, est.value, table, pool.load() + 1, active, objective=policy
                ).resolution
            blob = blobs[res][idx]
            start = max(link, time.perf_counter() - t0)
            dt = transmit_time(len(blob), start, trace)
            link = start + dt
            time.sleep(max(0.0, t0 + link - time.perf_counter()))
            est.update(len(blob), dt)
            slots = np.arange(n * tokens, (n + 1) * tokens)
            futs.append(pool.submit(blob, fp, SlotWriter(k_pool, v_pool, slots, lay.dtype)))
            chosen.append(res)
            sent += len(blob)
            active = res
        wait(futs)
        total = time.perf_counter() - t0
        [f.result() for f in futs]
    return {"fetch_s": total, "link_busy_s": link, "bytes": sent, "resolutions": chosen}


def run_fetch(blobs: dict, fp, table, instances: int, rounds: int, repeats: int = 2) -> dict:
    """Every policy ``repeats`` times, interleaved (machine load drifts); per policy the runs and the mean."""
    n = len(next(iter(blobs.values())))
    order = [i for _ in range(rounds) for i in range(n)]
    trace = make_trace(table, len(order))
    runs: dict[str, list] = {}
    for _ in range(repeats):
        for policy in [*sorted(blobs), "stage", "bubble"]:
            label = f"fixed {policy} tok/frame" if isinstance(policy, int) else f"adaptive ({policy})"
            runs.setdefault(label, []).append(fetch(order, blobs, fp, table, trace, instances, policy))
    mean = {k: sum(r["fetch_s"] for r in v) / len(v) for k, v in runs.items()}
    best_fixed = min((v, k) for k, v in mean.items() if k.startswith("fixed"))
    return {
        "trace_bytes_per_s": trace,
        "chunks": len(order),
        "repeats": repeats,
        "mean_fetch_s": mean,
        "runs": runs,
        "best_fixed": best_fixed[1],
    }
