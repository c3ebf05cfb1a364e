"""Byte-level lossless back-ends shared by the codecs: raw (stored), Deflate (isal, raw stream), zstd.

Deflate streams of quantized symbols can be written *Huffman-only* (zlib's ``Z_HUFFMAN_ONLY``: dynamic
Huffman blocks of ``HUFFMAN_MEM_LEVEL``'s size, no LZ77 matches). They are ordinary Deflate (every
inflater, a DPU's engine included, decodes them); on noise-like symbols the matches cost more than they
save, and smaller blocks let the code follow the symbols' changing spread.

``decompress_into`` never produces more than the claimed length (no decompression bombs) and raises
only ``CorruptChunk``. isal, zlib and zstandard release the GIL while (de)compressing.
"""

from __future__ import annotations

import logging
import struct
import zlib

import numpy as np
import zstandard
from isal import isal_zlib

from sgl_remote_kv.codec.errors import CorruptChunk

logger = logging.getLogger(__name__)

RAW, DEFLATE, ZSTD = 0, 1, 2
METHODS = {"raw": RAW, "deflate": DEFLATE, "zstd": ZSTD}
# zlib memLevel of Huffman-only streams: blocks of 2^(8+6) = 16 Ki symbols. Chosen on the tune texts'
# transform-codec symbols: 7 gave +1.5% ratio but 12% slower inflate, 9 -3% ratio (docs/CODEC.md).
HUFFMAN_MEM_LEVEL = 8


def compress_huffman(data) -> bytes:
    """A raw Deflate stream of ``data`` with Huffman coding only (see module docstring)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15, HUFFMAN_MEM_LEVEL, zlib.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush()


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


SUB = struct.Struct("<BBHI")
STREAM = struct.Struct("<BxxxII")
MAX_STREAMS = 4


def pack_streams(method: int, level: int, parts, huffman_only=()) -> bytes:
    """Compress each part as its own stream (own Huffman table); a stream that does not shrink is stored
    raw; the parts whose index is in ``huffman_only`` are Huffman-only Deflate (``method`` DEFLATE).
    Layout: ``<BBHI`` (0, number of streams, 0, total raw length), per stream ``<BxxxII`` (method, raw
    length, compressed length), then the bodies in order."""
    if not 0 < len(parts) <= MAX_STREAMS:
        raise ValueError(f"1..{MAX_STREAMS} streams")
    if huffman_only and method != DEFLATE:
        raise ValueError("Huffman-only streams are Deflate")
    heads, bodies = [], []
    for i, part in enumerate(parts):
        m, body = method, compress_huffman(part) if i in huffman_only else compress(method, part, level)
        if len(body) >= len(part):
            m, body = RAW, bytes(part)
        heads.append(STREAM.pack(m, len(part), len(body)))
        bodies.append(body)
    return b"".join([SUB.pack(0, len(bodies), 0, sum(len(p) for p in parts)), *heads, *bodies])


def unpack_streams(section, out: np.ndarray, method: int) -> int:
    """Inverse of ``pack_streams`` into ``out`` (concatenated parts); returns the bytes written. Streams
    may only use ``method`` or raw. Raises only ``CorruptChunk``."""
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
    for m, rl, cl in streams:
        if m not in (RAW, method):
            raise CorruptChunk(f"stream method {m} does not match codec params")
        decompress_into(m, section[body : body + cl], out[o : o + rl], rl)
        o, body = o + rl, body + cl
    return raw_len
