"""Lossless nvCOMP-style ANS over the raw bf16 KV bytes, as a peer row (benchmark only).

What it stands for: FlexKV's nvCOMP path (taco-project/FlexKV#183, ``csrc/compression/ans/nvcomp_ans.cu``)
compresses each KV chunk it moves (GPU <-> CPU <-> SSD) with nvCOMP's batched ANS, data type ``float16`` for
bf16/fp16 KV (``uint8`` for fp8), and reports ~1.4x on real bf16 KV (~1.1x on fp8). nvCOMP's ANS is a rANS
coder working on independent chunks (the high-level manager's default chunk is 64 KiB; FlexKV's chunk is
one (layer, K/V) slice of a cache block), each with its own symbol statistics; with a 16-bit data type the
two bytes of each value are modelled separately (the exponent-carrying high byte is where bf16 KV is
compressible; the low mantissa byte is nearly uniform).

Here, per KV chunk (all layers, K then V, as stored ``[L, T, H, D]``): the bytes of K and of V are cut into
``chunk_bytes`` pieces (64 KiB); each piece is coded with one static order-0 rANS distribution per byte
plane (``float16`` mode: high bytes and low bytes, two distributions) or one over the interleaved bytes
(``char`` mode, nvCOMP's default data type), the distributions stored in the piece (a 256-bit presence map
plus a 16-bit frequency per present symbol); a piece that does not shrink is stored raw (1 flag byte).
The coder is ``sgl_remote_kv.codec.rans`` (12-bit frequencies, 4 interleaved 32-bit states, used read-only).

Deviations, stated: nvCOMP's bitstream, table format and sub-chunk interleaving are not public in detail;
its table encoding may be smaller than this one (~0.6 KB per 64 KiB piece in ``float16`` mode, ~1% of the
output) and its probability precision may differ (12 bits here costs ~0.01-0.02 bit/byte vs ideal).
"""

from __future__ import annotations

import struct

import numpy as np

from sgl_remote_kv.codec import rans

PROB_BITS = rans.PROB_BITS
CHUNK_BYTES = 65536
MODES = ("float16", "char")
_HDR = struct.Struct("<BII")  # stored (0 raw, 1 rANS), raw bytes, rANS words


def _planes(piece: np.ndarray, mode: str) -> np.ndarray:
    """A piece of little-endian bf16 bytes as ``[n, C]`` symbols, one column per distribution."""
    if mode == "float16":
        return np.ascontiguousarray(piece.reshape(-1, 2)[:, ::-1])  # (high byte, low byte)
    return piece.reshape(-1, 1)


def _table_bytes(freq: np.ndarray) -> bytes:
    present = freq > 0
    return np.packbits(present, bitorder="little").tobytes() + freq[present].astype("<u2").tobytes()


def _read_table(buf: bytes, off: int) -> tuple[np.ndarray, int]:
    present = np.unpackbits(np.frombuffer(buf, np.uint8, 32, off), bitorder="little").astype(bool)
    n = int(present.sum())
    freq = np.zeros(256, np.uint16)
    freq[present] = np.frombuffer(buf, "<u2", n, off + 32)
    return freq, off + 32 + 2 * n


def encode_piece(piece: np.ndarray, mode: str) -> bytes:
    """One chunk of bytes (``uint8``, even length in ``float16`` mode) -> its compressed record."""
    sym = _planes(piece, mode)
    counts = np.stack([np.bincount(sym[:, c], minlength=256) for c in range(sym.shape[1])]).astype(np.float64)
    freq = rans.normalize_counts(counts, PROB_BITS)
    cum, ok = rans.build_cum(freq, PROB_BITS)
    words, ok2 = rans.encode(sym, 0, freq, cum, PROB_BITS) if ok else (None, False)
    if not ok2:
        raise ValueError("rANS could not code a piece (a symbol without frequency)")
    body = b"".join(_table_bytes(f) for f in freq) + words.astype("<u2").tobytes()
    if len(body) >= piece.size:
        return _HDR.pack(0, piece.size, 0) + piece.tobytes()
    return _HDR.pack(1, piece.size, words.size) + body


def decode_piece(buf: bytes, off: int, mode: str) -> tuple[np.ndarray, int]:
    """Inverse of ``encode_piece`` from ``buf[off:]``: (the bytes, the offset after the record)."""
    stored, n, n_words = _HDR.unpack_from(buf, off)
    off += _HDR.size
    if stored == 0:
        return np.frombuffer(buf, np.uint8, n, off).copy(), off + n
    cols = 2 if mode == "float16" else 1
    freq = np.zeros((cols, 256), np.uint16)
    for c in range(cols):
        freq[c], off = _read_table(buf, off)
    cum16, bucket, ok = rans.build_decode_tables(freq, PROB_BITS)
    if not ok:
        raise ValueError("corrupt ANS frequency table")
    words = np.frombuffer(buf, "<u2", n_words, off).astype(np.uint16)
    sym = np.empty((n // cols, cols), np.uint8)
    if rans.decode(words, 0, cum16, bucket, PROB_BITS, sym) != 0:
        raise ValueError("corrupt ANS stream")
    out = sym[:, ::-1] if mode == "float16" else sym
    return np.ascontiguousarray(out).reshape(-1), off + 2 * n_words


class ANS:
    """Lossless: every chunk's bf16 K and V bytes through nvCOMP-style ANS in ``chunk_bytes`` pieces."""

    def __init__(self, mode: str = "float16", chunk_bytes: int = CHUNK_BYTES) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if chunk_bytes <= 0 or chunk_bytes % 2:
            raise ValueError(f"chunk_bytes must be positive and even, not {chunk_bytes}")
        self.mode, self.chunk_bytes = mode, chunk_bytes

    def encode(self, k: np.ndarray, v: np.ndarray, start: int = 0) -> bytes:
        if k.dtype != np.uint16 or v.shape != k.shape:
            raise ValueError("ANS peer takes bf16 bits (uint16) K and V of one shape")
        parts = [struct.pack("<5I", *k.shape, 0)]
        for a in (k, v):
            raw = np.ascontiguousarray(a).astype("<u2").view(np.uint8).reshape(-1)
            for s in range(0, raw.size, self.chunk_bytes):
                parts.append(encode_piece(raw[s : s + self.chunk_bytes], self.mode))
        return b"".join(parts)

    def decode(self, blob: bytes) -> tuple[np.ndarray, np.ndarray]:
        *shape, _ = struct.unpack_from("<5I", blob, 0)
        off = 20
        n = int(np.prod(shape)) * 2
        out = []
        for _ in range(2):
            buf = np.empty(n, np.uint8)
            for s in range(0, n, self.chunk_bytes):
                piece, off = decode_piece(blob, off, self.mode)
                if piece.size != min(self.chunk_bytes, n - s):
                    raise ValueError("ANS piece of the wrong length")
                buf[s : s + piece.size] = piece
            out.append(buf.view("<u2").astype(np.uint16).reshape(shape))
        if off != len(blob):
            raise ValueError(f"ANS blob has {len(blob) - off} trailing bytes")
        return out[0], out[1]


def grid(family: str) -> list[tuple[str, dict]]:
    """(label, params) of the ``ans`` family in ``benchmarks.bench_codec_rd``."""
    if family != "ans":
        raise KeyError(family)
    return [
        ("nvCOMP-style ANS, float16 byte planes, 64 KiB chunks (lossless)", {"mode": "float16"}),
        ("nvCOMP-style ANS, char (bytes), 64 KiB chunks (lossless)", {"mode": "char"}),
    ]


def make(params: dict) -> ANS:
    return ANS(params["mode"], int(params.get("chunk_bytes", CHUNK_BYTES)))
