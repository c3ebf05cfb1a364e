"""Store benchmark: get/put throughput and latency per backend, and fetch time over a shaped link.

Part 1: for 1, 2, 4, 8 MB random (incompressible) blobs, per backend (embedded directory store, a
real redis-server, a real 3-node Redis Cluster, and the fault-tolerant client over Redis): one key
per call, ``put_many`` then ``get_many``; latency p50/p95 and throughput; plus one batched
``get_many`` of all keys.

Part 2: redis-server runs inside a network namespace behind a veth shaped with ``tc tbf``
(``benchmarks/netshape.py``); the client in the root namespace fetches blobs at several rates; the
fetch time is reported next to the wire-time floor (payload bytes / rate). If namespaces are not
permitted, part 2 is recorded as skipped with the reason; nothing is simulated.

Run: ``python -m benchmarks.bench_store`` (writes ``docs/results/store.json`` and prints a table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.netshape import netns_supported, shaped_link, tbf_burst_bytes
from benchmarks.redis_server import RedisCluster, RedisServer, free_port
from sgl_remote_kv.store.base import KVStore, open_store
from sgl_remote_kv.store.client import ClientConfig, StoreClient
from sgl_remote_kv.store.redis_store import RedisStore

REPO = Path(__file__).resolve().parent.parent
MB = 1024 * 1024


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def bench_backend(store: KVStore, sizes_mb: list[int], total_mb: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for size_mb in sizes_mb:
        n = max(3, total_mb // size_mb)
        blob = rng.integers(0, 256, size_mb * MB, dtype=np.uint8).tobytes()
        keys = [os.urandom(32) for _ in range(n)]
        warm = os.urandom(32)  # one untimed round trip per size (connections, allocator)
        store.put_many([(warm, blob)])
        store.get_many([warm])
        store.delete_many([warm])
        put_s, get_s = [], []
        for k in keys:
            t0 = time.perf_counter()
            store.put_many([(k, blob)])
            put_s.append(time.perf_counter() - t0)
        for k in keys:
            t0 = time.perf_counter()
            (v,) = store.get_many([k])
            get_s.append(time.perf_counter() - t0)
            if v is None or len(v) != len(blob):
                raise RuntimeError(f"{type(store).__name__}: lost a {size_mb} MB blob")
        batch_runs = []
        for _ in range(3):  # median of 3 batched fetches of all n keys in one call
            t0 = time.perf_counter()
            got = store.get_many(keys)
            batch_runs.append(time.perf_counter() - t0)
            if any(v is None for v in got):
                raise RuntimeError("batched get lost blobs")
            del got
        batch_s = statistics.median(batch_runs)
        store.delete_many(keys)
        nbytes = n * len(blob)
        rows.append(
            {
                "size_mb": size_mb,
                "n": n,
                "put_p50_ms": 1e3 * _pct(put_s, 50),
                "put_p95_ms": 1e3 * _pct(put_s, 95),
                "put_mb_s": nbytes / MB / sum(put_s),
                "get_p50_ms": 1e3 * _pct(get_s, 50),
                "get_p95_ms": 1e3 * _pct(get_s, 95),
                "get_mb_s": nbytes / MB / sum(get_s),
                "batched_get_mb_s": nbytes / MB / batch_s,
            }
        )
    return rows


def bench_shaped(sizes_mb: list[int], rates: list[float], reps: int, workdir: Path) -> dict:
    ok, reason = netns_supported()
    if not ok:
        return {"status": "skipped", "reason": f"network namespaces not permitted here: {reason}"}
    rng = np.random.default_rng(1)
    blobs = {s: rng.integers(0, 256, s * MB, dtype=np.uint8).tobytes() for s in sizes_mb}
    rows = []
    with shaped_link(None) as link:
        server = RedisServer(workdir / "redis-netns", 6379, host=link.ns_addr, netns=link.netns)
        server.start()
        try:
            store = RedisStore(link.ns_addr, 6379, timeout_s=60.0)
            keys = {s: os.urandom(32) for s in sizes_mb}
            store.put_many([(keys[s], blobs[s]) for s in sizes_mb])  # upload unshaped
            for rate in [None, *rates]:
                link.set_rate(rate)
                for s in sizes_mb:
                    times = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        (v,) = store.get_many([keys[s]])
                        times.append(time.perf_counter() - t0)
                        assert v is not None and len(v) == len(blobs[s])
                    floor = s * MB * 8 / (rate * 1e6) if rate else None
                    med = statistics.median(times)
                    rows.append(
                        {
                            "rate_mbit": rate,
                            "size_mb": s,
                            "fetch_median_s": med,
                            "fetch_min_s": min(times),
                            "wire_floor_s": floor,
                            "floor_over_measured": floor / med if floor else None,
                            "goodput_mbit": s * MB * 8 / med / 1e6,
                        }
                    )
            store.close()
        finally:
            server.stop()
    return {
        "status": "ok",
        "setup": "redis-server inside a netns, client in the root netns over a veth; tbf on the netns "
        "side egress (server->client); burst ~1 ms of traffic (min 16 KiB), latency 100ms; MTU 1500",
        "note": "wire_floor_s = payload bytes / rate; TCP/IP/Ethernet headers add ~4-5% on the wire",
        "burst_bytes": {str(r): tbf_burst_bytes(r) for r in rates},
        "reps": reps,
        "rows": rows,
    }


def run(args: argparse.Namespace) -> dict:
    sizes = [int(x) for x in args.sizes.split(",")]
    rates = [float(x) for x in args.rates.split(",")] if args.rates else []
    result: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "loadavg_at_start": list(os.getloadavg()),
        },
        "blob_sizes_mb": sizes,
        "notes": "random incompressible blobs; local store in a tmp dir (page cache warm); "
        "servers on loopback; single client thread",
        "backends": {},
    }
    with tempfile.TemporaryDirectory(prefix="srkv-bench-") as tmp:
        work = Path(tmp)
        server = RedisServer(work / "redis", free_port()).start()
        cluster = RedisCluster(work / "cluster")
        try:
            cluster.start()
            stores: dict[str, KVStore] = {
                "local": open_store(str(work / "local")),
                "redis": open_store(server.url + "?timeout=30"),
                "redis-cluster": open_store(cluster.url + "?timeout=30"),
                "client(redis)": StoreClient(
                    open_store(server.url + "?timeout=30"), ClientConfig(timeout_s=30)
                ),
            }
            for name, store in stores.items():
                print(f"[bench_store] {name} ...", flush=True)
                result["backends"][name] = bench_backend(store, sizes, args.total_mb, seed=0)
                store.close()
        finally:
            cluster.stop()
            server.stop()
        print("[bench_store] shaped link ...", flush=True)
        result["shaped"] = bench_shaped(sizes, rates, args.reps, work) if rates else {"status": "not run"}
    result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return result


def print_table(result: dict) -> None:
    print(
        f"\n{'backend':<15}{'MB':>4}{'put p50 ms':>12}{'put MB/s':>10}{'get p50 ms':>12}{'get p95 ms':>12}"
        f"{'get MB/s':>10}{'batch MB/s':>12}"
    )
    for name, rows in result["backends"].items():
        for r in rows:
            print(
                f"{name:<15}{r['size_mb']:>4}{r['put_p50_ms']:>12.2f}{r['put_mb_s']:>10.0f}{r['get_p50_ms']:>12.2f}"
                f"{r['get_p95_ms']:>12.2f}{r['get_mb_s']:>10.0f}{r['batched_get_mb_s']:>12.0f}"
            )
    shaped = result["shaped"]
    if shaped["status"] != "ok":
        print(f"\nshaped link: {shaped['status']} {shaped.get('reason', '')}")
        return
    print(f"\n{'rate Mbit':>10}{'MB':>4}{'fetch s':>10}{'floor s':>10}{'floor/meas':>12}{'goodput Mbit':>14}")
    for r in shaped["rows"]:
        rate = "none" if r["rate_mbit"] is None else f"{r['rate_mbit']:.0f}"
        floor = "-" if r["wire_floor_s"] is None else f"{r['wire_floor_s']:.3f}"
        ratio = "-" if r["floor_over_measured"] is None else f"{r['floor_over_measured']:.2f}"
        print(
            f"{rate:>10}{r['size_mb']:>4}{r['fetch_median_s']:>10.3f}{floor:>10}{ratio:>12}{r['goodput_mbit']:>14.0f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,2,4,8", help="blob sizes in MB")
    p.add_argument("--total-mb", type=int, default=32, help="bytes moved per (backend, size)")
    p.add_argument("--rates", default="50,200,1000", help="shaped rates in Mbit ('' to skip)")
    p.add_argument("--reps", type=int, default=3, help="fetches per (rate, size)")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "store.json"))
    args = p.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
