"""Quantized + Deflate codec: ``quant`` binning, then the decoded-layer buffer Deflated with isal.

This is what the DPU data plane inflates (the ShadowServe hardware engine speaks Deflate). Given
CacheGen's bins (``k_bins="32@0,16@10", v_bins="32@0,16@2"``, granularity ``token``) it is also the
re-implemented ShadowServe peer.

The decoded-layer buffer is compressed as three independent streams — prelude + scales, K codes, V codes
— so K and V each get their own Huffman table (K and V use different bins, so their code histograms
differ; one shared table cost up to 8% of ratio). A stream that does not shrink is stored raw.

Section: ``<BBHI`` (0, number of streams, 0, raw_len), then per stream ``<BxxxII`` (method 0 raw /
1 deflate / 2 zstd, raw length, compressed length), then the stream bodies in order.
"""

from __future__ import annotations

import logging
import struct

import numpy as np

from sgl_remote_kv.codec import lz, quant
from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.types import ModelFingerprint

logger = logging.getLogger(__name__)

SUB = struct.Struct("<BBHI")
STREAM = struct.Struct("<BxxxII")
MAX_STREAMS = 3


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

    def encode_layer(self, k: np.ndarray, v: np.ndarray, layer: int, fingerprint: ModelFingerprint) -> bytes:
        buf = quant.quantize_layer(self.spec, k, v, layer, fingerprint.layout.dtype)
        n_codes = k.size
        cuts = [0, buf.size - 2 * n_codes, buf.size - n_codes, buf.size]
        heads, bodies = [], []
        for a, b in zip(cuts, cuts[1:], strict=False):
            method = lz.METHODS[self.method]
            body = lz.compress(method, buf[a:b], self.level)
            if len(body) >= b - a:
                method, body = lz.RAW, buf[a:b].tobytes()
            heads.append(STREAM.pack(method, b - a, len(body)))
            bodies.append(body)
        return b"".join([SUB.pack(0, len(bodies), 0, buf.size), *heads, *bodies])

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        if len(section) < SUB.size:
            raise CorruptChunk("section shorter than its sub-header")
        _, n_streams, _, raw_len = SUB.unpack_from(section, 0)
        body = SUB.size + n_streams * STREAM.size
        if not 0 < n_streams <= MAX_STREAMS or body > len(section):
            raise CorruptChunk("bad stream table")
        if raw_len > out.size:
            raise CorruptChunk(f"section claims {raw_len} decoded bytes, scratch holds {out.size}")
        streams = [STREAM.unpack_from(section, SUB.size + i * STREAM.size) for i in range(n_streams)]
        if sum(s[1] for s in streams) != raw_len or body + sum(s[2] for s in streams) != len(section):
            raise CorruptChunk("stream lengths do not add up")
        o = 0
        for method, rl, cl in streams:
            if method not in (lz.RAW, lz.METHODS[self.method]):
                raise CorruptChunk(f"stream method {method} does not match codec params")
            lz.decompress_into(method, section[body : body + cl], out[o : o + rl], rl)
            o, body = o + rl, body + cl
        return raw_len
