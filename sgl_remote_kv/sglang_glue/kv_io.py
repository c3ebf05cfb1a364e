"""Read and write token KV in SGLang's paged device KV pool, and describe the pool as a fingerprint.

Only the scheduler thread calls these functions (the pool is the forward pass's memory: writing it from
another thread would race with attention kernels on a GPU). Arrays follow ``types``: numpy
``[layers, tokens, heads, dim]`` in the layout's storage dtype (bf16 as ``uint16`` raw bits).

Buffers: ``read_kv`` returns fresh numpy arrays owned by the caller (a copy: the slots may be freed
and reused as soon as the scheduler moves on). ``write_kv`` copies out of the caller's arrays before
returning; the caller may reuse or drop them afterwards.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from sgl_remote_kv.types import KVLayout, ModelFingerprint

logger = logging.getLogger(__name__)

_TORCH_TO_KV = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_RAW_VIEW = {torch.bfloat16: torch.int16}  # numpy has no bf16: move raw bits


class UnsupportedPool(Exception):
    """The KV pool is not a plain MHA pool we can address per layer (MLA, fp8, hybrid...)."""


def pool_layout(kvcache) -> KVLayout:
    """KV layout of a plain MHA pool (``k_buffer``/``v_buffer`` lists of ``[slots, heads, dim]``)."""
    k_buf = getattr(kvcache, "k_buffer", None)
    if not isinstance(k_buf, list) or not k_buf:
        raise UnsupportedPool(f"{type(kvcache).__name__} has no per-layer k_buffer list")
    if getattr(kvcache, "store_dtype", kvcache.dtype) != kvcache.dtype:
        raise UnsupportedPool("quantized KV cache storage is not supported")
    dtype = _TORCH_TO_KV.get(kvcache.dtype)
    if dtype is None:
        raise UnsupportedPool(f"KV dtype {kvcache.dtype} is not supported")
    _, heads, dim = k_buf[0].shape
    return KVLayout(num_layers=len(k_buf), num_kv_heads=int(heads), head_dim=int(dim), dtype=dtype)


def weights_id_for(model_path: str) -> str:
    """Weights identity: ``model.weights_identity`` for a local dir, else a digest of the name."""
    p = Path(model_path)
    if p.is_dir():
        from sgl_remote_kv.model import weights_identity

        return weights_identity(p)
    return hashlib.sha256(f"model-name:{model_path}".encode()).hexdigest()


def fingerprint_for(
    kvcache, architecture: str, model_path: str, tp_rank: int, tp_size: int
) -> ModelFingerprint:
    return ModelFingerprint(
        architecture=architecture,
        layout=pool_layout(kvcache),
        weights_id=weights_id_for(model_path),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    raw = _RAW_VIEW.get(t.dtype)
    if raw is not None:
        return t.view(raw).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def _to_torch(a: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    raw = _RAW_VIEW.get(dtype)
    if raw is not None:
        t = t.view(raw).view(dtype)
    return t.to(device, non_blocking=False)


def read_kv(kvcache, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Copy the KV of ``indices`` (slot ids) out of every layer: ``([L, T, H, D], [L, T, H, D])``."""
    idx = indices.to(kvcache.k_buffer[0].device, dtype=torch.int64)
    k = np.stack([_to_numpy(kvcache.k_buffer[i][idx]) for i in range(len(kvcache.k_buffer))])
    v = np.stack([_to_numpy(kvcache.v_buffer[i][idx]) for i in range(len(kvcache.v_buffer))])
    return k, v


def write_kv_layer(kvcache, layer: int, slots: torch.Tensor, k: np.ndarray, v: np.ndarray) -> None:
    """Scatter one layer's ``[T, H, D]`` K and V into ``slots`` of the pool (local layer index)."""
    kb, vb = kvcache.k_buffer[layer], kvcache.v_buffer[layer]
    idx = slots.to(kb.device, dtype=torch.int64)
    kb[idx] = _to_torch(k, kb.dtype, kb.device)
    vb[idx] = _to_torch(v, vb.dtype, vb.device)


def write_kv(kvcache, slots: torch.Tensor, k: np.ndarray, v: np.ndarray) -> None:
    """Scatter ``[L, T, H, D]`` K and V into ``slots`` for every layer."""
    for layer in range(k.shape[0]):
        write_kv_layer(kvcache, layer, slots, k[layer], v[layer])
