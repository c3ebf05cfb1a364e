"""Destination-region layout of host rounds, and the writes out of it into the target's rows (staging).

A host round occupies one destination slot laid out as K ``[L, T_round, H, D]`` then V
``[L, T_round, H, D]`` (T_round: the round's tokens); a write takes a run of layers of a run of the round's
chunks (``rounds.RoundBook.try_write``) as one ``KVWriter.write`` of a ``[layers, tokens, H, D]`` view (each
layer's tokens contiguous; the whole block contiguous when it spans the round). A round fetched as codes
(``ClientFetch.codes``: the data plane writes each layer's
lossless-stage output, ``SubmitFetch.output``) lays its chunks out one after the other, each as ``L``
areas of its layer's K + V bytes, and goes into the rows one ``KVWriter.write_quantized`` per
layer (the writer keeps or dequantizes the codes). Called under the client's lock by the receiver thread (writes) and by
``submit`` (offsets); the region is owned by the client (the writer registers it as pinned memory).
"""

from __future__ import annotations

import numpy as np

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.codec.format import ChunkShape
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.sizing import layer_bytes
from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.types import KVLayout, numpy_storage_dtype

from .host_region import HostRegion
from .jobs import HostRound, KVTarget


class RoundIO:
    """Slot ``s`` of the region: decoded KV at ``s * slot_bytes``; its blob area (layer-wise only) at
    ``slots * slot_bytes + s * blob_bytes``, where the data plane copies the round's verified blobs."""

    def __init__(
        self,
        dest: HostRegion,
        layout: KVLayout,
        slot_bytes: int,
        slots: int = 0,
        blob_bytes: int = 0,
        codec=None,
    ) -> None:
        self.dest, self.layout, self.slot_bytes, self.codec = dest, layout, slot_bytes, codec
        self.slots, self.blob_bytes = slots, blob_bytes
        self.dtype = numpy_storage_dtype(layout.dtype)

    def blob_area(self, slot: int) -> tuple[int, int]:
        """(offset, capacity) of ``slot``'s blob area; (0, 0) when there is none."""
        if not self.blob_bytes:
            return 0, 0
        return self.slots * self.slot_bytes + slot * self.blob_bytes, self.blob_bytes

    def verified_copies(self, slot: int, refs: list[P.BlobRef], codec, fingerprint, tokens: list[int]):
        """(blobs, headers): copies of the blobs ``refs`` points at in ``slot``'s blob area, re-parsed
        here (header, CRCs) and holding ``tokens`` tokens each. Raises ``ChunkError`` otherwise. Called
        by the receiver thread before it handles the round's ``JobDone`` (the slot is not reused until
        then), so the copies are never torn by a later round."""
        lo, cap = self.blob_area(slot)
        if not cap or any(r.off < lo or r.off + r.length > lo + cap for r in refs):
            raise ChunkError("blob reference outside the round's blob area")
        blobs = [self.dest.array[r.off : r.off + r.length].tobytes() for r in refs]
        headers = [codec.parse(b, fingerprint) for b in blobs]
        if [h.num_tokens for h in headers] != tokens:
            raise ChunkError("verified chunk holds the wrong number of tokens")
        return blobs, headers

    def chunk_dests(
        self, r: HostRound, keys: list[bytes], tokens: list[int], codes: bool = False
    ) -> list[P.ChunkDest]:
        """Where the data plane writes each chunk of round ``r`` (``codes``: the round is fetched as codes)."""
        lay = self.layout
        stride = layer_bytes(lay, r.tokens)
        base = r.slot * self.slot_bytes
        out, t = [], 0
        for i in range(r.chunk_lo, r.chunk_hi):
            if codes:
                off, area = self._codes_area(r.slot, t, tokens[i])
                out.append(P.ChunkDest(keys[i], tokens[i], off, off, area))
            else:
                off = base + layer_bytes(lay, t)
                out.append(P.ChunkDest(keys[i], tokens[i], off, off + lay.num_layers * stride, stride))
            t += tokens[i]
        return out

    def round_view(self, slot: int, r: HostRound) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) ``[L, T_round, H, D]`` views of a round's data in ``slot`` (no copy)."""
        lay = self.layout
        n = lay.num_layers * layer_bytes(lay, r.tokens)
        base = slot * self.slot_bytes
        shape = (lay.num_layers, r.tokens, lay.num_kv_heads, lay.head_dim)
        k = self.dest.array[base : base + n].view(self.dtype).reshape(shape)
        v = self.dest.array[base + n : base + 2 * n].view(self.dtype).reshape(shape)
        return k, v

    def write_layers(
        self,
        slot: int,
        r: HostRound,
        c0: int,
        c1: int,
        lo: int,
        hi: int,
        t0: int,
        n_tok: int,
        target: KVTarget,
    ) -> None:
        """Layers ``lo..hi`` of the round's chunks ``c0..c1`` (``n_tok`` tokens from the round's token ``t0``,
        in ``slot``) into the target's rows (raises ``KVWriteError``)."""
        rows = target.rows[r.token_lo + t0 : r.token_lo + t0 + n_tok]
        if r.handle.codes:
            for layer in range(lo, hi):
                target.writer.write_quantized(self._code_views(slot, r, layer, c0, c1), rows, layer)
            return
        k, v = self.round_view(slot, r)
        target.writer.write(k[lo:hi, t0 : t0 + n_tok], v[lo:hi, t0 : t0 + n_tok], rows, lo)

    def _code_views(self, slot: int, r: HostRound, layer: int, c0: int, c1: int) -> list:
        """The codec's views of ``layer`` of the round's chunks ``c0..c1``, read in place from the region
        (``KVWriteError`` if the data plane's output does not parse)."""
        tokens = r.handle.chunk_tokens[r.chunk_lo : r.chunk_hi]
        views, t = [], sum(tokens[:c0])
        for c in range(c0, c1):
            off, area = self._codes_area(slot, t, tokens[c])
            at, n = off + layer * area, r.code_lengths[c][layer]
            if not 0 < n <= area:
                raise KVWriteError(
                    f"chunk {r.chunk_lo + c} layer {layer}: {n} bytes of codes in a {area}-byte area"
                )
            try:
                views.append(
                    self.codec.view(ChunkShape(self.layout, tokens[c]), layer, self.dest.array[at : at + n])
                )
            except ChunkError as e:  # the data plane's output does not parse: the round is a miss
                raise KVWriteError(f"chunk {r.chunk_lo + c} layer {layer}: {e}") from e
            t += tokens[c]
        return views

    def _codes_area(self, slot: int, t: int, tokens: int) -> tuple[int, int]:
        """(offset, bytes per layer) of the codes of a chunk of ``tokens`` tokens that starts ``t`` tokens into
        a round in ``slot``: chunk after chunk, ``L`` areas of the layer's K + V bytes each."""
        lay = self.layout
        return slot * self.slot_bytes + 2 * lay.num_layers * layer_bytes(lay, t), 2 * layer_bytes(lay, tokens)

    def close(self) -> None:
        self.dest = None
