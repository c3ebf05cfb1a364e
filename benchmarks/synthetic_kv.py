"""Synthetic KV for tests and quick experiments (real KV comes from benchmarks/kvdata.py)."""

from __future__ import annotations

import numpy as np

from sgl_remote_kv.types import KVLayout, ModelFingerprint, numpy_storage_dtype


def fingerprint(
    num_layers: int = 4, heads: int = 3, dim: int = 64, dtype: str = "bfloat16"
) -> ModelFingerprint:
    return ModelFingerprint("LlamaForCausalLM", KVLayout(num_layers, heads, dim, dtype), "synthetic")


def from_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> storage dtype (bf16: round to nearest even, raw bits)."""
    if dtype == "bfloat16":
        u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(numpy_storage_dtype(dtype))


def kv(layout: KVLayout, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """K with a few large outlier channels and per-token drift, V roughly Gaussian."""
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, tokens, layout.num_kv_heads, layout.head_dim)
    chan = rng.gamma(2.0, 0.5, size=(layout.num_layers, 1, layout.num_kv_heads, layout.head_dim))
    chan[..., :: max(1, layout.head_dim // 4)] *= 8.0  # outlier channels
    k = rng.standard_normal(shape) * chan + 0.3 * np.sin(np.arange(tokens))[None, :, None, None]
    v = rng.standard_normal(shape) * 0.5
    return from_f32(k.astype(np.float32), layout.dtype), from_f32(v.astype(np.float32), layout.dtype)


def fitted_rans_codec(fp: ModelFingerprint, tokens: int = 64, n_samples: int = 2, **params):
    """A ``quant_rans`` codec with tables fitted on synthetic KV for ``fp`` (tests, demos)."""
    from sgl_remote_kv.codec.calibration import tables
    from sgl_remote_kv.codec.quant_rans import QuantRansCodec

    spec_codec = QuantRansCodec(**params)
    samples = [kv(fp.layout, tokens, seed=100 + i) for i in range(n_samples)]
    return QuantRansCodec(**params, tables=tables.fit(spec_codec.spec, fp, samples))
