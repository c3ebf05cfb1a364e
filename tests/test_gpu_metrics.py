"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): measurements recorded in the GPU report's
``metrics`` section (``gpu_metrics`` fixture, ``tests/gpu_report.py``). Nothing here asserts a speed:
the tests check only that each number measured the path it names (``tests/gpu_measure.py``).

- ``writer_h2d_gbps_zero_copy`` / ``writer_h2d_gbps_staged``: a whole ``KVWriter.write`` of 128 MiB of
  K+V (8 layers x 4,096 tokens x 8 KV heads x 128, bf16) into SGLang's ``MHATokenToKVPool``: from a host
  region pinned in place vs from pageable memory (staged through the writer's pinned buffer);
- ``dequant_triton_gbps`` / ``inverse_transform_triton_gbps``: decoded KV bytes per second written by
  the Triton dequant (quant codecs) and inverse-transform (transform codec) kernels; the goal is
  ``decode_goal_gbps`` (50 GB/s), recorded next to them, not asserted;
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
