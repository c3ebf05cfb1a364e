"""The DPU path's round machinery at a large model's chunk size (``make bench-dpu-rounds``).

A Llama-3-8B-shaped chunk (32 layers, 8 KV heads of 128, bf16: 32 MiB of KV per 256 tokens) fills half of
the default 64 MiB destination slot, so a remote hit of such a model runs as many 2-chunk rounds, and any
fixed cost per round (a message that waits, a slot freed late) shows up in full. This measures one
``DpuClient`` (a spawned data plane with its default settings, unpinned) fetching ``--chunks`` chunks of
random normal KV (near-incompressible, like the random-weight server of ``scripts/gpu_server_check.sh``)
from a file store into host staging that keeps codes (as on a GPU pool), side by side in one run:

- codec ``quant_deflate`` (the DPU path's codec): the data plane's inflate is the work;
- the same codec with a ``raw`` lossless stage (no entropy coding): inflate costs a copy, so what is left
  is the round machinery (submit, events, staging writes, slot reuse);

each with the default 64 MiB slots (2 chunks a round) and with 16-chunk slots. Rates are the best of
``--repeat`` fetches (tokens/s of wall time); on a 2-core machine the data plane and this process share
the cores. Writes ``docs/results/dpu_rounds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results" / "dpu_rounds.json"
CHUNK = 256


def random_kv(layout, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, CHUNK, layout.num_kv_heads, layout.head_dim)
    out = []
    for _ in range(n):
        k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
        out.append(tuple((a.view(np.uint32) >> 16).astype(np.uint16) for a in (k, v)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--dp-cpus",
        choices=("none", "auto"),
        default="none",
        help="none: the data plane unpinned; auto: pinned where a server pins its own (the last quarter "
        "of the cores on >= 4-core hosts), with one inflate worker per core",
    )
    args = ap.parse_args()

    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.contract.settings import DataPlaneSettings
    from sgl_remote_kv.contract.sizing import DEST_SLOT_BYTES, chunk_bytes
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
    from sgl_remote_kv.fetch.dpu_client.link import auto_cpus
    from sgl_remote_kv.kvpool.staged import StagedPages, codes_bytes_per_token
    from sgl_remote_kv.store.client import open_client
    from sgl_remote_kv.types import KVLayout, ModelFingerprint

    dp_cpus = auto_cpus() if args.dp_cpus == "auto" else ()  # the data plane's cores, or () unpinned
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    fp = ModelFingerprint("LlamaForCausalLM", layout, "bench-dpu-rounds")
    n, cb = args.chunks, chunk_bytes(layout, CHUNK)
    distinct = random_kv(layout, 4, seed=1)  # 4 distinct chunks, stored under n keys
    rows_n = n * CHUNK
    staged = StagedPages(layout, rows_n, 64, keep_codes=True, nbytes=rows_n * codes_bytes_per_token(layout))
    staged.writer.arena.array[:] = 0  # fault the arena in (a GPU pool's is pinned up front)
    work = Path(tempfile.mkdtemp(prefix="bench-dpu-rounds-"))
    rows: list[dict] = []
    try:
        for lossless in ("deflate", "raw"):
            codec = get_codec("quant_deflate", method=lossless)
            url = f"file://{work}/{lossless}"
            client = open_client(url)
            keys = [f"{lossless}-{i}".encode().ljust(32, b"\0") for i in range(n)]
            blobs = [codec.encode(*distinct[i % 4], fp) for i in range(4)]
            client.put_many([(k, blobs[i % 4]) for i, k in enumerate(keys)])
            client.close()
            for label, slot in (("64 MiB (default)", DEST_SLOT_BYTES), ("16 chunks", 16 * cb)):
                spec = DataPlaneSettings(cpus=dp_cpus, slot_bytes=slot)
                dpu = DpuClient(DpuClientConfig(url, dest_slot_bytes=slot, process=spec), fp, codec)
                dpu.start()
                try:
                    best = float("inf")
                    for r in range(args.repeat):
                        target = staged.alloc(rows_n)
                        t0 = time.perf_counter()
                        res = dpu.fetch(f"r{r}", keys, CHUNK, KVTarget(staged.writer, target), timeout=600)
                        dt = time.perf_counter() - t0
                        staged.free(target)
                        if res.hit_chunks != n or res.failures:
                            raise RuntimeError(f"fetch {lossless}/{label}: {res}")
                        best = min(best, dt)
                finally:
                    dpu.close()
                row = {
                    "lossless_stage": lossless,
                    "slot": label,
                    "chunks_per_round": slot // cb,
                    "chunks": n,
                    "seconds": round(best, 4),
                    "tokens_per_s": round(n * CHUNK / best),
                    "codes_gb_per_s": round(sum(len(b) for b in blobs) / 4 * n / best / 1e9, 3),
                }
                rows.append(row)
                print(
                    f"{lossless:8s} {label:17s} {row['chunks_per_round']:>2} chunks/round  "
                    f"{row['seconds']:.3f} s  {row['tokens_per_s']:>7} tokens/s",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    out = {
        "benchmark": "bench_dpu_rounds",
        "commit": commit,
        "layout": "llama3-8b-shape (32 layers, 8 KV heads, 128 head dim, bf16)",
        "kv": "random normal (near-incompressible)",
        "cpus": len(os.sched_getaffinity(0)),
        "data_plane": DataPlaneSettings(cpus=dp_cpus).describe_workers(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
