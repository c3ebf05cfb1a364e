"""Quantized + Deflate codec: ``quant`` binning, then the decoded-layer buffer Deflated with isal.

This is what the DPU data plane inflates (the ShadowServe hardware engine speaks Deflate). Given
CacheGen's bins (``k_bins="32@0,16@10", v_bins="32@0,16@2"``, granularity ``token``) it is also the
re-implemented ShadowServe peer. A layer whose Deflate output is not smaller is stored raw.

Section: ``<BBHI`` (method 0 raw / 1 deflate / 2 zstd, 0, 0, raw_len) + body.
"""

from __future__ import annotations

import logging
import struct

import numpy as np

from sgl_remote_kv.codec import lz, quant
from sgl_remote_kv.codec.base import Codec
from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.codec.format import ChunkHeader
from sgl_remote_kv.types import ModelFingerprint

logger = logging.getLogger(__name__)

SUB = struct.Struct("<BBHI")


class QuantDeflateCodec(Codec):
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
    ):
        if method not in lz.METHODS:
            raise ValueError(f"method must be one of {sorted(lz.METHODS)}")
        self.spec = quant.QuantSpec.make(k_bins, v_bins, granularity, k_channel_scale)
        self.method, self.level = method, int(level)

    def params(self) -> dict:
        return {**self.spec.params(), "method": self.method, "level": self.level}

    def encode_layer(self, k: np.ndarray, v: np.ndarray, layer: int, fingerprint: ModelFingerprint) -> bytes:
        buf = quant.quantize_layer(self.spec, k, v, layer, fingerprint.layout.dtype)
        method = lz.METHODS[self.method]
        body = lz.compress(method, buf, self.level)
        if len(body) >= buf.size:
            method, body = lz.RAW, buf.tobytes()
        return SUB.pack(method, 0, 0, buf.size) + body

    def scratch_bytes(self, header: ChunkHeader, layer: int) -> int:
        lay = header.layout
        return quant.max_decoded_bytes(self.spec, header.num_tokens, lay.num_kv_heads, lay.head_dim)

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        if len(section) < SUB.size:
            raise CorruptChunk("section shorter than its sub-header")
        method, _, _, raw_len = SUB.unpack_from(section, 0)
        if method not in (lz.RAW, lz.METHODS[self.method]):
            raise CorruptChunk(f"section method {method} does not match codec params")
        return lz.decompress_into(method, section[SUB.size :], out, raw_len)

    def dequant_stage(
        self, header: ChunkHeader, layer: int, decoded, out_k: np.ndarray, out_v: np.ndarray
    ) -> None:
        self._check_out(header, out_k, out_v)
        lay = header.layout
        buf = np.asarray(decoded, dtype=np.uint8)
        view = quant.split_layer(self.spec, buf, layer, header.num_tokens, lay.num_kv_heads, lay.head_dim)
        quant.dequant_layer(view, lay.dtype, out_k, out_v)
