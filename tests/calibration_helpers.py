"""A synthetic transform-codec calibration (random orthonormal bases): for tests that need the codec
without fitting it to a real model (``tests/test_calibrate.py`` fits the real one); the device-decode tests'
codec and the lossless stage's views they write."""

from __future__ import annotations

import numpy as np

from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec import rans, transform_ops
from sgl_remote_kv.types import ModelFingerprint, RopeSpec


def make_calibration(
    fp: ModelFingerprint,
    levels=("0.0005", "0.001", "0.01"),
    step=0.05,
    seed=0,
    rope=None,
    groups=1,
    sinks=1,
    register=True,
) -> cm.Calibration:
    """A calibration of ``fp``'s model (all its KV heads: ``num_kv_heads * tp_size``) in ``groups`` head
    groups; level i gets step ``step * (i + 1)`` on every component."""
    lay = fp.layout
    rope = rope or RopeSpec(10000.0, lay.head_dim, "neox")
    heads = lay.num_kv_heads * fp.tp_size
    c = heads // groups * lay.head_dim
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((lay.num_layers, 2, groups, c, c)))[0].astype(np.float32)
    mean = rng.standard_normal((lay.num_layers, 2, groups, c)).astype(np.float32) * 0.1
    steps = {
        lv: np.full((lay.num_layers, 2, groups, c), step * (1 + i), np.float32) for i, lv in enumerate(levels)
    }
    flat = np.zeros((lay.num_layers * 2 * groups * c, cm.SYMBOLS))
    flat[:, 100:157] = 10.0  # a window around symbol 128 (q = 0); the rest is escaped under rANS
    flat[:, transform_ops.ESC] = 1.0
    freq = rans.normalize_counts(flat, rans.PROB_BITS).reshape(lay.num_layers, 2, groups * c, cm.SYMBOLS)
    cal = cm.Calibration(cm.model_key(fp), rope, mean, basis, steps, {lv: freq for lv in levels}, sinks=sinks)
    if register:
        cm.register(cal)
    return cal


def device_decode_codec(kind: str, fp: ModelFingerprint):
    """The codec the device-decode tests fetch with: ``quant_deflate`` (token scales), or the transform codec
    on a synthetic calibration of ``fp`` whose step 0.02 gives escapes and an exact sink token on synthetic
    KV, with the scalar quantizer (``transform``) or the trellis (``transform_trellis``; with zstd as its
    entropy stage: ``transform_trellis_zstd``)."""
    from sgl_remote_kv.codec.base import get_codec

    if kind == "quant_deflate":
        return get_codec("quant_deflate", k_bins="256", v_bins="96", granularity="token")
    quantizer, entropy = {
        "transform": ("scalar", "deflate"),
        "transform_trellis": ("trellis", "deflate"),
        "transform_trellis_zstd": ("trellis", "zstd"),
    }[kind]
    cal = make_calibration(fp, step=0.02, seed=3)
    return get_codec(
        "transform", calibration=cal.calib_id.hex(), quality="0.0005", entropy=entropy, quantizer=quantizer
    )


def layer_views(codec, fp: ModelFingerprint, blobs, layer: int) -> list:
    """The lossless stage's view of ``layer`` of each blob (what a fetch path stages for a device writer)."""
    out = []
    for b in blobs:
        hdr = codec.parse(b, fp)
        out.append(codec.codes_stage(b, hdr, layer, np.empty(codec.scratch_bytes(hdr, layer), np.uint8)))
    return out
