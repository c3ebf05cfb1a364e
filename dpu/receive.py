"""The receive buffer of one streamed chunk: which layer groups are in, and verified.

``ChunkReceiver`` takes a chunk blob's bytes in order (the payload pieces of a streamed store read) into
one buffer of the blob's length (the store frame's, known before the first payload byte). Once the chunk
header is in it is parsed and verified by ``parse(header bytes, the whole buffer)`` (the pipeline's: the
codec's ``parse(..., complete=False)`` and its occupancy checks:
header CRC, limits, fingerprint, codec); its claimed length must equal the buffer's. ``add`` returns the
layer groups (``lo, hi``: ``group`` layers each, the pipeline's slabs) that became complete with a piece,
each of their sections' CRC checked, in layer order. Raises ``CorruptChunk`` (a bad header or section).

Nothing here vouches for the *value*: sections with good CRCs can still belong to another key's value (a
misplaced or rewritten store value). Only the store frame's CRC at the end says so (``StreamedGet``); the
pipeline holds what it derived from the groups until then.

Threads: one (the fetch worker). Buffers: ``buf`` belongs to the chunk's task once handed over; the groups
returned are never written again, so slab workers may read them while later pieces arrive.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.codec.format import ChunkHeader, header_len, layer_section


class ChunkReceiver:
    def __init__(
        self, length: int, num_layers: int, group: int, parse: Callable[[np.ndarray, np.ndarray], ChunkHeader]
    ) -> None:
        self.buf = np.empty(length, np.uint8)
        self.filled = 0
        self.header: ChunkHeader | None = None
        self._layers, self._group, self._parse = num_layers, max(1, group), parse
        self.next_layer = 0  # the first layer not yet handed out

    @property
    def complete(self) -> bool:
        """Every byte is in and every layer group was handed out."""
        return self.filled == len(self.buf) and self.next_layer == self._layers

    def add(self, piece) -> list[tuple[int, int]]:
        """Append ``piece``; the layer groups now complete and verified."""
        n = len(piece)
        if self.filled + n > len(self.buf):
            raise CorruptChunk("more bytes than the store value's length")
        self.buf[self.filled : self.filled + n] = np.frombuffer(piece, np.uint8)
        self.filled += n
        if self.header is None:
            need = header_len(self.buf[: self.filled])
            if need is None or self.filled < need:
                return []
            self.header = self._parse(self.buf[:need], self.buf)
            if self.header.blob_len != len(self.buf):
                raise CorruptChunk(
                    f"chunk header claims {self.header.blob_len} bytes, the value holds {len(self.buf)}"
                )
        out = []
        lo = self.next_layer
        while lo < self._layers:
            hi = min(self._layers, lo + self._group)
            last = self.header.layers[hi - 1]
            if last.offset + last.length > self.filled:
                break
            for layer in range(lo, hi):
                layer_section(self.buf, self.header, layer, verify=True)
            out.append((lo, hi))
            lo = hi
        self.next_layer = lo
        return out
