"""Quick single-thread codec speed check (the official table is ``benchmarks/bench_codec.py``).

``python -m sgl_remote_kv.codec.microbench [--npz PATH] [--chunks N]`` prints, per codec, the ratio and
MB of decoded KV per second for the lossless stage, the dequant stage and the whole decode, measured
both in wall time and in this thread's CPU time (``time.thread_time``: robust on a shared machine).
``--npz`` takes a file with ``k``/``v`` arrays ``[L, T, H, D]`` of bf16 bits (e.g. ``.cache/kvdata/*.npz``);
without it synthetic KV of SmolLM2's shape is used (ratios then mean little).
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from sgl_remote_kv.codec import synthetic, tables
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.format import layer_section

logger = logging.getLogger(__name__)

CONFIGS = [
    ("quant_deflate", {}),
    ("quant_deflate", {"granularity": "head"}),
    ("quant_rans", {}),
    ("quant_rans", {"k_bins": "64", "v_bins": "64"}),
    ("cachegen", {}),
    ("lossless", {}),
]


def _chunks(npz: str | None, n: int, tokens: int = 256):
    fp = synthetic.fingerprint(num_layers=30, heads=3, dim=64, dtype="bfloat16")
    if npz is None:
        return fp, [synthetic.kv(fp.layout, tokens, seed=i) for i in range(n + 2)]
    with np.load(npz, allow_pickle=False) as z:
        k, v = z["k"], z["v"]
    out = [
        (np.ascontiguousarray(k[:, i : i + tokens]), np.ascontiguousarray(v[:, i : i + tokens]))
        for i in range(0, k.shape[1] - tokens + 1, tokens)
    ]
    return fp, out[: n + 2]


def _stages(codec, blobs, fp, clock) -> dict[str, float]:
    t = {"parse": 0.0, "lossless": 0.0, "dequant": 0.0}
    for b in blobs:
        t0 = clock()
        h = codec.parse(b, fp)
        t["parse"] += clock() - t0
        lay = h.layout
        scratch = np.empty(codec.max_scratch_bytes(h), np.uint8)
        ok = np.empty((h.num_tokens, lay.num_kv_heads, lay.head_dim), np.uint16)
        ov = np.empty_like(ok)
        for i in range(lay.num_layers):
            t0 = clock()
            n = codec.lossless_stage(layer_section(b, h, i), scratch)
            t1 = clock()
            codec.dequant_stage(h, i, scratch[:n], ok, ov)
            t["lossless"] += t1 - t0
            t["dequant"] += clock() - t1
    t["decode"] = sum(t.values())
    return t


def run(npz: str | None, n: int, reps: int = 3) -> None:
    fp, chunks = _chunks(npz, n)
    fit, test = chunks[:2], chunks[2:]
    mb = sum(k.nbytes + v.nbytes for k, v in test) / 1e6
    for name, cfg in CONFIGS:
        if name == "quant_rans":
            cfg = {**cfg, "tables": tables.fit(get_codec(name, **cfg).spec, fp, fit)}
        codec = get_codec(name, **cfg)
        t0 = time.thread_time()
        blobs = [codec.encode(k, v, fp) for k, v in test]
        enc = time.thread_time() - t0
        _stages(codec, blobs[:1], fp, time.perf_counter)  # warm-up (numba compile)
        for label, clock in (("wall", time.perf_counter), ("cpu", time.thread_time)):
            best = {}
            for _ in range(reps):
                for key, val in _stages(codec, blobs, fp, clock).items():
                    best[key] = min(best.get(key, 1e9), val)
            rates = " ".join(f"{k} {mb / max(v, 1e-9):6.0f}" for k, v in best.items() if k != "parse")
            shown = {k: v for k, v in cfg.items() if k != "tables"}
            print(
                f"{name:14s} {str(shown):34s} ratio {mb * 1e6 / sum(map(len, blobs)):5.2f}  {label:4s} MB/s: {rates}  encode(cpu) {mb / enc:5.0f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--npz")
    ap.add_argument("--chunks", type=int, default=3)
    a = ap.parse_args()
    run(a.npz, a.chunks)


if __name__ == "__main__":
    main()
