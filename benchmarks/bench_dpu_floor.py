"""DPU fetch time vs the wire floor over a shaped link, and where the rest goes (issue 17 item 3).

A ``DpuClient`` (its data plane spawned and pinned to ``--cpus``, the serving defaults otherwise) fetches
one request of ``--chunks`` x 256 tokens of real SmolLM2 KV (bf16, consecutive chunks of one text at
their positions) from a redis-server in its own network namespace behind a ``tc tbf`` link, into a CPU
KV pool through the pool's ``KVWriter`` (what a server's receiver thread does). Per rate and variant,
``--reps`` fetches (after one warm-up); reported: the median time from ``submit`` to the result, the
wire floor (the hit chunks' compressed bytes / link rate), their ratio (target <= 1.2x), and the median
tail after the last byte: ``FetchResult`` time minus the time the store's last reply left the link,
approximated as submit + floor. A reference row ``raw GETs (no decode)`` times plain sequential redis-py
GETs of the same values from this process: what the link (TCP/IP framing included, ~4% over the floor)
gives with no decoding at all. Variants (all in one run, interleaved per rep so they see the same load) are
the data plane's ordering and store-read ablations:

- ``round barrier, whole gets``: slabs of a round start decoding only once every chunk of the round was
  fetched, whole-value gets, one pool write per host round (the first design; ``Debug.round_barrier``);
- ``as fetched, whole gets``: a chunk's slabs start as soon as its whole value arrived, lower layer groups
  first; each run of finished layers written into the pool at once; the fetch gate (``dpu/fetch_gate.py``)
  admits one fetch or both workers as it measures the link (the default before streamed gets);
- ``streamed, 1 fetch worker``: values read in pieces (``--stream-piece-kib``), each layer group decoded
  once its bytes are in; one fetch worker;
- ``streamed (default)``: the same with two fetch workers behind the adaptive gate;
- ``streamed, codes (dequant in the pool's writer)``: the default, but the data plane stops after the
  lossless stage and writes codes (``--remote-kv-dpu-output codes``, a GPU pool's default); this
  process's receiver thread dequantizes them into the CPU pool (on core ``--host-cpus``, one torch
  thread), standing in for the GPU that does it on a GPU host.

Per row also: the data plane's CPU per fetch (its stages' thread CPU, from its stats, and the whole process's,
store client threads included) and the host receiver thread's time in the pool's writer per fetch (wall;
includes the dequant for ``codes``).

Each variant's data plane lives through all rates of a codec (640, 320, 160 Mbit/s in turn), so the gate
must follow each change of rate.

Codecs: the DPU default (``transform``, Deflate; needs the model's calibration) and ``quant_deflate``.
Writes ``docs/results/dpu_floor.json`` and prints a table. Needs root (network namespaces).
"""

from __future__ import annotations

import os

# One OpenMP thread per torch caller (before torch loads): this process stands for a server on one core
# (``--host-cpus``), and the codes variant's integer GEMM runs on its receiver thread. An OpenMP team of
# two on one core spins: that variant's pool writes took ~40x longer (1.9 s per fetch instead of ~50 ms).
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import torch

from benchmarks import kvdata
from benchmarks.bench_dpu import process_cpu_s
from benchmarks.e2e_server import REDIS_PORT, shaped_store
from benchmarks.netshape import netns_supported
from sgl_remote_kv.codec import calibration
from sgl_remote_kv.codec.base import default_codec, get_codec
from sgl_remote_kv.contract.settings import DataPlaneSettings, Debug
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.store.redis_store import redis_key
from sgl_remote_kv.types import DEFAULT_QUALITY

RAW = "raw GETs (no decode)"
OUT = kvdata.REPO / "docs" / "results" / "dpu_floor.json"
CHUNK = 256
FIXED = {"fetch_concurrency": "fixed"}
VARIANTS = {  # name -> (data-plane debug settings, client config overrides, data-plane settings overrides)
    "round barrier, whole gets": (
        {"round_barrier": True},
        {"eager_writes": False},
        {**FIXED, "stream_piece_kib": 0},
    ),
    "as fetched, whole gets": ({}, {}, {"stream_piece_kib": 0}),
    "streamed, 1 fetch worker": ({}, {}, {"workers": (1, 1, 1, 1)}),
    "streamed (default)": ({}, {}, {}),
    "streamed, codes (dequant in the pool's writer)": ({}, {"output": "codes"}, {}),
}


def _codecs(fp) -> dict[str, object]:
    out = {}
    cal = calibration.find_for(fp, DEFAULT_QUALITY)
    if cal is None:
        print("skip transform: no calibration for the model (make calibration)", file=sys.stderr)
    else:
        out["transform"] = get_codec(
            "transform", calibration=cal.calib_id.hex(), quality=DEFAULT_QUALITY, entropy="deflate"
        )
    out["quant_deflate"] = default_codec()
    return out


def _target(fp, tokens: int) -> KVTarget:
    lay = fp.layout
    shape = (tokens + 64, lay.num_kv_heads, lay.head_dim)
    k = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(lay.num_layers)]
    v = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(lay.num_layers)]
    slots = torch.randperm(tokens + 64, generator=torch.Generator().manual_seed(0))[:tokens].to(torch.int64)
    return KVTarget(writer_for(PoolTensors(k, v), lay), slots)


def _client(
    url: str, fp, codec, cpus: tuple[int, ...], debug: dict, over: dict, chunks: int, settings: dict
) -> DpuClient:
    cb = chunk_bytes(fp.layout, CHUNK)
    spec = DataPlaneSettings.from_flags([], cpus=cpus, **settings)
    spec = dataclasses.replace(spec, debug=Debug(**debug))
    cfg = DpuClientConfig(
        url,
        dest_slots=2,
        dest_slot_bytes=max(cb * chunks, 64 << 20),
        process=spec,
        start_timeout_s=60,
        **over,
    )
    c = DpuClient(cfg, fp, codec)
    c.start()
    return c


def _cpu(c: DpuClient) -> tuple[float, float, float]:
    """(the data plane's stage CPU seconds so far, by its last heartbeat; the client's seconds in pool writes;
    the data-plane process's CPU seconds: stages, store client threads, server thread)."""
    stages = json.loads(c.stats().get("dataplane") or "{}").get("pipeline", {})
    return sum(st["cpu_s"] for st in stages.values()), c.stats()["write_s"], process_cpu_s(c.pid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="640,320,160", help="link rates, Mbit/s")
    ap.add_argument("--chunks", type=int, default=4, help="chunks of 256 tokens per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpus", default="1", help="the data plane's cores")
    ap.add_argument("--host-cpus", default="0", help="this process's and the store's cores (the server's)")
    ap.add_argument("--codecs", default="transform,quant_deflate")
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="a subset of the variants (names as in the table, quoted)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    variants = {v: VARIANTS[v] for v in a.variants}
    ok, why = netns_supported()
    if not ok:
        print(f"needs network namespaces: {why}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {int(x) for x in a.host_cpus.split(",")})  # inherited by redis-server
    fp = kvdata.fingerprint()
    text = kvdata.load_texts()[0]
    n = a.chunks
    pieces = [
        (
            np.ascontiguousarray(text.k[:, i * CHUNK : (i + 1) * CHUNK]),
            np.ascontiguousarray(text.v[:, i * CHUNK : (i + 1) * CHUNK]),
            i * CHUNK,
        )
        for i in range(n)
    ]
    cpus = tuple(int(x) for x in a.cpus.split(","))
    codecs = {k: v for k, v in _codecs(fp).items() if k in a.codecs.split(",")}
    rates = [float(r) for r in a.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="srkv-floor-") as tmp, shaped_store(Path(tmp)) as store:
        for cname, codec in codecs.items():
            blobs = [codec.encode(k, v, fp, start=s) for k, v, s in pieces]
            keys = [f"floor-{cname}-{i}".encode().ljust(32, b"\0") for i in range(n)]
            sc = open_client(store.url)
            sc.put_many(list(zip(keys, blobs, strict=True)))
            sc.close()
            raw = redis.Redis(host=store.link.ns_addr, port=REDIS_PORT)
            clients = {
                v: _client(store.url, fp, codec, cpus, d, o, n, st) for v, (d, o, st) in variants.items()
            }
            try:
                for rate in rates:
                    store.set_rate(rate)
                    got: dict[str, list[tuple[float, int]]] = {v: [] for v in [RAW, *variants]}
                    before = {v: _cpu(c) for v, c in clients.items()}
                    for rep in range(a.reps + 1):
                        t0 = time.perf_counter()
                        for k in keys:
                            raw.get(redis_key(k))
                        if rep:
                            got[RAW].append((time.perf_counter() - t0, sum(map(len, blobs))))
                        for v, c in clients.items():
                            target = _target(fp, n * CHUNK)
                            t0 = time.perf_counter()
                            res = c.fetch(f"r{rep}", keys, CHUNK, target, timeout=120)
                            dt = time.perf_counter() - t0
                            if res.hit_chunks != n:
                                raise RuntimeError(f"{v}: {res.failures}")
                            if rep:  # the first fetch of each client warms it up
                                got[v].append((dt, res.wire_bytes))
                    time.sleep(1.5)  # a heartbeat with the last fetch's stage statistics
                    cost = {}  # per fetch (warm-up included): (data-plane CPU ms, host time in pool writes ms)
                    for v, c in clients.items():
                        cost[v] = [
                            (t1 - t0) * 1e3 / (a.reps + 1) for t0, t1 in zip(before[v], _cpu(c), strict=True)
                        ]
                    for v, runs in got.items():
                        wire = runs[0][1]
                        floor = wire * 8 / (rate * 1e6)
                        med = statistics.median(t for t, _ in runs)
                        rows.append(
                            {
                                "codec": cname,
                                "rate_mbit": rate,
                                "variant": v,
                                "wire_bytes": wire,
                                "floor_s": floor,
                                "median_s": med,
                                "min_s": min(t for t, _ in runs),
                                "over_floor": med / floor,
                                "tail_ms": (med - floor) * 1e3,
                                "all_s": [t for t, _ in runs],
                                # the data plane's fetch gate at its last heartbeat (limit, rates)
                                "fetch_gate": json.loads(clients[v].stats().get("dataplane") or "{}").get(
                                    "fetch_gate"
                                )
                                if v in clients
                                else None,
                                "dp_cpu_ms": cost[v][0] if v in cost else None,
                                "host_write_ms": cost[v][1] if v in cost else None,
                                "dp_process_cpu_ms": cost[v][2] if v in cost else None,
                            }
                        )
                        r = rows[-1]
                        extra = (
                            f"  DP CPU {r['dp_cpu_ms']:5.1f} ms (process {r['dp_process_cpu_ms']:5.1f})  "
                            f"host write {r['host_write_ms']:5.1f} ms"
                            if v in cost
                            else ""
                        )
                        print(
                            f"{cname:14s} {rate:5.0f} Mbit/s  {v:28s} floor {floor * 1e3:6.1f} ms  "
                            f"median {med * 1e3:6.1f} ms  {r['over_floor']:.2f}x  tail {r['tail_ms']:5.1f} ms{extra}",
                            flush=True,
                        )
            finally:
                for c in clients.values():
                    c.close()
    meta = {
        "chunks": n,
        "chunk_tokens": CHUNK,
        "reps": a.reps,
        "cpus": a.cpus,
        "host_cpus": a.host_cpus,
        "text": text.name,
        "pool": "CPU (HostKVWriter), bf16",
        "cpu": kvdata.cpu_model(),
        "note": "floor = hit chunks' compressed bytes / rate (no TCP/IP overhead); one fetch at a time",
    }
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
