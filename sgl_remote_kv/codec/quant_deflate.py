"""Quantized + Deflate codec: ``quant`` binning, then the decoded-layer buffer Deflated with isal.

This is what the DPU data plane inflates (the ShadowServe hardware engine speaks Deflate). Given
CacheGen's bins (``k_bins="32@0,16@10", v_bins="32@0,16@2"``, granularity ``token``) it is also the
re-implemented ShadowServe peer.

The decoded-layer buffer is compressed as three independent streams — prelude + scales, K codes, V codes
— so K and V each get their own Huffman table (K and V use different bins, so their code histograms
differ; one shared table cost up to 8% of ratio). A stream that does not shrink is stored raw.

Section: ``lz.pack_streams`` of the three parts.
"""

from __future__ import annotations

import numpy as np

from sgl_remote_kv.codec import lz, quant
from sgl_remote_kv.types import ModelFingerprint


class QuantDeflateCodec(quant.QuantCodec):
    name = "quant_deflate"
    codec_id = 2

    def __init__(
        self,
        k_bins: str | int = "256",
        v_bins: str | int = "256",
        granularity: str = "token",
        k_channel_scale: bool = False,
        method: str = "deflate",
        level: int = 1,
        k_outliers: int = 0,
    ):
        if method not in lz.METHODS:
            raise ValueError(f"method must be one of {sorted(lz.METHODS)}")
        self.spec = quant.QuantSpec.make(k_bins, v_bins, granularity, k_channel_scale, k_outliers)
        self.method, self.level = method, int(level)

    def params(self) -> dict:
        return {**self.spec.params(), "method": self.method, "level": self.level}

    def encode_parts(
        self,
        head: np.ndarray,
        k_codes: np.ndarray,
        v_codes: np.ndarray,
        layer: int,
        fingerprint: ModelFingerprint,
    ) -> bytes:
        return lz.pack_streams(lz.METHODS[self.method], self.level, [head, k_codes, v_codes])

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        return lz.unpack_streams(section, out, lz.METHODS[self.method])
