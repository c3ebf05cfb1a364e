"""Host CPU of the read path into a device pool, host decode against device decode (``make bench-read-path``).

Each fetch path (in-process, DPU) fetches real SmolLM2 KV (bf16, held-out texts, 256-token chunks, the
default codec) from an embedded store into the linker's host staging, stages it under page hashes and
loads it into a device KV pool through ``StagedPages.copy_out`` and the pool's ``DeviceKVWriter``, the
way a server's remote hit does, two ways side by side in one run:

- ``host_decode``: staging holds KV (what every path did before staging held codes): the in-process
  workers decode both stages on the host; the data plane dequantizes (``--remote-kv-dpu-output kv``);
- ``device_decode``: staging holds codes (``RowStore(keep_codes=True)``): the workers and the data plane
  run the lossless stage only; the load uploads the codes and dequantizes on the device.

Both modes are set up and warmed first, then ``--repeat`` rounds each run host then device, and every
figure is the median over rounds (this shared CPU drifts and page-faults fresh allocations now and then;
``host_cpu_s_per_gb_rounds`` keeps each round's; ``device_over_host_best`` is the ratio of each mode's best
round). One row per path, quantizer and entropy stage (``--entropies``: Deflate and zstd; ``default``
marks what ``--remote-kv <path>`` writes by default).

The device is the strict CPU double of a CUDA device (``tests/strict_device.py``): its stream thread does
the device's work (the Triton kernels' torch definitions). **Host CPU** is this process's CPU time less
that thread's and less the CPU the host threads spent inside the double's device calls and metering them
(``DispatchMeter``, its own cost per call calibrated on a no-op:
its ``DeviceOps`` and torch ops on device tensors, Python bookkeeping here, launches and tensor metadata of
microseconds each on a GPU; their count per GB is reported, and the host CPU with them included). A host
thread waiting for a device write blocks (``DeviceOps.wait``: the double's is an event wait, CUDA's a short
poll), so the double's slow device work costs no host CPU a GPU's would not. The data plane's own CPU (a
separate process: the DPU's cores, not the host's) is reported beside it. GB = decoded bf16 KV bytes
delivered into the pool.
``staging_bytes_per_token``: arena bytes the staged chunks took per token (``bf16_bytes_per_token``:
the KV's own size). Writes ``docs/results/read_path.json``. Goals (issue 50): device decode <= 0.35x
the host CPU of host decode; staging <= 0.6x bf16 bytes per token.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from benchmarks import kvdata
from sgl_remote_kv.fetch.paths import default_entropy
from sgl_remote_kv.types import DEFAULT_QUANTIZER

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results" / "read_path.json"
CHUNK, PAGE = 256, 64
TEXTS = ("apache2", "textwrap_py", "vim_tutor_fr")


class DispatchMeter:
    """CPU the calling threads spend *inside* the strict double's device calls (its ``DeviceOps`` and every
    torch op on a ``DeviceTensor``, outermost call per thread), and how many: on a GPU these are driver
    launches and tensor metadata (microseconds each), here Python bookkeeping of the double."""

    OPS = ("upload", "scatter", "dequant", "inverse_transform", "record", "query", "constant", "stream_wait")

    def __init__(self, dev) -> None:
        from tests import strict_device

        self.cpu, self.calls = 0.0, 0
        self._depth = threading.local()
        self._lock = threading.Lock()
        for name in self.OPS:
            setattr(dev, name, self._wrap(getattr(dev, name)))
        cls = strict_device.DeviceTensor
        real = cls.__torch_function__.__func__
        meter = self

        def tf(klass, func, types, args=(), kwargs=None):
            return meter._timed(real, klass, func, types, args, kwargs)

        cls.__torch_function__ = classmethod(tf)
        self.per_call = self._own_cost()

    def _own_cost(self, n: int = 20000, repeat: int = 5) -> float:
        """CPU seconds the meter itself adds per metered call outside the window it times (a no-op, with
        and without the wrapper): the median of ``repeat`` measurements, so one disturbed pair (a busy or
        stolen core) does not set it."""

        def noop():
            return None

        wrapped = self._wrap(noop)
        costs = []
        for _ in range(repeat):
            t0 = time.thread_time()
            for _ in range(n):
                noop()
            t1 = time.thread_time()
            for _ in range(n):
                wrapped()
            t2 = time.thread_time()
            costs.append(max(0.0, ((t2 - t1) - (t1 - t0)) / n))
        self.cpu, self.calls = 0.0, 0
        return float(np.median(costs))

    def _wrap(self, fn):
        return lambda *a, **k: self._timed(fn, *a, **k)

    def _timed(self, fn, *a, **k):
        d = getattr(self._depth, "n", 0)
        if d:
            return fn(*a, **k)
        self._depth.n = 1
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt = time.thread_time() - t0
            self._depth.n = 0
            if threading.current_thread().name != "strict-device-stream":
                with self._lock:
                    self.cpu += dt
                    self.calls += 1


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_cpu(t: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def smollm2_chunks() -> list:
    """256-token chunks of the held-out texts' real KV, at their positions."""
    out = []
    for t in (t for t in kvdata.load_texts(list(TEXTS)) if t.name in TEXTS):
        for s in range(0, t.k.shape[1] - CHUNK + 1, CHUNK):
            out.append(
                (np.ascontiguousarray(t.k[:, s : s + CHUNK]), np.ascontiguousarray(t.v[:, s : s + CHUNK]), s)
            )
    return out


def llama8b_shape(n_chunks: int = 16):
    """(fingerprint, chunks, quantizer -> codec) of a Llama-3-8B-shaped layout: synthetic normal KV and a
    synthetic calibration with per-head groups (the cheaper host inverse: the conservative ratio)."""
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec
    from tests.calibration_helpers import make_calibration

    fp = synthetic.fingerprint(num_layers=32, heads=8, dim=128)
    cal = make_calibration(fp, groups=8)
    chunks = [(*synthetic.kv(fp.layout, CHUNK, seed=i), i * CHUNK) for i in range(n_chunks)]

    def codec_of(quantizer: str, entropy: str = "deflate"):
        return get_codec(
            "transform",
            calibration=cal.calib_id.hex(),
            quality="0.0005",
            quantizer=quantizer,
            entropy=entropy,
        )

    return fp, chunks, codec_of


def transform_codec(fp, quantizer: str, entropy: str = "deflate"):
    """The transform codec at the default level with ``quantizer`` (the default: trellis) and ``entropy``."""
    from sgl_remote_kv.codec import calibration
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.types import DEFAULT_QUALITY

    cal = calibration.find_for(fp, DEFAULT_QUALITY)
    if cal is None:
        raise SystemExit("no calibration for the model: run `make calibration` first")
    return get_codec(
        "transform",
        calibration=cal.calib_id.hex(),
        quality=DEFAULT_QUALITY,
        quantizer=quantizer,
        entropy=entropy,
    )


class Rig:
    """A store with the chunks (``(k, v, start)``), a strict device pool and its writer."""

    def __init__(self, tmp: Path, codec, fp, chunks) -> None:
        from sgl_remote_kv.kvpool import PoolTensors, writer_for
        from sgl_remote_kv.store.client import open_client
        from tests.strict_device import StrictDevice, StrictKVPool

        self.fp, self.codec, self.url = fp, codec, f"file://{tmp / 'store'}"
        client = open_client(self.url)
        self.keys: list[bytes] = []
        for i, (k, v, start) in enumerate(chunks):
            key = i.to_bytes(4, "little").ljust(32, b"\0")
            client.put_many([(key, codec.encode(k, v, fp, start=start))])
            self.keys.append(key)
        client.close()
        self.tokens = len(self.keys) * CHUNK
        self.dev = StrictDevice(delay_s=0.0)
        self.meter = DispatchMeter(self.dev)
        lay = fp.layout
        self.pool = StrictKVPool(self.dev, lay, self.tokens, torch.bfloat16)
        self.writer = writer_for(PoolTensors(self.pool.k_buffer, self.pool.v_buffer), lay, 30.0, ops=self.dev)

    def staging(self, keep_codes: bool):
        from sgl_remote_kv.kvpool.staged import StagedPages, staging_plan

        lay = self.fp.layout
        plan = staging_plan(lay, keep_codes, self.codec, [])
        s = StagedPages(
            lay, self.tokens, PAGE, keep_codes=plan.keep_codes, nbytes=self.tokens * plan.bytes_per_token
        )
        self.writer.register_host(s.writer.arena.array)
        return s

    def load(self, staged, rows) -> float:
        """Stage ``rows`` and load them into the pool; returns the arena bytes they took per token."""
        per_token = staged.writer.arena.used / len(rows)
        hashes = [f"{i:064x}" for i in range(len(rows) // PAGE)]
        entry = staged.stage(hashes, rows)
        pin = staged.pin(hashes)
        slots = torch.randperm(self.tokens, generator=torch.Generator().manual_seed(1))
        staged.copy_out([(pin, slots)], self.writer, lambda layer: None)
        self.dev.synchronize()
        staged.release(pin)
        staged.release(entry)
        return per_token

    def close(self) -> None:
        self.dev.close()


class Setup:
    """One mode (host or device decode) of one fetch path, ready to run: ``once()`` fetches every chunk into
    staging and loads it into the pool (returns the arena bytes per token); ``extra_cpu()``: CPU seconds of
    the path's own process so far (the data plane), else 0."""

    def __init__(self, once, staged, close, extra_cpu=lambda: 0.0) -> None:
        self.once, self.staged, self.close, self.extra_cpu = once, staged, close, extra_cpu


def setup_inproc(rig: Rig, device_decode: bool) -> Setup:
    from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
    from sgl_remote_kv.store.client import open_client

    client = open_client(rig.url)
    staged = rig.staging(device_decode)
    be = InProcessFetchBackend(client, rig.codec, rig.fp, CHUNK, keep_codes=staged.writer.device_dequant)

    def once() -> float:
        h = be.submit("r", rig.keys, start_token=0)
        if not h.wait(600) or h.failure:
            raise RuntimeError(f"in-process fetch failed: {h.failure}")
        rows = staged.alloc(rig.tokens)
        h.write_staged(staged.writer, rows, rig.tokens)
        return rig.load(staged, rows)

    def close() -> None:
        be.close()
        client.close()

    return Setup(once, staged, close)


def setup_dpu(rig: Rig, device_decode: bool) -> Setup:
    from sgl_remote_kv.contract.settings import DataPlaneSettings
    from sgl_remote_kv.contract.sizing import chunk_bytes
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget

    lay = rig.fp.layout
    cb = chunk_bytes(lay, CHUNK)
    per_slot = max(2, min(8, (64 << 20) // cb))  # chunks per round slot: at most ~64 MiB of KV
    spec = DataPlaneSettings(workers=(1, 1, 1, 1), slots=2, slot_bytes=per_slot * cb, cpus=())
    cfg = DpuClientConfig(rig.url, dest_slots=2, dest_slot_bytes=per_slot * cb, process=spec)
    c = DpuClient(cfg, rig.fp, rig.codec)
    c.start()
    staged = rig.staging(device_decode)
    proc = psutil.Process(c.pid) if c.pid else None

    def once() -> float:
        rows = staged.alloc(rig.tokens)
        res = c.fetch("r", rig.keys, CHUNK, KVTarget(staged.writer, rows), timeout=600)
        if res.hit_chunks != len(rig.keys):
            raise RuntimeError(f"DPU fetch: {res.hit_chunks} of {len(rig.keys)} chunks, {res.failures}")
        return rig.load(staged, rows)

    return Setup(once, staged, c.close, (lambda: _proc_cpu(proc)) if proc is not None else (lambda: 0.0))


def _proc_cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure_pair(rig: Rig, setup, repeat: int) -> dict:
    """Host decode and device decode of one path, side by side: both set up and warmed (kernels, buffers),
    then ``repeat`` rounds, each running host then device; per mode the median over rounds of each
    measure (this shared CPU drifts between runs; alternating keeps both modes under the same drift)."""
    setups = {m: setup(rig, m == "device") for m in ("host", "device")}
    try:
        for s in setups.values():
            s.once()  # first use: kernels and buffers
        samples: dict[str, list[dict]] = {m: [] for m in setups}
        for _ in range(repeat):
            for m, s in setups.items():
                samples[m].append(_sample(rig, s))
        return {m: _summary(rig, setups[m], samples[m]) for m in setups}
    finally:
        for s in setups.values():
            s.close()


def _sample(rig: Rig, s: Setup) -> dict:
    stream = rig.dev._worker
    c0, t0, w0, x0 = _cpu(), _thread_cpu(stream), time.perf_counter(), s.extra_cpu()
    m0, n0 = rig.meter.cpu, rig.meter.calls
    per_token = s.once()
    host = (_cpu() - c0) - (_thread_cpu(stream) - t0)
    calls = rig.meter.calls - n0
    dispatch = rig.meter.cpu - m0 + calls * rig.meter.per_call
    return {
        "host": host,
        "dispatch": dispatch,
        "calls": calls,
        "wall": time.perf_counter() - w0,
        "extra": s.extra_cpu() - x0,
        "per_token": per_token,
    }


def _summary(rig: Rig, s: Setup, samples: list[dict]) -> dict:
    gb = rig.tokens * rig.fp.layout.bytes_per_token() / 1e9  # per round
    med = lambda f: float(np.median([f(x) for x in samples]))  # noqa: E731
    out = {
        "gb_per_round": gb,
        "rounds": len(samples),
        "host_cpu_s_per_gb": med(lambda x: (x["host"] - x["dispatch"]) / gb),
        "host_cpu_s_per_gb_rounds": [(x["host"] - x["dispatch"]) / gb for x in samples],
        "host_cpu_s_per_gb_with_double_dispatch": med(lambda x: x["host"] / gb),
        "device_calls_per_gb": med(lambda x: x["calls"] / gb),
        "meter_s_per_call": rig.meter.per_call,
        "wall_s_per_round": med(lambda x: x["wall"]),
        "staging_bytes_per_token": med(lambda x: x["per_token"]),
        "host_dequant_tokens": s.staged.writer.stats["host_dequant"] + rig.writer.host_dequant_tokens,
    }
    if any(x["extra"] for x in samples):
        out["dataplane_cpu_s_per_gb"] = med(lambda x: x["extra"] / gb)
    return out


def _row(path: str, quantizer: str, codec, rig: Rig, r: dict) -> dict:
    fp = rig.fp
    row = {
        "path": path,
        "codec": codec.name,
        "quantizer": quantizer,
        "entropy": codec.entropy,
        # what --remote-kv <path> writes by default
        "default": quantizer == DEFAULT_QUANTIZER and codec.entropy == default_entropy(path, quantizer),
        "params": codec.params(),
        "tokens": rig.tokens,
        "host_cpu_s_per_gb_host_decode": r["host"]["host_cpu_s_per_gb"],
        "host_cpu_s_per_gb_device_decode": r["device"]["host_cpu_s_per_gb"],
        "device_over_host": r["device"]["host_cpu_s_per_gb"] / r["host"]["host_cpu_s_per_gb"],
        # the best round of each mode: the rounds a fresh allocation's page faults (or the VM) did not slow
        "device_over_host_best": min(r["device"]["host_cpu_s_per_gb_rounds"])
        / min(r["host"]["host_cpu_s_per_gb_rounds"]),
        "staging_bytes_per_token": r["device"]["staging_bytes_per_token"],
        "staging_bytes_per_token_host_decode": r["host"]["staging_bytes_per_token"],
        "bf16_bytes_per_token": fp.layout.bytes_per_token(),
        "host_dequant_tokens_device_decode": r["device"]["host_dequant_tokens"],
        "device_calls_per_gb_device_decode": r["device"]["device_calls_per_gb"],
        "runs": r,
    }
    row["staging_over_bf16"] = row["staging_bytes_per_token"] / row["bf16_bytes_per_token"]
    print(
        f"{path:7s} {quantizer:8s} {codec.entropy:7s} host CPU s/GB: host decode {row['host_cpu_s_per_gb_host_decode']:.2f}, "
        f"device decode {row['host_cpu_s_per_gb_device_decode']:.2f} ({row['device_over_host']:.2f}x, "
        f"best rounds {row['device_over_host_best']:.2f}x); "
        f"staging {row['staging_bytes_per_token']:.0f} B/token ({row['staging_over_bf16']:.2f}x bf16)"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="rounds (host then device each), medians reported")
    ap.add_argument("--paths", default="inproc,dpu")
    ap.add_argument(
        "--shape",
        choices=("smollm2", "llama8b"),
        default="smollm2",
        help="smollm2: real KV of the model; llama8b: synthetic KV of a Llama-3-8B-shaped layout (32 layers, "
        "8 KV heads, head dim 128) and a synthetic per-head calibration",
    )
    ap.add_argument("--quantizers", default=f"{DEFAULT_QUANTIZER},scalar", help="the transform codec's")
    ap.add_argument(
        "--entropies",
        default="deflate,zstd",
        help="the transform codec's entropy stages (deflate: the default)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    import tempfile

    torch.set_num_threads(1)
    fp = kvdata.fingerprint()
    if args.shape == "llama8b":
        fp, chunks, codec_of = llama8b_shape()
    else:
        chunks = smollm2_chunks()
        codec_of = functools.partial(transform_codec, fp)
    setups = {"inproc": setup_inproc, "dpu": setup_dpu}
    rows = []
    for quantizer, entropy in itertools.product(args.quantizers.split(","), args.entropies.split(",")):
        codec = codec_of(quantizer, entropy)
        with tempfile.TemporaryDirectory() as tmp:
            rig = Rig(Path(tmp), codec, fp, chunks)
            try:
                for path in args.paths.split(","):
                    r = measure_pair(rig, setups[path], args.repeat)
                    rows.append(_row(path, quantizer, codec, rig, r))
            finally:
                rig.close()
    meta = {
        "shape": args.shape,
        "texts": list(TEXTS) if args.shape == "smollm2" else None,
        "model": "SmolLM2-135M (30 layers, 3 KV heads, head dim 64), bf16 KV"
        if args.shape == "smollm2"
        else "Llama-3-8B-shaped (32 layers, 8 KV heads, head dim 128), synthetic bf16 KV, synthetic calibration",
        "chunk": CHUNK,
        "repeat": args.repeat,
        "cpu": kvdata.cpu_model(),
        "device": "strict CPU double of a CUDA device (tests/strict_device.py); its stream thread's CPU excluded",
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
