"""Decode speed per core of the default codecs, stage by stage (``make bench-codec-speed``).

One thread (BLAS, numba and OpenMP pinned to 1), real SmolLM2 KV (bf16, held-out text apache2, 256-token
chunks at their positions), each chunk decoded layer by layer through the two stages the DPU pipeline
runs (``lossless_stage`` into a scratch buffer, ``dequant_stage`` into preallocated outputs), so no
allocation but the stages' own. MB = decoded bf16 KV bytes; rates per CPU-second of this thread
(``time.thread_time``), so other load on the box inflates them less than wall time would. Writes
``docs/results/codec_speed.json`` and prints a table. Compare rows of one run only.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import kvdata  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "codec_speed.json"


def codecs(fp) -> list[tuple[str, object]]:
    from sgl_remote_kv.codec import calibration
    from sgl_remote_kv.codec.base import default_codec, get_codec
    from sgl_remote_kv.types import DEFAULT_QUALITY

    out = [("quant_deflate (previous default)", default_codec())]
    full = calibration.find_for(fp, DEFAULT_QUALITY)
    per_head = [
        c
        for c in calibration.registered()
        if c.model_key == full.model_key and c.group_dim == fp.layout.head_dim
    ]
    for label, cal in (("transform", full), ("transform per-head", per_head[-1] if per_head else None)):
        if cal is None:
            print(f"skip {label}: no such calibration (calibrate --group-heads 1)", file=sys.stderr)
            continue
        # (label suffix, params): scalar with each entropy stage, and the trellis (full calibration only)
        variants = [(e, {"entropy": e}) for e in ("deflate", "rans", "zstd")]
        if label == "transform":
            variants += [
                (f"{e} trellis", {"entropy": e, "quantizer": "trellis"}) for e in ("deflate", "zstd")
            ]
        for suffix, params in variants:
            codec = get_codec("transform", calibration=cal.calib_id.hex(), quality=DEFAULT_QUALITY, **params)
            out.append((f"{label} {suffix} {DEFAULT_QUALITY}", codec))
    return out


def measure(codec, fp, chunks, repeat: int) -> dict:
    from sgl_remote_kv.codec.format import layer_section

    blobs = [codec.encode(k, v, fp, start=s) for k, v, s in chunks]
    raw = sum(k.nbytes + v.nbytes for k, v, _ in chunks)
    t0 = time.thread_time()
    for k, v, s in chunks:
        codec.encode(k, v, fp, start=s)
    enc = time.thread_time() - t0
    lossless = dequant = 0.0
    for _ in range(repeat):
        for blob in blobs:
            hdr = codec.parse(blob, fp)
            scratch = np.empty(codec.max_scratch_bytes(hdr), np.uint8)
            shape = (hdr.num_tokens, fp.layout.num_kv_heads, fp.layout.head_dim)
            ok, ov = np.empty(shape, np.uint16), np.empty(shape, np.uint16)
            for i in range(fp.layout.num_layers):
                t0 = time.thread_time()
                n = codec.lossless_stage(layer_section(blob, hdr, i), scratch)
                t1 = time.thread_time()
                codec.dequant_stage(hdr, i, scratch[:n], ok, ov)
                t2 = time.thread_time()
                lossless, dequant = lossless + t1 - t0, dequant + t2 - t1
    mb = raw * repeat / 1e6
    return {
        "ratio": raw / sum(map(len, blobs)),
        "lossless_mb_s": mb / lossless,
        "dequant_mb_s": mb / dequant,
        "decode_mb_s": mb / (lossless + dequant),
        "encode_mb_s": raw / 1e6 / enc,
    }


def _gemm() -> dict:
    from sgl_remote_kv.codec import inverse

    t_int, t_float = inverse._time_gemms()
    return {
        "int8_mm_exact": inverse._int_mm_exact(),
        "int8_mm_ms": round(t_int * 1e3, 3),
        "float_ms": round(t_float * 1e3, 3),
        "used": "int8" if inverse._use_int_mm(256) else "float",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="apache2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    fp = kvdata.fingerprint()
    text = next(t for t in kvdata.load_texts([args.text]) if t.name == args.text)
    n = text.k.shape[1]
    chunks = [
        (np.ascontiguousarray(text.k[:, s : s + 256]), np.ascontiguousarray(text.v[:, s : s + 256]), s)
        for s in range(0, n - 255, 256)
    ]
    rows = []
    print(
        f"{'codec':40s} {'ratio':>6s} {'lossless':>9s} {'dequant':>9s} {'decode':>9s} {'encode':>9s}  (MB/s per core)"
    )
    for label, codec in codecs(fp):
        codec.decode(codec.encode(*chunks[0][:2], fp, start=chunks[0][2]), fp)  # kernels compiled / loaded
        r = {"codec": label, "params": codec.params(), **measure(codec, fp, chunks, args.repeat)}
        rows.append(r)
        print(
            f"{label:40s} {r['ratio']:6.2f} {r['lossless_mb_s']:9.0f} {r['dequant_mb_s']:9.0f} "
            f"{r['decode_mb_s']:9.0f} {r['encode_mb_s']:9.0f}"
        )
    meta = {
        "text": args.text,
        "chunks": len(chunks),
        "repeat": args.repeat,
        "threads": 1,
        "cpu": kvdata.cpu_model(),
        "isa": kvdata.cpu_isa(),
        "gemm": _gemm(),  # which exact GEMM the transform decode took on this CPU (codec.inverse)
        "unit": "MB of decoded bf16 KV per CPU-second of one thread",
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
