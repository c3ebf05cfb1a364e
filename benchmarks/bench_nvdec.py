"""NVDEC-path benchmark (issue 6) -> ``docs/results/nvdec.json`` (+ its rows merged into ``codec.json``).

On the codec table's real SmolLM2 KV (same texts, 256-token bf16 chunks), CPU twin of the NVDEC pool
(FFmpeg's software ``hevc`` decoder; libx265 ``lossless=1`` encode):

1. ``search``: intra-frame tiling search (paper §3.2.2) on the first tune text's first chunk (6 layers).
2. ``resolutions``: ratio per tokens-per-frame on the tune texts' first chunks; the best is ``choice``.
3. ``rows``: codec-table rows (ratio, bits/value, single-thread MB/s, KL/top-1) for our layout, the naive
   llm.265 layout and the entropy-coded codecs with the same quantization, on all texts.
4. ``long_chunks``: ratio with whole 1,792-token prefixes as one chunk (more frames to predict from).
5. ``throughput``: decode+restore MB/s (bf16 KV bytes) through the pool, 1 instance and 2, per resolution.
6. ``profile`` + ``adaptive``: the decode table profiled by the pool, then a fetch of the tune chunks under
   a bandwidth trace that drops mid-fetch: transmission is simulated (sleep bytes / bandwidth) while the
   pool decodes for real; adaptive (Alg. 1, both objectives) vs every fixed resolution.

CLI: ``python -m benchmarks.bench_nvdec [--texts a,b] [--greedy] [--instances 2] [--skip-rows] [--only adaptive,bins]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import wait  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import sgl_remote_kv.nvdec  # noqa: E402, F401
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec  # noqa: E402
from sgl_remote_kv.nvdec.pool import DecoderPool, SlotWriter  # noqa: E402

from benchmarks import bench_codec, kvdata  # noqa: E402
from benchmarks import nvdec_adaptive as adaptive  # noqa: E402
from benchmarks import nvdec_rows as bench_rows  # noqa: E402
from benchmarks.nvdec_search import search_tiling  # noqa: E402
from benchmarks.nvdec_sim import TRACE_DOC, run_fetch  # noqa: E402
from sgl_remote_kv.codec.base import get_codec  # noqa: E402

OUT = kvdata.REPO / "docs" / "results" / "nvdec.json"
RESOLUTIONS = (16, 32, 64, 128, 256)
SECTIONS = ("search", "sweep", "throughput", "adaptive", "long", "bins", "rows")
SWEEP_CHUNKS = 3  # first chunks of each tune text used for the sweep, throughput and the fetch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def chunk(t, i: int, n: int = bench_codec.CHUNK):
    return np.ascontiguousarray(t.k[:, i * n : (i + 1) * n]), np.ascontiguousarray(
        t.v[:, i * n : (i + 1) * n]
    )


def hevc(tiling: str, tpf: int, **kw) -> HevcCodec:
    return HevcCodec(**bench_rows.QUANT, tiling=tiling, tokens_per_frame=tpf, **kw)


def do_search(tune, fp) -> dict:
    t0 = time.perf_counter()
    res = search_tiling([chunk(tune[0], 0)], fp, layers=6, **bench_rows.QUANT, tokens_per_frame=16)
    log(f"search: best {res.best} ({time.perf_counter() - t0:.0f} s)")
    return {
        "best": res.best,
        "bytes": dict(res.sizes),
        "sample": f"{tune[0].name} chunk 0, layers 0-5, 16 tok/frame",
    }


def do_sweep(tune, fp, tiling: str) -> tuple[dict, dict]:
    """Ratio per resolution on the tune chunks; returns (summary, blobs[res] -> list of blobs)."""
    chunks = [chunk(t, i) for t in tune for i in range(SWEEP_CHUNKS)]
    raw = sum(k.nbytes + v.nbytes for k, v in chunks)
    out, blobs = {}, {}
    for res in RESOLUTIONS:
        codec = hevc(tiling, res)
        t0 = time.perf_counter()
        blobs[res] = [codec.encode(k, v, fp) for k, v in chunks]
        enc = time.perf_counter() - t0
        size = sum(len(b) for b in blobs[res])
        out[res] = {
            "ratio": raw / size,
            "bytes": size,
            "encode_mb_s": raw / enc / 1e6,
            **codec.frame_layout(bench_codec.CHUNK, 3, 64).describe(),
        }
        log(f"sweep {res} tok/frame: ratio {raw / size:.3f} ({enc:.0f} s)")
    return {"chunks": len(chunks), "bf16_bytes": raw, "per_resolution": out}, blobs


def do_rows(ctx, choice: dict) -> list[dict]:
    rows = []
    for label, codec in (
        (
            "quant_deflate (256 bins/head, deflate) = default codec",
            get_codec("quant_deflate", **bench_rows.QUANT),
        ),
        (
            "quant_deflate (256 bins/head, zstd 19)",
            get_codec("quant_deflate", **bench_rows.QUANT, method="zstd", level=19),
        ),
    ):
        rows.append(ctx.measure_codec(label, codec, family="entropy-coded", codec_name=type(codec).name))
    for r in bench_rows.rows(ctx, choice):
        rows.append(r)
    for r in rows:
        log(f"row {r['codec']}: ratio {r['ratio']:.3f} kl {r['kl']:.5f} dec {r['decode_mb_s']:.1f} MB/s")
    return rows


def do_long(texts, fp, choice: dict) -> dict:
    """Whole 1,792-token prefixes as single chunks (a tune and a held-out text)."""
    picks = [t for t in texts if t.role == "tune"][:1] + [t for t in texts if t.role == "heldout"][:1]
    codecs = {
        f"ours {choice['tiling']} {choice['tokens_per_frame']} tok/frame": hevc(
            choice["tiling"], choice["tokens_per_frame"]
        ),
        f"ours {choice['tiling']} 256 tok/frame": hevc(choice["tiling"], 256),
        "naive llm.265": hevc(bench_rows.naive_tiling_spec(), 0, grid_cols=1),
        "quant_deflate": get_codec("quant_deflate", **bench_rows.QUANT),
    }
    out = {"texts": [t.name for t in picks], "tokens": kvdata.PREFIX, "ratio": {}}
    for label, codec in codecs.items():
        raw = size = 0
        for t in picks:
            k, v = chunk(t, 0, kvdata.PREFIX)
            size += len(codec.encode(k, v, fp))
            raw += k.nbytes + v.nbytes
        out["ratio"][label] = raw / size
        log(f"long chunk {label}: ratio {raw / size:.3f}")
    return out


def do_bins(tune, fp, choice: dict) -> dict:
    """Does video coding pay at coarser quantization? Ratio of hevc vs Deflate per bin count (tune chunks)."""
    chunks = [chunk(t, i) for t in tune for i in range(SWEEP_CHUNKS)]
    raw = sum(k.nbytes + v.nbytes for k, v in chunks)
    out = {}
    for bins in ("256", "64", "16"):
        q = {**bench_rows.QUANT, "k_bins": bins, "v_bins": bins}
        ours = HevcCodec(**q, tiling=choice["tiling"], tokens_per_frame=choice["tokens_per_frame"])
        qd = get_codec("quant_deflate", **q)
        out[bins] = {
            "hevc": raw / sum(len(ours.encode(k, v, fp)) for k, v in chunks),
            "quant_deflate": raw / sum(len(qd.encode(k, v, fp)) for k, v in chunks),
        }
        log(f"bins {bins}: {out[bins]}")
    return out


def _pool_pass(blobs: list, fp, instances: int) -> tuple[float, float]:
    """Decode + restore every blob through a pool of ``instances``; (wall s, summed worker CPU s)."""
    lay = fp.layout
    n = len(blobs) * bench_codec.CHUNK
    k_pool = np.zeros((lay.num_layers, n, lay.num_kv_heads, lay.head_dim), np.uint16)
    v_pool = np.zeros_like(k_pool)
    slots = np.arange(n).reshape(len(blobs), -1)
    with DecoderPool(instances) as pool:
        t0 = time.perf_counter()
        futs = [
            pool.submit(b, fp, SlotWriter(k_pool, v_pool, s, lay.dtype))
            for b, s in zip(blobs, slots, strict=True)
        ]
        wait(futs)
        wall = time.perf_counter() - t0
        cpu = sum(f.result().cpu_s for f in futs)
    return wall, cpu


def do_throughput(blobs: dict, fp, raw_per_chunk: int, instances: int) -> dict:
    out = {}
    _pool_pass(next(iter(blobs.values()))[:1], fp, 1)  # warm-up (numba, FFmpeg)
    for res, bl in blobs.items():
        row = {}
        for n in sorted({1, instances}):
            wall, cpu = _pool_pass(bl, fp, n)
            row[f"pool_{n}_mb_s"] = raw_per_chunk * len(bl) / wall / 1e6
            row[f"pool_{n}_chunk_s"] = wall / len(bl)
            row[f"pool_{n}_cpu_mb_s_per_instance"] = raw_per_chunk * len(bl) / cpu / 1e6
        out[res] = row
        log(f"throughput {res} tok/frame: {row}")
    return out


def do_adaptive(blobs: dict, fp, tiling: str, instances: int, rounds: int, repeats: int) -> dict:
    key = adaptive.table_key(
        {**bench_rows.QUANT, "tiling": tiling, "resolutions": sorted(blobs)}, "cpu", instances
    )
    with DecoderPool(instances) as pool:
        table = adaptive.load_or_profile(
            key, lambda: adaptive.profile(pool, fp, blobs, lambda: lambda fc: None), refresh=True
        )
    log(f"profile: {table}")
    runs = run_fetch(blobs, fp, table, instances, rounds, repeats)
    return {
        "profile": json.loads(table.to_json()),
        "profile_path": str(adaptive.default_path(key)),
        "trace": TRACE_DOC,
        **runs,
    }


def merge_codec_json(rows: list[dict]) -> None:
    """Replace/append our rows in an existing codec.json (the codec runner also adds them itself)."""
    if not bench_codec.OUT.exists():
        return
    doc = json.loads(bench_codec.OUT.read_text())
    labels = {r["codec"] for r in rows}
    doc["rows"] = [r for r in doc["rows"] if r["codec"] not in labels] + rows
    bench_codec.OUT.write_text(json.dumps(doc, indent=1))
    log(f"merged {len(rows)} rows into {bench_codec.OUT}")


def _merge(out: Path, doc: dict) -> None:
    """Write ``doc``'s sections into ``out`` as it is now (another run may have written it)."""
    cur = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**cur, **{k: v for k, v in doc.items() if k != "meta"}}, indent=1))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="NVDEC path benchmark (CPU twin)")
    ap.add_argument("--texts", default="")
    ap.add_argument("--greedy", action="store_true", help="also the 32-token greedy match (slow)")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the tune chunks in the fetch")
    ap.add_argument("--fetch-repeats", type=int, default=2, help="interleaved repeats of every fetch policy")
    ap.add_argument("--skip-rows", action="store_true", help="skip the codec-table rows (quality runs)")
    ap.add_argument("--only", default="", help=f"comma-separated sections to (re)run into --out: {SECTIONS}")
    ap.add_argument("--out", default=str(OUT))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    names = [n for n in args.texts.split(",") if n] or None
    fp = kvdata.fingerprint()
    texts = kvdata.load_texts(names)
    tune = [t for t in texts if t.role == "tune"] or texts[:1]
    doc: dict = {
        "meta": {
            "texts": kvdata.describe(texts),
            "chunk_tokens": bench_codec.CHUNK,
            "quant": bench_rows.QUANT,
            "device": "cpu (FFmpeg hevc software decoder)",
            "encoder": "libx265 lossless=1 preset fast pools=1",
            "cores": os.cpu_count(),
        }
    }
    if args.only:
        doc = {**old, **doc}
    if "search" in only or "search" not in doc:
        doc["search"] = do_search(tune, fp)
    if only & {"sweep", "throughput", "adaptive"}:
        sweep, blobs = do_sweep(tune, fp, doc["search"]["best"])
        doc["resolutions"] = sweep
        best_res = max(sweep["per_resolution"], key=lambda r: sweep["per_resolution"][r]["ratio"])
        doc["choice"] = {"tiling": doc["search"]["best"], "tokens_per_frame": best_res}
        if not args.only:
            out.write_text(json.dumps(doc, indent=1))  # early write: bench_rows reads the choice
    if "throughput" in only:
        raw_chunk = sweep["bf16_bytes"] / sweep["chunks"]
        doc["throughput"] = do_throughput(blobs, fp, raw_chunk, args.instances)
    if "adaptive" in only:
        tiling = doc["choice"]["tiling"]
        doc["adaptive"] = do_adaptive(blobs, fp, tiling, args.instances, args.rounds, args.fetch_repeats)
        if args.only:
            _merge(out, doc)
    if "long" in only:
        doc["long_chunks"] = do_long(texts, fp, doc["choice"])
        if args.only:
            _merge(out, doc)
    if "bins" in only:
        doc["bins"] = do_bins(tune, fp, doc["choice"])
        if args.only:
            _merge(out, doc)
    if "rows" in only and not args.skip_rows:
        ctx = bench_codec.EvalContext.create(names, greedy=args.greedy, repeat=1)
        doc["rows"] = do_rows(ctx, doc["choice"])
        print(bench_codec.format_table(doc["rows"]))
        merge_codec_json([r for r in doc["rows"] if r.get("codec_name") == "hevc"])
    if args.only:
        _merge(out, doc)
        doc = json.loads(out.read_text())
    doc["meta"][f"runtime_s{'_' + args.only if args.only else ''}"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    log(f"wrote {args.out} ({doc['meta']['runtime_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
