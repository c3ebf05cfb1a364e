"""Sizes both sides of the data plane agree on: a chunk's bytes in the DMA-source and inflate regions, and
the split of a job's chunks into rounds that each fit one slot (ShadowServe's occupancy planning). Computed
from token counts and the model's dimensions only; the host plans its rounds with the same functions the
data plane uses (``dpu/buffers.py`` allocates the regions they size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

DEST_SLOT_BYTES = (
    64 << 20
)  # the host's destination region: bytes per round slot (``DpuClientConfig``'s default)


class KVLayout(Protocol):
    """The model dimensions sizing reads (``types.KVLayout`` has them; the contract imports nothing of ours)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int


def layer_bytes(layout: KVLayout, tokens: int) -> int:
    """Bytes of K (or V) of one layer of ``tokens`` tokens."""
    return tokens * layout.num_kv_heads * layout.head_dim * layout.itemsize


def chunk_bytes(layout: KVLayout, tokens: int) -> int:
    """Decoded K+V bytes of a chunk of ``tokens`` tokens over all layers."""
    return 2 * layout.num_layers * layer_bytes(layout, tokens)


def inflate_layer_cap(layout: KVLayout, tokens: int, inflate_ratio: float) -> int:
    """Bytes of a chunk-layer's share of the inflate region."""
    return math.ceil(2 * layer_bytes(layout, tokens) * inflate_ratio)


@dataclass(frozen=True)
class ChunkRegion:
    """Occupancy of one chunk inside its round slot (offsets relative to the slot)."""

    index: int  # chunk index within the job
    tokens: int
    src_off: int  # DMA-source region: K [L, T, H, D] then V [L, T, H, D]
    infl_off: int  # inflate region: num_layers consecutive pieces of ``infl_layer`` bytes
    infl_layer: int


def plan_rounds(
    tokens: list[int], layout: KVLayout, slot_bytes: int, inflate_ratio: float
) -> list[list[ChunkRegion]]:
    """Split a job's chunks (in prefix order) into rounds that each fit one slot.

    Raises ``ValueError`` if a single chunk does not fit a slot (the caller reports ``bad_request``).
    """
    infl_slot = math.ceil(slot_bytes * inflate_ratio)
    rounds: list[list[ChunkRegion]] = []
    cur: list[ChunkRegion] = []
    src = infl = 0
    for i, t in enumerate(tokens):
        need_src = chunk_bytes(layout, t)
        per_layer = inflate_layer_cap(layout, t, inflate_ratio)
        need_infl = per_layer * layout.num_layers
        if need_src > slot_bytes or need_infl > infl_slot:
            raise ValueError(f"chunk {i} ({t} tokens, {need_src} B) does not fit a {slot_bytes} B slot")
        if src + need_src > slot_bytes or infl + need_infl > infl_slot:
            rounds.append(cur)
            cur, src, infl = [], 0, 0
        cur.append(ChunkRegion(i, t, src, infl, per_layer))
        src += need_src
        infl += need_infl
    if cur:
        rounds.append(cur)
    return rounds
