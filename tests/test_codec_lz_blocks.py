"""Planned Huffman-only blocks (``lz.plan_blocks`` / ``compress_huffman(data, row)``): plain Deflate any
inflater reads, block ends that are the exact optimum of the planner's own cost, and fewer bytes than
zlib's fixed-size blocks on a component-major stream whose spread changes from row to row; the zstd form
(``compress_planned``): a plain zstd frame, smaller than one zstd compression of the whole stream."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from isal import isal_zlib

from sgl_remote_kv.codec import lz


def _rows(c_n: int, t_n: int, seed: int = 3) -> np.ndarray:
    """Component-major symbols like the transform codec's: row r is Laplace noise around 128 whose spread
    changes across the rows in steps (wide, narrow, medium, very narrow: components of different energy
    against their steps), with a few wide rows mixed in."""
    rng = np.random.default_rng(seed)
    spread = np.choose(np.arange(c_n) * 4 // max(c_n, 1), [14.0, 1.0, 5.0, 0.4])
    spread[rng.choice(c_n, max(1, c_n // 16), replace=False)] *= 6
    q = np.rint(rng.laplace(0.0, spread[:, None], (c_n, t_n)))
    return (128 + np.clip(q, -127, 127)).astype(np.uint8)


def _cost(hist: np.ndarray) -> float:
    """The planner's cost of one block (entropy under its own histogram + its code table + the block
    charge), in bits."""
    used = hist[hist > 0].astype(np.float64)
    n = used.sum()
    return float(n * np.log2(n) - (used * np.log2(used)).sum()) + (
        lz.PLAN_TABLE_BITS + lz.PLAN_BLOCK_BITS + lz.PLAN_SYMBOL_BITS * used.size
    )


@pytest.mark.parametrize(("c_n", "t_n"), [(192, 256), (192, 37), (30, 1), (7, 64), (1, 5)])
def test_planned_stream_is_plain_deflate(c_n, t_n):
    rows = _rows(c_n, t_n)
    data = rows.tobytes()
    cuts = lz.plan_blocks(data, t_n)
    assert cuts[-1] == c_n and cuts == sorted(set(cuts))
    assert all(c % lz.PLAN_ROWS == 0 for c in cuts[:-1])
    body = lz.compress_huffman(data, t_n)
    assert zlib.decompress(body, -15) == data
    assert isal_zlib.decompressobj(-15).decompress(body) == data
    out = np.empty(len(data) + 50, np.uint8)
    sec = lz.pack_streams(lz.DEFLATE, 1, [b"prelude" * 3, data], symbols=(1,), row=t_n)
    assert lz.unpack_streams(memoryview(sec), out, lz.DEFLATE) == len(data) + 21
    assert out[21 : 21 + len(data)].tobytes() == data


def test_plan_is_the_optimum_of_its_cost():
    """Every partition of 7 row groups (64 of them) costs at least what the planner chose."""
    c_n, t_n = 7 * lz.PLAN_ROWS, 600
    rows = _rows(c_n, t_n, seed=8)
    hists = [np.bincount(rows[r].astype(np.int64), minlength=256) for r in range(c_n)]

    def total(cuts):
        edges = [0, *cuts]
        return sum(_cost(sum(hists[a:b])) for a, b in zip(edges[:-1], edges[1:], strict=True))

    units = [u * lz.PLAN_ROWS for u in range(1, 7)]
    best = min(
        total([*chosen, c_n]) for n in range(len(units) + 1) for chosen in itertools.combinations(units, n)
    )
    cuts = lz.plan_blocks(rows.tobytes(), t_n)
    assert total(cuts) == pytest.approx(best, rel=1e-9)
    assert 1 < len(cuts) < 7  # this stream's spread changes enough to split it, not enough for every group


def test_planned_blocks_beat_fixed_blocks():
    data = _rows(192, 256, seed=5).tobytes()
    planned, fixed = lz.compress_huffman(data, 256), lz.compress_huffman(data)
    assert len(planned) < 0.98 * len(fixed)


def test_unplannable_input_falls_back_to_fixed_blocks():
    data = _rows(10, 33).tobytes()
    assert lz.compress_huffman(data, 7) == lz.compress_huffman(data)  # 330 bytes are not rows of 7
    assert lz.compress_huffman(b"", 5) == lz.compress_huffman(b"")


@pytest.mark.parametrize(("c_n", "t_n"), [(192, 256), (1024, 256), (192, 37), (30, 1), (1, 5)])
def test_planned_zstd_stream_is_a_plain_zstd_frame(c_n, t_n):
    """Any zstd decoder reads it (its content size in the frame header), and through ``pack_streams`` /
    ``unpack_streams`` it round-trips beside a zstd prelude. (1024, 256): 256 KiB, over zstd's 128 KiB
    block limit."""
    import zstandard

    data = _rows(c_n, t_n).tobytes()
    body = lz.compress_planned(data, t_n, 1)
    assert zstandard.frame_content_size(body) == len(data)
    assert zstandard.ZstdDecompressor().decompress(body) == data
    sec = lz.pack_streams(lz.ZSTD, 1, [b"prelude" * 3, data], symbols=(1,), row=t_n)
    out = np.empty(len(data) + 21, np.uint8)
    assert lz.unpack_streams(memoryview(sec), out, lz.ZSTD) == len(data) + 21
    assert out[21:].tobytes() == data
    head = lz.STREAM.unpack_from(sec, lz.SUB.size + lz.STREAM.size)
    if head[0] == lz.ZSTD:  # (a stream that did not shrink is stored raw, which either method reads)
        with pytest.raises(lz.CorruptChunk, match="method"):  # a zstd section is not read as Deflate
            lz.unpack_streams(memoryview(sec), out, lz.DEFLATE)
    assert head[0] == (lz.ZSTD if c_n * t_n >= 1000 else head[0])


def test_planned_zstd_blocks_beat_one_zstd_compression():
    data = _rows(192, 256, seed=5).tobytes()
    assert len(lz.compress_planned(data, 256, 1)) < 0.98 * len(lz.compress(lz.ZSTD, data, 1))
    assert lz.compress_planned(data, 7, 1) == lz.compress(lz.ZSTD, data, 1)  # not rows of 7: one call
