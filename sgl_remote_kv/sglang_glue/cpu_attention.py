"""``cpu_prefix``: a CPU attention backend whose cost on a prefix hit scales with the new tokens.

SGLang's ``torch_native`` backend runs extend batches as a full ``seq_len x seq_len`` causal SDPA per
request (the cached prefix's query rows are filled with garbage and thrown away), so a request with
a 1,500-token cached prefix and one new token still pays for 1,500 query rows in every layer.

This backend subclasses ``TorchNativeAttnBackend`` and replaces only its two per-request SDPA loops:

- extend/prefill: only the ``extend_len`` new queries attend to all ``prefix_len + extend_len``
  keys, under a lower-right-aligned causal mask (query ``i`` sees keys ``<= prefix_len + i``). With
  no prefix it uses ``is_causal=True`` on the square problem, exactly like ``torch_native``;
- decode: one query per request, no mask (as in ``torch_native``, but with per-batch metadata).

Per-request KV slot indices and masks are built once per forward batch and reused by every layer.
GQA goes through SDPA's ``enable_gqa``. Sliding windows are honoured with the same window semantics
as ``torch_native``. Encoder-decoder batches (``encoder_lens``) and cross-attention layers are
delegated unchanged to ``torch_native``'s implementation.

Registration (SGLang 0.5.23 extension points, no SGLang file edited): :func:`register` adds
``cpu_prefix`` to ``sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES`` (so
``--attention-backend cpu_prefix`` parses) and to
``sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS`` via
``register_attention_backend``, and wraps the whitelisted resolution step ``handle_cpu_backends``
(``sglang.srt.arg_groups.resolution_hooks.register_resolution_hook``) so ``--device cpu`` without
``--attention-backend`` resolves to ``cpu_prefix`` instead of ``intel_amx``/``torch_native``. The
general plugin's ``load()`` calls it in every SGLang process when the CPU dev platform is enabled;
``CpuDevPlatform.get_default_attention_backend()`` also returns it.

Threads: every ``forward``/``_run_*`` method runs on the scheduler process's forward thread (the
thread that calls ``ModelRunner.forward``); :func:`register` runs on the main thread of each SGLang
process while plugins load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

logger = logging.getLogger(__name__)

BACKEND_NAME = "cpu_prefix"


def lower_right_causal_mask(
    q_len: int,
    kv_len: int,
    *,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bool mask ``[q_len, kv_len]``: query ``i`` sits at position ``kv_len - q_len + i``.

    ``True`` means "may attend". With ``sliding_window`` (``torch_native`` semantics) a query at
    position ``p`` also needs ``k >= p - sliding_window``. Pure function; any thread.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None and sliding_window > -1:
        mask &= k_pos >= q_pos - sliding_window
    return mask


def attend_new_tokens(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None,
    causal: bool = True,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the last ``q_len`` positions of a sequence over all of its keys.

    ``query`` [q_len, Hq, D]; ``key`` [kv_len, Hkv, D]; ``value`` [kv_len, Hkv, Dv]; returns
    [q_len, Hq, Dv]. ``Hq`` must be a multiple of ``Hkv`` (GQA, ``repeat_interleave`` head order).
    ``mask`` may pass a precomputed :func:`lower_right_causal_mask`. Pure function; any thread.
    """
    q_len, kv_len = query.shape[0], key.shape[0]
    if key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    is_causal = False
    if causal and (sliding_window is None or sliding_window < 0) and q_len == kv_len:
        is_causal, mask = True, None  # square problem: same kernel path as torch_native
    elif causal and mask is None and (q_len > 1 or sliding_window is not None):
        mask = lower_right_causal_mask(q_len, kv_len, sliding_window=sliding_window, device=query.device)
    elif not causal:
        mask = None
    out = scaled_dot_product_attention(
        query.movedim(0, 1).unsqueeze(0),
        key.movedim(0, 1).unsqueeze(0),
        value.movedim(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.squeeze(0).movedim(1, 0)


@dataclass
class _BatchPlan:
    """Per-forward-batch request layout, shared by all layers (built on the forward thread)."""

    seq_lens: torch.Tensor  # snapshots, to detect a stale plan
    req_pool_indices: torch.Tensor
    q_lens: list[int]
    seq_len_list: list[int]
    kv_index: list[torch.Tensor]  # per request: KV pool slots of the whole sequence
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def matches(self, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, q_lens) -> bool:
        return (
            self.seq_lens.shape == seq_lens.shape
            and torch.equal(self.seq_lens, seq_lens)
            and torch.equal(self.req_pool_indices, req_pool_indices)
            and (q_lens is None or q_lens == self.q_lens)
        )

    def mask(self, i: int, window: int | None) -> torch.Tensor:
        key = (i, window)
        if key not in self.masks:
            self.masks[key] = lower_right_causal_mask(
                self.q_lens[i], self.seq_len_list[i], sliding_window=window
            )
        return self.masks[key]


def _build_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: list[int],
) -> _BatchPlan:
    seq_list = [int(s) for s in seq_lens.tolist()]
    pool_list = [int(r) for r in req_pool_indices.tolist()]
    kv_index = [req_to_token[r, :s] for r, s in zip(pool_list, seq_list, strict=True)]
    return _BatchPlan(seq_lens.clone(), req_pool_indices.clone(), q_lens, seq_list, kv_index)


class CpuPrefixAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with new-token-only extend attention; see the module docstring."""

    def __init__(self, model_runner) -> None:
        """Built by SGLang's ``ModelRunner`` on the scheduler process's main thread."""
        super().__init__(model_runner)
        self._plan: _BatchPlan | None = None
        self._plan_mode: str | None = None
        self._warned_fallback = False

    def init_forward_metadata(self, forward_batch) -> None:
        """Forward thread, once per batch before the layers run: drop the previous batch's plan."""
        super().init_forward_metadata(forward_batch)
        self._plan, self._plan_mode = None, None

    def _get_plan(self, mode, req_to_token, req_pool_indices, seq_lens, q_lens):
        plan = self._plan
        check_q = q_lens if mode == "extend" else None
        if plan is None or self._plan_mode != mode or not plan.matches(seq_lens, req_pool_indices, check_q):
            if q_lens is None:
                q_lens = [1] * int(seq_lens.shape[0])
            plan = _build_plan(req_to_token, req_pool_indices, seq_lens, q_lens)
            self._plan, self._plan_mode = plan, mode
        return plan

    def _fallback(self, what: str) -> None:
        if not self._warned_fallback:
            logger.info("cpu_prefix: %s delegated to torch_native's implementation", what)
            self._warned_fallback = True

    def _run_sdpa_forward_extend(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        """Forward thread, once per layer: extend queries only, lower-right causal mask."""
        if encoder_lens is not None or is_cross_attn:
            self._fallback("encoder-decoder/cross-attention extend")
            return super()._run_sdpa_forward_extend(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                extend_prefix_lens,
                extend_seq_lens,
                encoder_lens,
                scaling=scaling,
                enable_gqa=enable_gqa,
                causal=causal,
                is_cross_attn=is_cross_attn,
                sliding_window_size=sliding_window_size,
            )
        q_lens = [int(n) for n in extend_seq_lens.tolist()]
        plan = self._get_plan("extend", req_to_token, req_pool_indices, seq_lens, q_lens)
        window = sliding_window_size if causal else None
        start = 0
        for i, q_len in enumerate(plan.q_lens):
            end = start + q_len
            if q_len == 0:
                continue
            idx = plan.kv_index[i]
            square = q_len == plan.seq_len_list[i]
            need_mask = causal and (window is not None or (not square and q_len > 1))
            output[start:end] = attend_new_tokens(
                query[start:end],
                k_cache[idx],
                v_cache[idx],
                scale=scaling,
                causal=causal,
                sliding_window=window,
                mask=plan.mask(i, window) if need_mask else None,
            )
            start = end
        return output

    def _run_sdpa_forward_decode(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        """Forward thread, once per layer: one query per request against its whole sequence."""
        if encoder_lens is not None or is_cross_attn:
            self._fallback("encoder-decoder/cross-attention decode")
            return super()._run_sdpa_forward_decode(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                encoder_lens,
                scaling=scaling,
                enable_gqa=enable_gqa,
                causal=causal,
                is_cross_attn=is_cross_attn,
                sliding_window_size=sliding_window_size,
            )
        plan = self._get_plan("decode", req_to_token, req_pool_indices, seq_lens, None)
        window = sliding_window_size
        for i in range(len(plan.q_lens)):
            idx = plan.kv_index[i]
            output[i : i + 1] = attend_new_tokens(
                query[i : i + 1],
                k_cache[idx],
                v_cache[idx],
                scale=scaling,
                causal=window is not None,
                sliding_window=window,
                mask=plan.mask(i, window) if window is not None else None,
            )
        return output


def create_cpu_prefix_backend(model_runner) -> CpuPrefixAttnBackend:
    """Factory SGLang calls (scheduler main thread) for ``--attention-backend cpu_prefix``."""
    if getattr(model_runner, "use_mla_backend", False):
        raise NotImplementedError(
            "cpu_prefix attention does not support MLA models; use --attention-backend torch_native"
        )
    return CpuPrefixAttnBackend(model_runner)


def _default_cpu_backend(server_args, previous) -> None:
    """Resolution-hook wrapper of SGLang's ``handle_cpu_backends`` (launcher main thread).

    With ``--device cpu`` and no ``--attention-backend``, SGLang would pick ``intel_amx`` (and fall
    back to ``torch_native``) before the platform's ``get_default_attention_backend`` is consulted;
    this declares ``cpu_prefix`` first. An explicit ``--attention-backend`` is left untouched.
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cfg.device == "cpu" and cfg.attention_backend is None:
        declare_resolution(server_args, "sgl_remote_kv.cpu_attention", attention_backend=BACKEND_NAME)
    previous(server_args)


_registered = False


def register() -> None:
    """Make ``cpu_prefix`` a valid ``--attention-backend``, a registered backend and the CPU default.

    Idempotent. Called from the general plugin's ``load()`` (only when the CPU dev platform is
    enabled) on the main thread of every SGLang process.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_cpu_prefix_backend)
    register_resolution_hook("handle_cpu_backends")(_default_cpu_backend)
    _registered = True
    logger.debug("registered attention backend %r (CPU default)", BACKEND_NAME)
