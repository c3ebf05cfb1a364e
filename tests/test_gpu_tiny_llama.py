"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): a tiny random-weight Llama over KV the tier
fetched, offline (``tests/tiny_llama.py``: transformers ``LlamaForCausalLM`` from a config and a fixed
seed; nothing is downloaded).

The prefill KV of a 96-token prefix is encoded in 3 chunks, stored in an embedded store, fetched by a
real data plane through the DPU client into SGLang's ``MHATokenToKVPool`` on CUDA (``lossless``: decoded
KV, zero-copy out of the pinned destination region; ``transform``: codes, dequantized on the device by the
Triton inverse transform), and the model's cache is read straight out of the pool's rows. Then the
8-token suffix and 16 greedy steps run over it (``tests/tier_scenarios.py``: ``check_tiny_llama``):

- ``lossless``: the pool holds the prefill's KV bit for bit, and the greedy tokens equal those over the
  local KV, which equal a full recompute's (up to a near-tie of the recompute);
- ``transform`` (a synthetic calibration, ``tests/calibration_helpers.py``): the mean next-token KL
  against the exact KV stays within ``KL_BOUND`` (docs/CODEC.md's quality level 0.002; the reasoning is
  at the constant), the device decode is within float32 rounding of the CPU decode of the same blobs
  (KL between them <= ``KL_BOUND / 4``), and the prefix matters (no prefix: KL >= 100x the bound).

The same scenario runs on a CPU pool in the default suite (``tests/test_gpu_suite_on_cpu.py``). Skipped
with the reason without a CUDA device, or naming a module not carried (``tests/gpu_gate.py``).
"""

from __future__ import annotations

import pytest
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_needs(
        "transformers",
        "sglang.srt.mem_cache.memory_pool",
        "sgl_remote_kv.fetch.dpu_client.client",
        "sgl_remote_kv.dpu.server",
    ),
]


@pytest.mark.parametrize(
    "codec,dtype", [("lossless", "bfloat16"), ("lossless", "float32"), ("transform", "bfloat16")]
)
def test_tiny_llama_over_fetched_kv(tmp_path, monkeypatch, codec, dtype, gpu_metrics):
    from tier_scenarios import check_tiny_llama, tiny_llama_over_fetched_kv

    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "cache"))  # where the data plane finds a calibration
    r = tiny_llama_over_fetched_kv("cuda", dtype, codec, tmp_path)
    if codec == "lossless":
        assert r["writer_stats"].get("zero_copy", 0) >= 1, r  # out of the pinned destination region
    else:
        assert r["writer_stats"].get("device_dequant", 0) >= 1, r  # codes, inverse-transformed on the device
    gpu_metrics[f"tiny_llama_{codec}_{dtype}_kl_mean"] = r["kl_mean"]
    gpu_metrics[f"tiny_llama_{codec}_{dtype}_fetch_s"] = r["fetch_s"]
    check_tiny_llama(r)
