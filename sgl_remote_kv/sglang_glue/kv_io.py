"""SGLang's paged KV pool as we see it: its layout (the fingerprint) and its one ``KVWriter``.

Relies on ``MHATokenToKVPool``'s ``k_buffer``/``v_buffer`` (per-layer ``[slots, heads, dim]`` tensors),
``dtype`` and ``store_dtype``. The writer (``sgl_remote_kv.kvpool``) owns every read and write of token KV
in the pool; see its contract there.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from sgl_remote_kv.kvpool import KVWriter, PoolTensors, writer_for
from sgl_remote_kv.types import KVLayout, ModelFingerprint

logger = logging.getLogger(__name__)

_TORCH_TO_KV = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


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


def pool_writer(kvcache, layout: KVLayout, ops=None) -> KVWriter:
    """The pool's one ``KVWriter`` (``kvpool``): every write of fetched KV and every read of the
    write-back goes through it; this is the only module that touches ``k_buffer``/``v_buffer``."""
    return writer_for(PoolTensors(kvcache.k_buffer, kvcache.v_buffer), layout, ops=ops)
