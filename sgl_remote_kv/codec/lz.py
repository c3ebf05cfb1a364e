"""Byte-level lossless back-ends shared by the codecs: raw (stored), Deflate (isal, raw stream), zstd.

``decompress_into`` never produces more than the claimed length (no decompression bombs) and raises
only ``CorruptChunk``. isal and zstandard release the GIL while (de)compressing.
"""

from __future__ import annotations

import logging

import numpy as np
import zstandard
from isal import isal_zlib

from sgl_remote_kv.codec.errors import CorruptChunk

logger = logging.getLogger(__name__)

RAW, DEFLATE, ZSTD = 0, 1, 2
METHODS = {"raw": RAW, "deflate": DEFLATE, "zstd": ZSTD}


def compress(method: int, data, level: int) -> bytes:
    if method == RAW:
        return bytes(data)
    if method == DEFLATE:
        c = isal_zlib.compressobj(level, isal_zlib.DEFLATED, -15)
        return c.compress(data) + c.flush()
    if method == ZSTD:
        return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)
    raise ValueError(f"unknown method {method}")


def decompress_into(method: int, data, out: np.ndarray, raw_len: int) -> int:
    """Decompress ``data`` (exactly ``raw_len`` bytes expected) into ``out[:raw_len]``."""
    if raw_len > out.size:
        raise CorruptChunk(f"section claims {raw_len} decoded bytes, scratch holds {out.size}")
    if method == RAW:
        if len(data) != raw_len:
            raise CorruptChunk("stored section length mismatch")
        out[:raw_len] = np.frombuffer(data, np.uint8)
        return raw_len
    if method == DEFLATE:
        d = isal_zlib.decompressobj(-15)
        try:
            res = d.decompress(data, raw_len)
        except isal_zlib.error as e:
            raise CorruptChunk(f"inflate failed: {e}") from None
        if len(res) != raw_len or not d.eof or d.unconsumed_tail or d.unused_data:
            raise CorruptChunk("inflated size mismatch")
    elif method == ZSTD:
        try:
            if zstandard.frame_content_size(data) != raw_len:
                raise CorruptChunk("zstd frame size mismatch")
            res = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_len)
        except zstandard.ZstdError as e:
            raise CorruptChunk(f"zstd failed: {e}") from None
        if len(res) != raw_len:
            raise CorruptChunk("zstd size mismatch")
    else:
        raise CorruptChunk(f"unknown compression method {method}")
    out[:raw_len] = np.frombuffer(res, np.uint8)
    return raw_len
