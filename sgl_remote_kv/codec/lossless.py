"""Lossless codec: the exact bytes of the KV dtype, byte-plane shuffled, then Deflate or zstd.

Bit-exact for float32 / float16 / bfloat16. Byte-plane shuffling groups the sign/exponent bytes
(highly repetitive in KV) apart from the noisy low mantissa bytes, which is what buys ratio.

Section: ``<BBHI`` (method, shuffle, reserved, raw_len) + compressed bytes of [K planes | V planes].
"""

from __future__ import annotations

import struct

import numpy as np

from sgl_remote_kv.codec import lz
from sgl_remote_kv.codec.base import Codec
from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.codec.format import ChunkHeader
from sgl_remote_kv.types import ModelFingerprint

SUB = struct.Struct("<BBHI")


class LosslessCodec(Codec):
    name = "lossless"
    codec_id = 1
    exact = True

    def __init__(self, method: str = "zstd", level: int = 3, shuffle: bool = True):
        if method not in ("deflate", "zstd"):
            raise ValueError(f"method must be deflate or zstd, not {method!r}")
        self.method, self.level, self.shuffle = method, int(level), bool(shuffle)

    def params(self) -> dict:
        return {"method": self.method, "level": self.level, "shuffle": self.shuffle}

    def encode_layer(self, k: np.ndarray, v: np.ndarray, layer: int, fingerprint: ModelFingerprint) -> bytes:
        item = k.dtype.itemsize
        raw = np.concatenate([np.ascontiguousarray(k).ravel(), np.ascontiguousarray(v).ravel()])
        b = raw.view(np.uint8)
        if self.shuffle:
            b = np.ascontiguousarray(b.reshape(-1, item).T)
        body = lz.compress(lz.METHODS[self.method], b, self.level)
        return SUB.pack(lz.METHODS[self.method], int(self.shuffle), 0, b.size) + body

    def scratch_bytes(self, header: ChunkHeader, layer: int) -> int:
        lay = header.layout
        return 2 * header.num_tokens * lay.num_kv_heads * lay.head_dim * lay.itemsize

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        if len(section) < SUB.size:
            raise CorruptChunk("section shorter than its sub-header")
        method, shuffle, _, raw_len = SUB.unpack_from(section, 0)
        if method != lz.METHODS[self.method] or shuffle != int(self.shuffle):
            raise CorruptChunk("section method does not match codec params")
        return lz.decompress_into(method, section[SUB.size :], out, raw_len)

    def dequant_stage(
        self, header: ChunkHeader, layer: int, decoded, out_k: np.ndarray, out_v: np.ndarray
    ) -> None:
        self._check_out(header, out_k, out_v)
        item = out_k.dtype.itemsize
        n = out_k.size
        dec = np.asarray(decoded, dtype=np.uint8)
        if dec.size != 2 * n * item:
            raise CorruptChunk(f"decoded {dec.size} bytes, expected {2 * n * item}")
        for j, out in enumerate((out_k, out_v)):
            dst = out.reshape(-1).view(np.uint8).reshape(n, item)
            if self.shuffle:
                dst[:] = dec.reshape(item, 2 * n)[:, j * n : (j + 1) * n].T
            else:
                dst[:] = dec[j * n * item : (j + 1) * n * item].reshape(n, item)
