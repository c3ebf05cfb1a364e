"""Byte-level lossless back-ends shared by the codecs: raw (stored), Deflate (isal, raw stream), zstd.

Deflate streams of quantized symbols can be written *Huffman-only* (zlib's ``Z_HUFFMAN_ONLY``: dynamic
Huffman blocks, no LZ77 matches). They are ordinary Deflate (every inflater, a DPU's engine included,
decodes them); on noise-like symbols the matches cost more than they save, and blocks let the code follow
the symbols' changing spread. Where the stream is component-major (rows of ``row`` symbols, one row per
component, whose spread changes from row to row), ``plan_blocks`` places the block boundaries at the row
boundaries that minimize the estimated cost (a dynamic program over groups of ``PLAN_ROWS`` rows: each
block's entropy under its own histogram, its code table, and a charge for the inflater's per-block
work), and the encoder ends a block there (``Z_BLOCK``); otherwise zlib ends one every
``HUFFMAN_MEM_LEVEL``'s worth of symbols.

zstd streams of such symbols (``compress_planned``) end their blocks at the same planned row boundaries
(a zstd block flush): zstd codes the literals of each block with its own Huffman table (Huff0, four
interleaved streams), which a CPU decodes about twice as fast as ISA-L inflates Huffman-only Deflate, at
a slightly larger size (docs/CODEC.md "Entropy stage").

``decompress_into`` never produces more than the claimed length (no decompression bombs) and raises
only ``CorruptChunk``. isal, zlib and zstandard release the GIL while (de)compressing.
"""

from __future__ import annotations

import struct
import threading
import zlib

import numpy as np
import zstandard
from isal import isal_zlib
from numba import njit

from sgl_remote_kv.codec.errors import CorruptChunk

RAW, DEFLATE, ZSTD = 0, 1, 2
METHODS = {"raw": RAW, "deflate": DEFLATE, "zstd": ZSTD}
PACKED = {"deflate": DEFLATE, "zstd": ZSTD}  # the methods of ``pack_streams``'s symbol streams
# zlib memLevel of Huffman-only streams: blocks of 2^(8+6) = 16 Ki symbols. Chosen on the tune texts'
# transform-codec symbols: 7 gave +1.5% ratio but 12% slower inflate, 9 -3% ratio (docs/CODEC.md).
HUFFMAN_MEM_LEVEL = 8
# Planned blocks: boundaries on every PLAN_ROWS-th row (2 rows: +0.1% more for twice the planning work);
# a block's code table is estimated at PLAN_TABLE_BITS + PLAN_SYMBOL_BITS per symbol it codes (the
# measured dynamic-header size of these streams: about 60 bits and 4-5 bits per used literal), and each
# block is charged PLAN_BLOCK_BITS more for the inflater's per-block work (ISA-L builds its decode tables
# per block): at 0 the plan makes ~9 blocks per 256-token stream, 1.9% smaller than zlib's 16 Ki-symbol
# blocks but inflating 26% slower; at 1600, ~3.3 blocks, 1.0% smaller, inflating as fast (docs/CODEC.md).
PLAN_ROWS = 4
PLAN_TABLE_BITS = 60.0
PLAN_SYMBOL_BITS = 4.5
PLAN_BLOCK_BITS = 1600.0
_NLOGN = np.zeros(1)  # n log2 n, n = 0.. (grown by plan_blocks)
_tls = threading.local()


@njit(nogil=True, cache=True)
def _plan(rows, group: int, table_bits: float, symbol_bits: float, nlogn, cuts) -> int:
    """Block ends (row indices, ascending, the last = the row count) into ``cuts``; returns their number.
    Exact dynamic program over boundaries every ``group`` rows; a block costs its entropy under its own
    histogram + ``table_bits`` + ``symbol_bits`` per symbol it uses; ``nlogn[n]`` = n log2 n for n up to
    the symbol count."""
    c_n, t_n = rows.shape
    n_u = (c_n + group - 1) // group
    hist = np.zeros((n_u + 1, 256), np.int64)  # hist[u] = symbol counts of rows before unit u
    for u in range(n_u):
        hist[u + 1] = hist[u]
        for r in range(u * group, min(c_n, (u + 1) * group)):
            for t in range(t_n):
                hist[u + 1, rows[r, t]] += 1
    lo, hi = 255, 0
    for s in range(256):
        if hist[n_u, s]:
            lo, hi = min(lo, s), max(hi, s)
    best = np.full(n_u + 1, np.inf)
    prev = np.zeros(n_u + 1, np.int64)
    best[0] = 0.0
    for j in range(1, n_u + 1):
        for i in range(j):
            n = 0
            bits = 0.0
            used = 0
            for s in range(lo, hi + 1):
                c = hist[j, s] - hist[i, s]
                if c:
                    n += c
                    bits -= nlogn[c]
                    used += 1
            cost = best[i] + nlogn[n] + bits + table_bits + symbol_bits * used
            if cost < best[j]:
                best[j] = cost
                prev[j] = i
    k = 0
    j = n_u
    while j > 0:
        cuts[k] = min(c_n, j * group)
        k += 1
        j = prev[j]
    cuts[:k] = cuts[:k][::-1].copy()
    return k


def plan_blocks(data, row: int) -> list[int]:
    """Where a Huffman-only stream of rows of ``row`` symbols should end its blocks: row indices,
    ascending, the last = the row count (see module docstring)."""
    global _NLOGN
    rows = np.frombuffer(data, np.uint8).reshape(-1, row)
    nlogn = _NLOGN  # grown, never changed in place: a thread sees a whole table
    if nlogn.size <= rows.size:
        n = np.arange(rows.size + 1, dtype=np.float64)
        nlogn = _NLOGN = n * np.log2(np.maximum(n, 1.0))
    cuts = np.empty(rows.shape[0] // PLAN_ROWS + 2, np.int64)
    k = _plan(rows, PLAN_ROWS, PLAN_TABLE_BITS + PLAN_BLOCK_BITS, PLAN_SYMBOL_BITS, nlogn, cuts)
    return cuts[:k].tolist()


def compress_huffman(data, row: int = 0) -> bytes:
    """A raw Deflate stream of ``data`` with Huffman coding only; with ``row`` (``data`` is rows of that
    many symbols), its blocks end where ``plan_blocks`` says (see module docstring)."""
    if row <= 0 or len(data) % row or len(data) == 0:
        c = zlib.compressobj(9, zlib.DEFLATED, -15, HUFFMAN_MEM_LEVEL, zlib.Z_HUFFMAN_ONLY)
        return c.compress(data) + c.flush()
    data = memoryview(data).cast("B")
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    out, start = [], 0
    for end in plan_blocks(data, row):
        out.append(c.compress(data[start * row : end * row]))
        out.append(c.flush(zlib.Z_BLOCK if end * row < len(data) else zlib.Z_FINISH))
        start = end
    return b"".join(out)


def compress_planned(data, row: int, level: int) -> bytes:
    """A zstd frame (content size in its header) of ``data``, rows of ``row`` symbols, its blocks ending
    where ``plan_blocks`` says (every block also ends at zstd's 128 KiB block limit)."""
    if row <= 0 or len(data) % row or len(data) == 0:
        return compress(ZSTD, data, level)
    data = memoryview(data).cast("B")
    c = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=len(data))
    out, start = [], 0
    for end in plan_blocks(data, row):
        out.append(c.compress(data[start * row : end * row]))
        last = end * row >= len(data)
        out.append(c.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH if last else zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        start = end
    return b"".join(out)


def compress(method: int, data, level: int) -> bytes:
    if method == RAW:
        return bytes(data)
    if method == DEFLATE:
        c = isal_zlib.compressobj(level, isal_zlib.DEFLATED, -15)
        return c.compress(data) + c.flush()
    if method == ZSTD:
        return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)
    raise ValueError(f"unknown method {method}")


def _zstd() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (a context per call cost ~20% of a 50 KB stream's decode; one may
    not be used by two threads at once)."""
    d = getattr(_tls, "zstd", None)
    if d is None:
        d = _tls.zstd = zstandard.ZstdDecompressor()
    return d


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
            res = _zstd().decompress(data, max_output_size=raw_len)
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


def pack_streams(method: int, level: int, parts, symbols=(), row: int = 0) -> bytes:
    """Compress each part as its own stream (own Huffman table); a stream that does not shrink is stored
    raw; the parts whose index is in ``symbols`` are quantized symbols, with blocks planned on rows of
    ``row`` symbols where given: Huffman-only Deflate (``compress_huffman``) or zstd (``compress_planned``).
    Layout: ``<BBHI`` (0, number of streams, 0, total raw length), per stream ``<BxxxII`` (method, raw
    length, compressed length), then the bodies in order."""
    if not 0 < len(parts) <= MAX_STREAMS:
        raise ValueError(f"1..{MAX_STREAMS} streams")
    if symbols and method not in (DEFLATE, ZSTD):
        raise ValueError("symbol streams are Deflate or zstd")
    planned = compress_huffman if method == DEFLATE else lambda part, row: compress_planned(part, row, level)
    heads, bodies = [], []
    for i, part in enumerate(parts):
        m, body = method, planned(part, row) if i in symbols else compress(method, part, level)
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
