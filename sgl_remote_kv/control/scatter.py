"""Host-side round scatter: contiguous ``[layers, tokens, heads, dim]`` destination -> paged KV pool.

Uses ``sgl_remote_kv.kernels.scatter.scatter`` (Triton on CUDA, torch reference on CPU), or, if the
kernels package is absent, ``index_copy_`` per layer. Called from the DPU client's receiver
thread; the destination bytes are owned by the client (shared memory), the pool by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVPoolTarget:
    """Where a request's fetched KV goes: per-layer pools ``[pool_size, heads, dim]`` and the token
    slots (``int64 [tokens]``, one per token of the fetched prefix, in order)."""

    k_pool: Sequence[torch.Tensor]
    v_pool: Sequence[torch.Tensor]
    slots: torch.Tensor


def as_torch(src: np.ndarray, dtype: str) -> torch.Tensor:
    """Zero-copy torch view of a numpy KV array in storage dtype (bf16 bits -> torch.bfloat16)."""
    t = torch.from_numpy(src)
    return t.view(_TORCH_DTYPES[dtype]) if dtype == "bfloat16" else t


def _kernel_scatter():
    try:
        from sgl_remote_kv.kernels.scatter import scatter
    except ImportError:  # kernels package not installed: torch reference below
        return None
    return scatter


def scatter_layers(
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    target: KVPoolTarget,
    layer_lo: int,
    token_lo: int,
) -> None:
    """Copy ``k_src``/``v_src`` ``[n_layers, T, H, D]`` into pool layers ``layer_lo..`` at the slots of
    tokens ``token_lo .. token_lo + T`` of the target (one kernel launch per K/V)."""
    n_layers, t = k_src.shape[0], k_src.shape[1]
    slots = target.slots[token_lo : token_lo + t]
    kern = _kernel_scatter()
    for src, pool in ((k_src, target.k_pool), (v_src, target.v_pool)):
        layers = list(pool[layer_lo : layer_lo + n_layers])
        if _scatter_numpy(src, layers, slots):
            continue
        if kern is not None:
            kern(src, layers, slots)
        else:
            for i in range(n_layers):
                layers[i].index_copy_(0, slots, src[i])


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _scatter_numpy(src: torch.Tensor, layers: list[torch.Tensor], slots: torch.Tensor) -> bool:
    """CPU pools: copy with numpy (single-threaded) instead of torch ops. This runs on the DPU client's
    receiver thread, possibly while the forward pass runs (layer-wise): a torch op here would open a
    second OpenMP team next to the forward pass's on the same cores. False if not applicable."""
    if src.is_cuda or any(d.is_cuda or d.dtype != src.dtype for d in layers) or src.dtype == torch.float64:
        return False
    idx = slots.cpu().numpy()
    for i, dst in enumerate(layers):
        _numpy_view(dst)[idx] = _numpy_view(src[i])
    return True
