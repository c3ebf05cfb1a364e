"""Typed records shared by every component (codecs, stores, data planes, SGLang glue).

Nothing here imports torch or SGLang: the data-plane process and the codecs depend only on numpy.

KV tensors at our boundaries are numpy arrays shaped ``[num_layers, num_tokens, num_kv_heads, head_dim]``
(one array for K, one for V). ``bfloat16`` has no numpy dtype, so bf16 KV travels as ``np.uint16`` holding
the raw bits; ``KVLayout.dtype`` names the real element type. ``numpy_storage_dtype`` maps one to the other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

KV_DTYPES = ("float32", "float16", "bfloat16")
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def numpy_storage_dtype(dtype: str) -> np.dtype:
    """numpy dtype that holds elements of KV dtype ``dtype`` (bf16 -> uint16 raw bits)."""
    try:
        return np.dtype(_STORAGE[dtype])
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {KV_DTYPES}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV across the model (per TP rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # one of KV_DTYPES

    def __post_init__(self) -> None:
        numpy_storage_dtype(self.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if not 0 < getattr(self, name) <= 65536:
                raise ValueError(f"KVLayout.{name} out of range: {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return numpy_storage_dtype(self.dtype).itemsize

    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that makes KV of one deployment incompatible with another's.

    ``weights_id`` is a hex digest identifying the weights (see ``model.weights_identity``).
    """

    architecture: str
    layout: KVLayout
    weights_id: str
    tp_rank: int = 0
    tp_size: int = 1

    def canonical(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """32-byte SHA-256 over the canonical JSON form (stable across processes and hosts)."""
        return hashlib.sha256(self.canonical()).digest()
