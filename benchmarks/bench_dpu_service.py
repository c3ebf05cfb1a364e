"""One data-plane service feeding two clients vs two private data planes, on the same cores (issue 17).

Two ``DpuClient`` s stand in for two servers (or two TP ranks) of one host. Either both attach to one
``python -m sgl_remote_kv.dpu`` service (``--endpoint``), or each spawns its private data plane (today's
default); every data-plane process is pinned to the same core set (``--cpus``), so the comparison is the
same CPU budget split two ways. Both clients submit all their requests (1,792 tokens each, real SmolLM2 KV
in the embedded file store, the default codec) at the same moment; reported per mode (best of ``--reps``,
modes interleaved A B A B so both see the same background load): wall time until both finished, aggregate
decoded GB/s, data-plane CPU seconds (all its processes) and GB/s per data-plane core, and each client's
own finish time. Writes ``docs/results/dpu_service.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import kvdata
from benchmarks.bench_dpu import FP, GB, LAYOUT, _cpu_s, load_chunks, put
from sgl_remote_kv.codec.base import default_codec
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

OUT = kvdata.REPO / "docs" / "results" / "dpu_service.json"
REQ_TOKENS = 1792


def _client(url: str, codec, chunk: int, cpus: tuple[int, ...], endpoint: str = "") -> DpuClient:
    cb = chunk_bytes(LAYOUT, chunk)
    spec = DataPlaneSettings.from_flags(
        [], cpus=cpus, layer_group=5, slots=2, slot_bytes=max(cb, 8 << 20) * 2
    )
    cfg = DpuClientConfig(
        url,
        dest_slots=4,
        dest_slot_bytes=max(cb, 16 << 20),
        process=spec,
        endpoint=endpoint,
        heartbeat_s=0.25,
        start_timeout_s=60,
    )
    c = DpuClient(cfg, FP, codec)
    c.start()
    c.fetch("warm", [b"warm".ljust(32, b"\0")], chunk, None, timeout=120)  # a miss: spins up threads
    return c


def _run(clients: list[DpuClient], keys: list[bytes], chunk: int, pids: list[int]) -> dict:
    """Both clients submit every request at once; wall until both are done, each one's finish time."""
    per_req = max(1, REQ_TOKENS // chunk)
    done_at: list[float] = [0.0] * len(clients)
    cpu0 = sum(_cpu_s(p) for p in pids)
    start = threading.Barrier(len(clients) + 1)

    def one(i: int, c: DpuClient) -> None:
        start.wait()
        hs = [c.submit(f"c{i}r{j}", keys[j : j + per_req], chunk, None) for j in range(0, len(keys), per_req)]
        res = [h.wait(600) for h in hs]
        assert sum(r.hit_chunks for r in res) == len(keys), [r.failures for r in res if r.failures]
        done_at[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return {
        "wall_s": max(done_at) - t0,
        "client_s": [d - t0 for d in done_at],
        "cpu_s": sum(_cpu_s(p) for p in pids) - cpu0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", default="1", help="cores of every data-plane process (e.g. 1 or 0-1)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    lo, _, hi = a.cpus.partition("-")
    cpus = tuple(range(int(lo), int(hi or lo) + 1))
    codec = default_codec()
    texts = kvdata.load_texts()[: a.texts]
    with tempfile.TemporaryDirectory(prefix="srkv-dpusvc-") as tmp:
        url = f"file://{tmp}/store"
        keys, blobs = put(url, codec, load_chunks(a.chunk, texts), "svc")
        decoded = 2 * chunk_bytes(LAYOUT, a.chunk) * len(keys)  # both clients fetch every chunk
        ep = f"ipc://{tmp}/dpu.sock"
        cmd = [
            sys.executable,
            "-m",
            "sgl_remote_kv.dpu",
            "--endpoint",
            ep,
            "--store",
            url,
            "--cpus",
            a.cpus,
            "--layer-group",
            "5",
            "--slots",
            "4",
            "--slot-bytes",
            str(max(chunk_bytes(LAYOUT, a.chunk), 8 << 20) * 2),
        ]
        svc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/service.log", "wb"))
        try:
            shared = [_client(url, codec, a.chunk, cpus, ep) for _ in range(2)]
            private = [_client(url, codec, a.chunk, cpus) for _ in range(2)]
            modes = {
                "one service, two clients": (shared, [svc.pid]),
                "two private data planes": (private, [c.pid for c in private]),
            }
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for rep in range(a.reps + 1):
                for m, (clients, pids) in modes.items():
                    r = _run(clients, keys, a.chunk, pids)
                    if rep:  # the first run of each mode warms it up
                        runs[m].append(r)
            for c in shared + private:
                c.close()
        finally:
            svc.kill()
            svc.wait()
    rows = []
    print(f"{'mode':28s} {'wall s':>7s} {'GB/s':>6s} {'DP CPU s':>8s} {'GB/s/core':>9s}  clients' finish (s)")
    for m, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        row = {
            "mode": m,
            **best,
            "gbps": decoded / best["wall_s"] / GB,
            "gbps_per_core": decoded / best["cpu_s"] / GB if best["cpu_s"] > 0 else None,
            "all_walls_s": [r["wall_s"] for r in rs],
        }
        rows.append(row)
        print(
            f"{m:28s} {row['wall_s']:7.2f} {row['gbps']:6.2f} {row['cpu_s']:8.2f} {row['gbps_per_core'] or 0:9.2f}  "
            f"{', '.join(f'{x:.2f}' for x in row['client_s'])}"
        )
    meta = {
        "codec": codec.name,
        "chunk_tokens": a.chunk,
        "chunks_per_client": len(keys),
        "cpus": a.cpus,
        "staging": "service: 4 slots; private: 2 slots each (same total)",
        "decoded_bytes_total": decoded,
        "reps": a.reps,
        "cpu": kvdata.cpu_model(),
    }
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
