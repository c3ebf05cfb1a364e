"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): SGLang's own Triton attention backend over KV
the tier fetched.

A real data plane fetches a 3-chunk prefix (lossless codec) layer-wise into SGLang's ``MHATokenToKVPool``
on CUDA through the DPU client; the request is admitted at ``verified`` while layers still arrive, with
``LayerwiseInstalls`` registered as the pool's layer-transfer counter. SGLang's ``TritonAttnBackend``
(extend of 8 new tokens, then one decode step, every layer) runs on a non-default forward stream: the
pool's ``get_key_buffer`` waits in the counter, which makes that stream wait on each layer's write event.
Attention over the fetched KV equals attention over the same KV written directly into a second pool,
and a float64 reference (``tests/tier_scenarios.py``: ``attention_over_fetched_kv``, ``check_attention``).

The backend is built from a stand-in ``ModelRunner`` with exactly the attributes its ``__init__`` reads
(``tests/sglang_triton_attn.py``). The same scenario runs on a CPU pool under ``TRITON_INTERPRET=1`` in
the default suite (``tests/test_gpu_suite_on_cpu.py``). Skipped with the reason without a CUDA device, or
naming the module when one was not carried to the GPU machine (``tests/gpu_gate.py``): SGLang's attention
backend imports more of SGLang than its KV pool does (``openai``, ``partial_json_parser``, ...).
"""

from __future__ import annotations

import pytest
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_needs(
        "sglang.srt.mem_cache.memory_pool",
        "sglang.srt.layers.attention.triton_backend",
        "transformers",  # the stand-in runner's hf_config
        "sgl_remote_kv.fetch.dpu_client.client",
        "sgl_remote_kv.dpu.server",
    ),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_attention_over_kv_fetched_layerwise(tmp_path, dtype, gpu_metrics):
    from tier_scenarios import attention_over_fetched_kv, check_attention

    r = attention_over_fetched_kv("cuda", dtype, tmp_path, dma_delay_s=0.2)
    gpu_metrics[f"layerwise_install_and_extend_s_{dtype}"] = r["install_and_extend_s"]
    check_attention(r)
