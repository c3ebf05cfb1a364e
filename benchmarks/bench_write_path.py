"""What the write-back costs: host CPU of host encode against device encode, and a serving CPU server's TPOT
(``make bench-write-path``).

**Encode** (``rows``): 256-token chunks of KV sit in a device KV pool (the strict CPU double of a CUDA
device, ``tests/strict_device.py``) at scattered slots, and are written back two ways side by side, as
``WriteBack`` does it:

- ``host_encode``: ``KVWriter.read_later`` (bf16 KV out of the pool) and ``codec.encode`` on the host;
- ``device_encode``: ``KVWriter.read_quantized_later`` (quantized on the device's side stream, codes and
  scales out) and ``codec.encode_quantized`` (the lossless stage alone on the host). Its blobs are checked
  byte-identical to the host encode's.

**Host CPU** is the calling thread's CPU time less what it spent inside the double's device calls
(``bench_read_path.DispatchMeter``: on a GPU, launches of microseconds each); the double's stream thread
(the device's own work) is not counted. GB = bf16 KV bytes written back. Codecs: ``quant_deflate`` and the default ``transform`` codec
(trellis quantizer; its device encode runs RoPE undo, the transform, the scales and the trellis search on the
device: ``kernels/transform_encode.py``; its blobs decode within float32 rounding of the host's,
``decoded_apart_over_error``, and ``device_ops_per_layer_gpu`` counts the torch calls one layer of one chunk takes as ``CudaOps`` runs it
(the trellis search one Triton launch), each a kernel launch on a GPU, whose host CPU the double does not show). Shapes: SmolLM2-135M's real KV (held-out texts) and a Llama-3-8B-shaped layout
(synthetic KV). Goal (issue 51): device encode <= 0.3x the host CPU of host encode.

**TPOT** (``tpot``, ``--skip-tpot`` leaves it out): the new-user experiment on the CPU twin, real servers one
after another (SmolLM2-135M float32, the build the calibration belongs to): ``--remote-kv dpu`` with the
default codec (``default``: the host encode in encoder processes), the same with
``--remote-kv-writeback-encoder thread`` (``thread``: the encode in the scheduler process's threads), and
``--remote-kv off``; the same cold prompts (``--prompts``, 1,998 token ids each, 32 new tokens, greedy), one
at a time. TPOT = (total - TTFT) / (new tokens - 1); ``tpot_<server>_s`` are the means over every prompt of
every round. ``--rounds`` runs each server that many times, the servers' order reversed every other round;
``round_ratios`` has each round's TPOT over that round's ``off``, ``ratio`` (``ratio_thread``) the means' ratio
and ``ratio_median_of_rounds`` the rounds' median. Before each prompt the previous one's write-back is done
(the written-chunk counter has counted its full chunks, then stood still for 3 s); ``scheduler_cpu_s`` is the
CPU time (user + system) the scheduler process spent from the request until then, ``encoder_cpu_s`` its
encoder processes'. Goal: ``tpot_default_s <= 1.3 x tpot_off_s``. ``--writeback-cpu`` (repeatable) runs the
tier's servers at other ``--remote-kv-writeback-cpu`` shares. Writes
``docs/results/write_path.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import kvdata
from benchmarks.bench_read_path import CHUNK, DispatchMeter, smollm2_chunks

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results" / "write_path.json"
TD = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _pool(dev, fp, chunks):
    """A strict device pool holding the chunks' KV at scattered slots; (writer, slots)."""
    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from tests.strict_device import StrictKVPool

    lay = fp.layout
    t = CHUNK * len(chunks)
    pool = StrictKVPool(dev, lay, t + 64, TD[lay.dtype])
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, 60.0, ops=dev)
    slots = torch.randperm(t + 64, generator=torch.Generator().manual_seed(0))[:t]
    k = np.concatenate([c[0] for c in chunks], axis=1)
    v = np.concatenate([c[1] for c in chunks], axis=1)
    w.write(k, v, slots)
    dev.synchronize()
    return w, slots


def _measure(meter, fn) -> tuple[float, object]:
    c0, d0 = time.thread_time(), meter.cpu
    out = fn()
    return (time.thread_time() - c0) - (meter.cpu - d0), out


def encode_rows(shape: str, repeat: int) -> list[dict]:
    from sgl_remote_kv.codec.base import get_codec
    from tests.strict_device import StrictDevice

    if shape == "llama8b":
        from benchmarks import synthetic_kv as synthetic

        fp = synthetic.fingerprint(num_layers=32, heads=8, dim=128)
        chunks = [(*synthetic.kv(fp.layout, CHUNK, seed=i), i * CHUNK) for i in range(8)]
        transform = None  # no calibration of that shape: the transform row is SmolLM2's
    else:
        fp = kvdata.fingerprint()
        chunks = smollm2_chunks()
        from benchmarks.bench_read_path import transform_codec
        from sgl_remote_kv.types import DEFAULT_QUANTIZER

        transform = transform_codec(fp, DEFAULT_QUANTIZER)
    gb = sum(c[0].nbytes + c[1].nbytes for c in chunks) / 1e9
    dev = StrictDevice()
    meter = DispatchMeter(dev)
    rows = []
    try:
        w, slots = _pool(dev, fp, chunks)
        codecs = [("quant_deflate", get_codec("quant_deflate"))] + (
            [("transform", transform)] if transform else []
        )
        for name, codec in codecs:

            def host(codec=codec):
                k, v = w.read_later(slots).result()
                return [
                    codec.encode(
                        np.ascontiguousarray(k[:, i * CHUNK : (i + 1) * CHUNK]),
                        np.ascontiguousarray(v[:, i * CHUNK : (i + 1) * CHUNK]),
                        fp,
                        start=chunks[i][2],
                    )
                    for i in range(len(chunks))
                ]

            def device(codec=codec):
                spec, out = codec.device_encode_spec(fp), []
                for lo, hi in _runs(chunks):  # one read per run of consecutive positions, as a write-back job
                    q = w.read_quantized_later(
                        slots[lo * CHUNK : hi * CHUNK], spec, CHUNK, chunks[lo][2]
                    ).result()
                    out += [codec.encode_quantized(q, i, fp) for i in range(hi - lo)]
                return out

            host_s, blobs = min((_measure(meter, host) for _ in range(repeat)), key=lambda r: r[0])
            row = {
                "shape": shape,
                "codec": name,
                "chunks": len(chunks),
                "kv_gb": round(gb, 4),
                "host_cpu_s_per_gb_host_encode": round(host_s / gb, 3),
                "compressed_ratio": round(gb * 1e9 / sum(len(b) for b in blobs), 2),
            }
            if getattr(codec, "device_encode", False):
                dev_s, dblobs = min((_measure(meter, device) for _ in range(repeat)), key=lambda r: r[0])
                row["host_cpu_s_per_gb_device_encode"] = round(dev_s / gb, 3)
                row["ratio"] = round(dev_s / host_s, 3)
                row["blobs_identical"] = dblobs == blobs
                if name == "transform":  # float32 rounding apart (kernels/transform_encode.py): how close
                    row["decoded_apart_over_error"] = _apart_over_error(dblobs, blobs, chunks, fp)
                    row["device_ops_per_layer_gpu"] = _ops_per_layer(codec, fp)
            else:
                row["host_cpu_s_per_gb_device_encode"] = None
                row["device_encode"] = "not offered: no device quantizer for this codec (host encode)"
            rows.append(row)
            print(json.dumps(row))
    finally:
        dev.close()
    return rows


SERVERS = {  # the TPOT servers' flags: the tier's default, its encode in the scheduler's threads, no tier
    "default": ["--remote-kv", "dpu"],
    "thread": ["--remote-kv", "dpu", "--remote-kv-writeback-encoder", "thread"],
    "off": ["--remote-kv", "off"],
}


def _scheduler(srv):
    """The server's scheduler process (SGLang titles it ``sglang::scheduler``) and its encoder processes."""
    import psutil

    procs = psutil.Process(srv.proc.pid).children(recursive=True)
    sched = next(p for p in procs if "sglang::scheduler" in " ".join(p.cmdline()))
    return sched, [p for p in sched.children() if "writeback.encoder_process" in " ".join(p.cmdline())]


def _cpu_s(procs) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _serve(label: str, ids, new_tokens: int, writeback_cpu: str | None, model: str) -> list[dict]:
    """One server of ``label``: each prompt's TTFT, TPOT, and the CPU-seconds its scheduler process (and, for
    the tier, its encoder processes) spent from the request until its write-back was done."""
    from benchmarks.e2e_server import chunks_done, stream_generate, wait_written
    from benchmarks.launcher import ServerSpec, SGLangServer

    tier = label != "off"
    with tempfile.TemporaryDirectory() as tmp:
        extra = list(SERVERS[label])
        if tier:
            extra += ["--remote-kv-store", f"file://{tmp}/store", "--enable-metrics"]
            extra += ["--remote-kv-writeback-cpu", writeback_cpu] if writeback_cpu else []
        spec = ServerSpec(model_path=model, extra_args=tuple(extra), max_total_tokens=16384)
        with SGLangServer(spec) as srv:
            sched, encoders = _scheduler(srv)
            runs = []
            for p in ids:
                before = chunks_done(srv.base_url) if tier else 0
                cpu0, enc0 = _cpu_s([sched]), _cpu_s(encoders)
                r = stream_generate(srv.base_url, p, new_tokens)
                if tier:  # the next prompt starts with this one's write-back done
                    wait_written(srv.base_url, before + len(p) // CHUNK, idle_timeout_s=60)
                n = len(r["output_ids"])
                runs.append(
                    {
                        "ttft_s": round(r["ttft_s"], 3),
                        "tpot_s": round((r["total_s"] - r["ttft_s"]) / max(1, n - 1), 4),
                        "scheduler_cpu_s": round(_cpu_s([sched]) - cpu0, 2),
                        "encoder_cpu_s": round(_cpu_s(encoders) - enc0, 2),
                    }
                )
            return runs


def tpot(
    prompts: int,
    new_tokens: int,
    writeback_cpu: str | None = None,
    rounds: int = 1,
    labels: tuple[str, ...] = ("default", "off"),
) -> dict:
    """See module docstring: the servers of ``labels`` (``SERVERS``), same cold prompts, ``rounds`` times,
    the order of the servers reversed every other round (this box's drift falls on each alike)."""
    from sgl_remote_kv.model import ensure_model

    model = str(ensure_model("float32"))
    rng = random.Random(7)
    ids = [[rng.randrange(200, 49000) for _ in range(1998)] for _ in range(prompts)]
    out: dict = {"prompt_tokens": 1998, "new_tokens": new_tokens, "prompts": prompts, "rounds": rounds}
    out["writeback_cpu"] = writeback_cpu or "default"
    out["servers"] = {label: [] for label in labels}
    out["round_ratios"] = []
    for r in range(rounds):
        mean = {}
        for label in labels if r % 2 == 0 else labels[::-1]:
            runs = _serve(label, ids, new_tokens, writeback_cpu, model)
            out["servers"][label] += [{"round": r, **x} for x in runs]
            mean[label] = float(np.mean([x["tpot_s"] for x in runs]))
            print(label, r, runs, flush=True)
        out["round_ratios"].append({k: round(mean[k] / mean["off"], 3) for k in labels if k != "off"})
    for label in labels:
        runs = out["servers"][label]
        out[f"tpot_{label}_s"] = round(float(np.mean([x["tpot_s"] for x in runs])), 4)
        out[f"scheduler_cpu_s_per_prompt_{label}"] = round(
            float(np.mean([x["scheduler_cpu_s"] for x in runs])), 2
        )
        out[f"encoder_cpu_s_per_prompt_{label}"] = round(
            float(np.mean([x["encoder_cpu_s"] for x in runs])), 2
        )
    for label in labels:
        if label != "off":
            key = "ratio" if label == "default" else f"ratio_{label}"
            out[key] = round(out[f"tpot_{label}_s"] / out["tpot_off_s"], 3)
            out[f"{key}_median_of_rounds"] = round(
                float(np.median([x[label] for x in out["round_ratios"]])), 3
            )
    return out


def _runs(chunks) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of chunks at consecutive positions."""
    runs, lo = [], 0
    for i in range(1, len(chunks) + 1):
        if i == len(chunks) or chunks[i][2] != chunks[i - 1][2] + CHUNK:
            runs.append((lo, i))
            lo = i
    return runs


def _apart_over_error(dblobs, blobs, chunks, fp) -> float:
    """RMS of (device-encoded decode - host-encoded decode) over the RMS of (host-encoded decode - KV)."""
    from sgl_remote_kv.codec.base import decode
    from sgl_remote_kv.codec.quant import to_f32

    apart = err = 0.0
    for (k, v, _), a, b in zip(chunks, dblobs, blobs, strict=True):
        for x, y, z in zip((k, v), decode(a, fp), decode(b, fp), strict=True):
            x, y, z = (to_f32(t, fp.layout.dtype) for t in (x, y, z))
            apart += float(np.sum((y - z) ** 2))
            err += float(np.sum((z - x) ** 2))
    return round((apart / err) ** 0.5, 6)


def _ops_per_layer(codec, fp) -> int:
    """Torch calls (each a kernel launch on a GPU, host CPU the strict double does not show) of one layer's
    device encode of one chunk as ``CudaOps`` runs it: the trellis search counted as its one Triton launch."""
    from sgl_remote_kv.kernels.transform_encode import encode_layer_device
    from torch.overrides import TorchFunctionMode

    from sgl_remote_kv.codec.transform_ops import rope_style, rope_tables

    spec = codec.device_encode_spec(fp)
    consts = codec.encode_consts(0, spec.group, spec.groups).to(torch.from_numpy)
    k, v = (torch.zeros(CHUNK, fp.layout.num_kv_heads, fp.layout.head_dim) for _ in range(2))
    cos, sin = (torch.from_numpy(np.array(a)) for a in rope_tables(codec.cal.rope, 0, CHUNK))
    count = [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            count[0] += 1
            return func(*args, **(kwargs or {}))

    def one_launch(u, live, bits, esc_bits):  # stands for trellis_search_triton: one launch
        count[0] += 1
        return torch.zeros(u.shape, dtype=torch.int64)

    with Count():
        encode_layer_device(
            k,
            v,
            consts,
            cos,
            sin,
            rope_style(codec.cal.rope),
            0,
            0,
            CHUNK,
            codec.quantizer == "trellis",
            64,
            search=one_launch,
        )
    return count[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--skip-tpot", action="store_true")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="TPOT: each server this many times, alternating")
    ap.add_argument(
        "--servers",
        default="default,thread,off",
        help="TPOT: which servers (" + ", ".join(SERVERS) + "); 'off' is the ratios' reference",
    )
    ap.add_argument(
        "--writeback-cpu",
        action="append",
        help="--remote-kv-writeback-cpu of the tier's server (repeat: one TPOT run each; default: the flag's default)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for shape in args.shapes.split(",") for r in encode_rows(shape, args.repeat)]
    result = {
        "meta": {
            "chunk": CHUNK,
            "repeat": args.repeat,
            "cpu": kvdata.cpu_model(),
            "device": "strict CPU double of a CUDA device (tests/strict_device.py); its stream thread's CPU "
            "and the host threads' CPU inside its device calls excluded",
            "date": time.strftime("%Y-%m-%d"),
        },
        "rows": rows,
    }
    if not args.skip_tpot:
        labels = tuple(args.servers.split(","))
        runs = [
            tpot(args.prompts, args.new_tokens, share, args.rounds, labels)
            for share in (args.writeback_cpu or [None])
        ]
        result["tpot"] = runs[0]
        if len(runs) > 1:
            result["tpot_by_writeback_cpu"] = runs
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
