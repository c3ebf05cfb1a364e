"""``dpu.receive.ChunkReceiver``: a chunk blob fed in pieces hands out each layer group once all its
sections are in and their CRCs passed, whatever the cut; a bad section or length is ``CorruptChunk``."""

from __future__ import annotations

import pytest
from dpu_helpers import FP, LAYOUT, codecs, random_chunks
from sgl_remote_kv.dpu.receive import ChunkReceiver

from sgl_remote_kv.codec.errors import CorruptChunk


def _receiver(blob, group=3):
    codec = codecs()["lossless"]
    return ChunkReceiver(
        len(blob), LAYOUT.num_layers, group, lambda head, buf: codec.parse(head, FP, complete=False)
    )


def _blob() -> bytes:
    ((k, v),) = random_chunks(1, seed=21)
    return codecs()["lossless"].encode(k, v, FP)


@pytest.mark.parametrize("cut", [1, 7, 100, 1000, 1 << 20])
def test_groups_come_out_in_order_once_their_sections_are_in(cut):
    blob = _blob()
    rx = _receiver(blob)
    got = []
    for i in range(0, len(blob), cut):
        for lo, hi in rx.add(blob[i : i + cut]):
            last = rx.header.layers[hi - 1]
            assert last.offset + last.length <= rx.filled  # never before its bytes
            got.append((lo, hi))
    assert got == [(0, 3), (3, 4)] and rx.complete and bytes(rx.buf) == blob


def test_a_bad_section_stops_at_its_group_and_a_wrong_length_at_the_header():
    blob = _blob()
    bad = bytearray(blob)
    bad[-3] ^= 0x10  # in the last layer's section
    rx = _receiver(bad, group=1)
    out = rx.add(bad[: len(bad) - 1])
    assert out == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(CorruptChunk, match="layer 3 checksum"):
        rx.add(bad[-1:])
    longer = ChunkReceiver(
        len(blob) + 5,
        LAYOUT.num_layers,
        1,
        lambda head, buf: codecs()["lossless"].parse(head, FP, complete=False),
    )
    with pytest.raises(CorruptChunk, match="claims"):
        longer.add(blob)
    with pytest.raises(CorruptChunk, match="more bytes"):
        _receiver(blob).add(bytes(blob) + b"x")
