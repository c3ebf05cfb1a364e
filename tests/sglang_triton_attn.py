"""SGLang 0.5.23's own Triton attention backend (``TritonAttnBackend``) over a real ``MHATokenToKVPool``,
without a server: for checking that attention reads fetched KV as it reads KV written by SGLang.

``TritonAttnBackend.__init__`` takes a ``ModelRunner``. A real one loads a model, builds the process
groups and every pool; none of that is what is under test, so ``standin_runner`` builds a stand-in with
exactly the attributes ``__init__`` reads (sglang/srt/layers/attention/triton_backend.py, 0.5.23):
``req_to_token_pool`` (``.size``, ``.req_to_token``), ``sliding_window_size``, ``token_to_kv_pool``,
``token_to_kv_pool_allocator``, ``page_size``, ``kv_index_translator``, ``decode_num_tokens_per_req()``,
``model_config`` (``attention_arch``, ``hf_config``, ``is_draft_model``, ``linear_attn_registry_result``,
``get_max_num_attention_heads()``, ``get_num_kv_heads(tp, dcp)``, ``v_head_dim``, ``swa_v_head_dim``,
``context_len``, ``head_dim``, ``is_encoder_decoder``), ``is_draft_worker``, ``device``, ``gpu_id``.
The pools, the ``KVIndexTranslator``, the ``RadixAttention`` layers and the ``ForwardBatch`` es are
SGLang's real classes. The backend also reads SGLang's process config (``get_exec()``, ``get_spec()``,
``get_parallel()``, ...): ``sglang_config()`` publishes SGLang's own test default (``override_server_args``)
with decode context parallelism off (``attn_dcp_rank=0``) for the duration.

Batches are one request: ``prefix`` tokens already in the pool (the fetched KV) and ``extend`` new tokens
whose K/V are passed to ``forward_extend`` (``save_kv_cache=False``: nothing here writes the pool, so
SGLang's JIT ``store_cache`` kernel is not needed), then one decode step over everything in the pool.

On CUDA with ``scripts/gpu_check.sh``'s import-only ``sgl_kernel`` stub, the one ``sgl_kernel`` call
``__init__`` makes (``is_arch_support_pdl``: programmatic dependent launch) is answered False here.
On a CPU the kernels run under ``TRITON_INTERPRET=1`` (float16 / float32; the interpreter's bf16
``tl.dot`` is wrong).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch


@contextlib.contextmanager
def sglang_config():
    """SGLang's process config for a standalone backend (see module docstring)."""
    from sglang.srt.runtime_context import get_context, get_parallel

    override = get_context().override_server_args()
    override.install()
    try:
        with get_parallel().override(attn_dcp_rank=0):
            yield
    finally:
        override.restore()


def standin_runner(pool, req_to_token_pool, heads: int, context_len: int):
    """The attributes ``TritonAttnBackend.__init__`` reads of a ``ModelRunner`` (module docstring)."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from transformers import LlamaConfig

    device = str(pool.device)
    hf = LlamaConfig(
        num_attention_heads=heads,
        num_key_value_heads=pool.head_num,
        head_dim=pool.head_dim,
        hidden_size=heads * pool.head_dim,
        num_hidden_layers=pool.layer_num,
    )
    model_config = SimpleNamespace(
        hf_config=hf,
        is_draft_model=False,
        linear_attn_registry_result=None,
        attention_arch=AttentionArch.MHA,
        get_max_num_attention_heads=lambda: heads,
        get_num_kv_heads=lambda tp_size, dcp_size=1: pool.head_num,
        v_head_dim=pool.v_head_dim,
        swa_v_head_dim=None,
        context_len=context_len,
        head_dim=pool.head_dim,
        is_encoder_decoder=False,
    )
    translator = KVIndexTranslator(
        req_to_token=req_to_token_pool.req_to_token,
        token_to_kv_pool_allocator=None,  # a plain pool: no unified / fused-draft allocator to translate
        token_to_kv_pool=pool,
        page_size=1,
        device=device,
    )
    return SimpleNamespace(
        req_to_token_pool=req_to_token_pool,
        sliding_window_size=None,
        token_to_kv_pool=pool,
        token_to_kv_pool_allocator=None,
        page_size=1,
        kv_index_translator=translator,
        decode_num_tokens_per_req=lambda: 1,
        model_config=model_config,
        is_draft_worker=False,
        device=device,
        gpu_id=torch.device(device).index or 0,
    )


def backend(pool, req_to_token_pool, heads: int, context_len: int):
    """SGLang's ``TritonAttnBackend`` over ``pool`` (call inside ``sglang_config()``)."""
    from sglang.srt.layers.attention import triton_backend

    if pool.device != "cpu" and _sgl_kernel_is_stub():
        triton_backend.is_arch_support_pdl = lambda: False  # the stub raises; see module docstring
    return triton_backend.TritonAttnBackend(standin_runner(pool, req_to_token_pool, heads, context_len))


def _sgl_kernel_is_stub() -> bool:
    try:
        import sgl_kernel
    except ImportError:
        return False
    return bool(getattr(sgl_kernel, "STUB", False))


def layers(heads: int, kv_heads: int, head_dim: int, n: int) -> list:
    from sglang.srt.layers.radix_attention import RadixAttention

    return [RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, i) for i in range(n)]


def extend_batch(translator, req_row: int, slots: torch.Tensor, prefix: int, extend: int):
    """One request at ``req_to_token`` row ``req_row`` whose tokens sit at ``slots``: ``prefix`` tokens in
    the pool, ``extend`` new ones written at ``slots[prefix:prefix + extend]``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    dev = translator.device
    total = prefix + extend
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
    rows, seq = i64([req_row]), i64([total])
    out_loc = slots[prefix:total].to(dev)
    plan = translator.plan(req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.cpu(), write_virtual=out_loc)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.zeros(extend, dtype=torch.int64, device=dev),
        req_pool_indices=rows,
        seq_lens=seq,
        out_cache_loc=out_loc,
        seq_lens_sum=total,
        seq_lens_cpu=seq.cpu(),
        extend_prefix_lens=i64([prefix]),
        extend_seq_lens=i64([extend]),
        extend_prefix_lens_cpu=[prefix],
        extend_seq_lens_cpu=[extend],
        positions=torch.arange(prefix, total, device=dev),
        kv_loc_plan=plan,
    )


def decode_batch(translator, req_row: int, slots: torch.Tensor, seq_len: int):
    """One decode step of the request whose ``seq_len`` tokens (the last one new) sit at ``slots``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    dev = translator.device
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
    rows, seq = i64([req_row]), i64([seq_len])
    out_loc = slots[seq_len - 1 : seq_len].to(dev)
    plan = translator.plan(req_pool_indices=rows, seq_lens=seq, seq_lens_cpu=seq.cpu(), write_virtual=out_loc)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        input_ids=torch.zeros(1, dtype=torch.int64, device=dev),
        req_pool_indices=rows,
        seq_lens=seq,
        out_cache_loc=out_loc,
        seq_lens_sum=seq_len,
        seq_lens_cpu=seq.cpu(),
        positions=i64([seq_len - 1]),
        kv_loc_plan=plan,
    )


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of the last ``len(q)`` positions over ``k``/``v`` ``[S, Hkv, D]``;
    ``q`` ``[n, Hq * D]`` -> ``[n, Hq * D]``."""
    n, s, hkv, d = q.shape[0], k.shape[0], k.shape[1], k.shape[2]
    hq = q.shape[1] // d
    q64 = q.double().view(n, hq, d)
    k64, v64 = (t.double().repeat_interleave(hq // hkv, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q64, k64) / math.sqrt(d)
    allowed = torch.arange(s, device=q.device)[None, :] <= torch.arange(s - n, s, device=q.device)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64).reshape(n, hq * d)
