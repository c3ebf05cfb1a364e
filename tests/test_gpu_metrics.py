"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): measurements recorded in the GPU report's
``metrics`` section (``gpu_metrics`` fixture, ``tests/gpu_report.py``). Nothing here asserts a speed:
the tests check only that each number measured the path it names (``tests/gpu_measure.py``).

- ``writer_h2d_gbps_zero_copy`` / ``writer_h2d_gbps_staged``: a whole ``KVWriter.write`` of 128 MiB of
  K+V (8 layers x 4,096 tokens x 8 KV heads x 128, bf16) into SGLang's ``MHATokenToKVPool``: from a host
  region pinned in place vs from pageable memory (staged through the writer's pinned buffer);
- ``dequant_triton_gbps`` / ``inverse_transform_triton_gbps``: decoded KV bytes per second written by
  the Triton dequant (quant codecs) and inverse-transform (transform codec) kernels; the goal is
  ``decode_goal_gbps`` (50 GB/s), recorded next to them, not asserted;
- ``writeback_device_quantize_gbps`` / ``writeback_host_lossless_s_per_gb``: the write-back's device encode
  (``KVWriter.read_quantized_later``: bf16 KV quantized on the side stream, codes back in pinned memory) per
  second, and the host CPU per GB of KV it leaves (the lossless stage); its blobs must equal the host encode's;
- ``triton_compile``: the first launch (compile + run) of each kernel variant vs a warm launch, and the
  tier's start-up ``warm_up`` cold vs warm, in a fresh process with an empty Triton cache.

The same functions run on a CPU (a host pool; the kernels under ``TRITON_INTERPRET=1``) in
``tests/test_gpu_suite_on_cpu.py``. Skipped with the reason without a CUDA device, or naming a module not
carried (``tests/gpu_gate.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.types import KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_needs("triton")]

DECODE_GOAL_GBPS = 50.0


@pytest.mark.gpu_needs("sglang.srt.mem_cache.memory_pool")
def test_writer_h2d_bandwidth_zero_copy_and_staged(gpu_metrics):
    from gpu_measure import writer_h2d_gbps
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    lay = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    pool = MHATokenToKVPool(8192, 1, torch.bfloat16, 8, 128, 8, "cuda", False)
    for pinned, name in ((True, "zero_copy"), (False, "staged")):
        w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, timeout_s=10.0)
        r = writer_h2d_gbps(w, tokens=4096, pinned=pinned)
        assert r["writer_stats"][name] == r["writer_stats"]["writes"] > 0, r  # every write took that path
        gpu_metrics[f"writer_h2d_gbps_{name}"] = round(r["gbps"], 3)
        gpu_metrics[f"writer_h2d_bytes_{name}"] = r["bytes"]


def test_triton_decode_kernels_throughput(gpu_metrics):
    from gpu_measure import dequant_gbps, inverse_transform_gbps

    gpu_metrics["decode_goal_gbps"] = DECODE_GOAL_GBPS
    d = dequant_gbps("cuda", tokens=32768, channels=1024, dtype="bfloat16")
    gpu_metrics["dequant_triton_gbps"] = round(d["gbps"], 2)
    t = inverse_transform_gbps("cuda", tokens=8192, heads=8, head_dim=128, dtype="bfloat16")
    gpu_metrics["inverse_transform_triton_gbps"] = round(t["gbps"], 2)
    gpu_metrics["decode_kernel_shapes"] = {
        "dequant": "32768 tokens x 1024 channels, bf16 out, per-128-channel scales",
        "inverse_transform": "K+V of 8192 tokens x 8 heads x 128, bf16 out, one group per head, RoPE",
    }
    assert d["gbps"] > 0 and t["gbps"] > 0


def test_triton_cold_compile_times(tmp_path, gpu_metrics):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))  # nothing compiled yet
    script = Path(__file__).resolve().parent / "gpu_measure.py"
    res = subprocess.run(
        [sys.executable, str(script), "compile", "--device", "cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line.removeprefix("RESULT "))
    gpu_metrics["triton_compile"] = r
    assert r["kvpool_warm_up"]["writes"] == ["kv", "codes:quant_deflate"], r


@pytest.mark.gpu_needs("sglang.srt.mem_cache.memory_pool")
def test_writeback_device_encode_matches_the_host_encode_and_its_rate(gpu_metrics):
    """The write-back's device encode (``KVWriter.read_quantized_later``) on a CUDA pool: quantized on the
    writer's side stream, codes and scales back in pinned memory, blobs byte-identical to a host encode of the
    same KV (CUDA's float32 division, multiply and round-half-even are IEEE's, as numpy's). Records
    ``writeback_device_quantize_gbps`` (bf16 KV read out of the pool per second, quantize + D2H included) and
    ``writeback_host_lossless_s_per_gb`` (host CPU seconds per GB of KV left to the host: the lossless stage)."""
    import time

    import numpy as np
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec

    fp = synthetic.fingerprint(num_layers=8, heads=8, dim=128, dtype="bfloat16")
    lay, chunk, tokens = fp.layout, 256, 16384
    pool = MHATokenToKVPool(tokens + 256, 1, torch.bfloat16, 8, 128, 8, "cuda", False)
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, timeout_s=30.0)
    k, v = synthetic.kv(lay, tokens, seed=3)
    slots = torch.randperm(tokens + 200, device="cpu")[:tokens] + 1
    w.write(k, v, slots)
    codec = get_codec("quant_deflate")
    q = w.read_quantized_later(slots, codec.spec, chunk).result()
    for j in (0, tokens // chunk - 1):
        want = codec.encode(
            np.ascontiguousarray(k[:, j * chunk : (j + 1) * chunk]),
            np.ascontiguousarray(v[:, j * chunk : (j + 1) * chunk]),
            fp,
        )
        assert codec.encode_quantized(q, j, fp) == want, f"chunk {j}: device encode differs from the host's"
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        q = w.read_quantized_later(slots, codec.spec, chunk).result()
        runs.append(time.perf_counter() - t0)
    kv_bytes = 2 * lay.num_layers * tokens * lay.num_kv_heads * lay.head_dim * 2
    gpu_metrics["writeback_device_quantize_gbps"] = round(kv_bytes / min(runs) / 1e9, 2)
    t0 = time.thread_time()
    for j in range(8):
        codec.encode_quantized(q, j, fp)
    cpu = time.thread_time() - t0
    gpu_metrics["writeback_host_lossless_s_per_gb"] = round(cpu / (kv_bytes * 8 / (tokens // chunk)) * 1e9, 3)
    assert w.stats["device_encode"] == 4


@pytest.mark.gpu_needs("sglang.srt.mem_cache.memory_pool")
@pytest.mark.parametrize("quantizer", ["scalar", "trellis"])
def test_writeback_device_encode_of_the_transform_codec(gpu_metrics, quantizer):
    """The transform codec's write-back encode on a CUDA pool (``kernels/transform_encode.py``): RoPE undo, the
    forward transform, token scales and the quantizer on the side stream, symbols back in pinned memory. Its
    blobs decode as close to the KV as a host encode's (float32 rounding apart, not bit-identical). Records
    ``writeback_device_transform_<quantizer>_gbps`` (bf16 KV per second, D2H included) and the host CPU
    seconds per GB the whole read takes on the calling thread (``..._host_launch_s_per_gb``: kernel launches)."""
    import time

    import calibration_helpers
    import numpy as np
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec import calibration as cm
    from sgl_remote_kv.codec.base import decode
    from sgl_remote_kv.codec.quant import to_f32
    from sgl_remote_kv.codec.transform import TransformCodec

    fp = synthetic.fingerprint(num_layers=8, heads=8, dim=128, dtype="bfloat16")
    lay, chunk, tokens = fp.layout, 256, 4096
    cal = calibration_helpers.make_calibration(fp, ("0.0005",), 0.05, 0, None, 8, sinks=4)
    try:
        codec = TransformCodec(cal.calib_id.hex(), "0.0005", "deflate", quantizer=quantizer)
        pool = MHATokenToKVPool(tokens + 256, 1, torch.bfloat16, 8, 128, 8, "cuda", False)
        w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, timeout_s=60.0)
        k, v = synthetic.kv(lay, tokens, seed=3)
        slots = torch.randperm(tokens + 200, device="cpu")[:tokens] + 1
        w.write(k, v, slots)
        spec = codec.device_encode_spec(fp)
        q = w.read_quantized_later(slots, spec, chunk, 0).result()
        for j in (0, tokens // chunk - 1):
            kj, vj = (np.ascontiguousarray(a[:, j * chunk : (j + 1) * chunk]) for a in (k, v))
            host = decode(codec.encode(kj, vj, fp, start=j * chunk), fp)
            dev = decode(codec.encode_quantized(q, j, fp), fp)
            for x, a, b in zip((kj, vj), host, dev, strict=True):
                x, a, b = (to_f32(t, lay.dtype) for t in (x, a, b))
                err, apart = (float(np.sqrt(np.mean(d**2))) for d in (a - x, a - b))
                assert apart <= 0.05 * err, (
                    f"chunk {j}: device-encoded decode {apart} from the host's (error {err})"
                )
        runs, cpu = [], []
        for _ in range(2):
            t0, c0 = time.perf_counter(), time.thread_time()
            w.read_quantized_later(slots, spec, chunk, 0).result()
            runs.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        kv_bytes = 2 * lay.num_layers * tokens * lay.num_kv_heads * lay.head_dim * 2
        gpu_metrics[f"writeback_device_transform_{quantizer}_gbps"] = round(kv_bytes / min(runs) / 1e9, 3)
        gpu_metrics[f"writeback_device_transform_{quantizer}_host_launch_s_per_gb"] = round(
            min(cpu) / kv_bytes * 1e9, 3
        )
    finally:
        cm.unregister(cal.calib_id)
