"""Pre-allocated data-plane buffers, per-round occupancy planning, and the shared destination region.

Memory model (ShadowServe §4.3, in software):

- ``StagingBuffers`` is allocated **once** when the data plane starts and pre-faulted; nothing on the
  hot path allocates a buffer. It holds ``slots`` equal round slots, each with
  a *DMA-source* region of ``slot_bytes`` (decoded K+V in the KV dtype) and an *inflate* region of
  ``ceil(slot_bytes * inflate_ratio)`` (lossless-stage output; 1.0 fits every codec, 0.5 fits codecs
  whose lossless output is int8 of a 16-bit KV, as in the paper). Total = ``slots * slot_bytes *
  (1 + inflate_ratio)``, fixed for the life of the process.
- A round is a set of consecutive chunks of one job that fits one slot. ``plan_rounds``
  (``contract/sizing.py``, which the host uses too) computes every
  chunk's occupancy from its token count and the model dimensions only (no store round-trip), before
  the round starts; a job larger than a slot runs as several rounds.
- Compressed blobs come from the store client as ``bytes`` it allocates (the Python store clients give
  no receive-into-buffer API); their number in flight is bounded by the slots (one blob per admitted
  chunk, dropped when the chunk leaves the inflate stage).
- ``DestRegion`` is the DMA destination: shared memory created and owned by the host's DPU client
  (``fetch/dpu_client/host_region.py``), mapped here by name or by an inherited descriptor. The host pins it for
  its device writes.

Ownership: the server thread owns slot assignment; a chunk's regions belong to the worker currently
processing that chunk's slab, handed over through the stage queues. Threads never share a region.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import numpy as np

from sgl_remote_kv.contract.sizing import ChunkRegion, layer_bytes
from sgl_remote_kv.types import KVLayout

logger = logging.getLogger(__name__)


class StagingBuffers:
    """The data plane's private buffers, allocated and pre-faulted once (see module docstring)."""

    def __init__(self, slots: int, slot_bytes: int, inflate_ratio: float) -> None:
        if slots < 1 or slot_bytes < 1 or not 0 < inflate_ratio <= 4:
            raise ValueError("slots, slot_bytes must be positive and inflate_ratio in (0, 4]")
        self.slots, self.slot_bytes, self.inflate_ratio = slots, slot_bytes, inflate_ratio
        self.infl_slot_bytes = math.ceil(slot_bytes * inflate_ratio)
        self.dma_src = np.empty(slots * slot_bytes, np.uint8)
        self.inflate = np.empty(slots * self.infl_slot_bytes, np.uint8)
        self.dma_src.fill(0)  # pre-fault every page now, not on the hot path
        self.inflate.fill(0)
        logger.debug(
            "staging buffers: %d slots x (%d + %d) B = %.1f MiB",
            slots,
            slot_bytes,
            self.infl_slot_bytes,
            self.total_bytes / 2**20,
        )

    @property
    def total_bytes(self) -> int:
        return self.dma_src.nbytes + self.inflate.nbytes

    def src_chunk(self, slot: int, region: ChunkRegion, layout: KVLayout, dtype: np.dtype):
        """(K, V) views ``[L, T, H, D]`` of a chunk's DMA-source region (no copy)."""
        n = layer_bytes(layout, region.tokens) * layout.num_layers
        base = slot * self.slot_bytes + region.src_off
        shape = (layout.num_layers, region.tokens, layout.num_kv_heads, layout.head_dim)
        k = self.dma_src[base : base + n].view(dtype).reshape(shape)
        v = self.dma_src[base + n : base + 2 * n].view(dtype).reshape(shape)
        return k, v

    def infl_layer(self, slot: int, region: ChunkRegion, layer: int) -> np.ndarray:
        """The uint8 inflate piece of one chunk-layer (no copy)."""
        base = slot * self.infl_slot_bytes + region.infl_off + layer * region.infl_layer
        return self.inflate[base : base + region.infl_layer]


class DestRegion:
    """A host's destination region mapped here; the host creates and owns it (``fetch/dpu_client/host_region.py``).

    ``attach``: a region a host named under /dev/shm (a client of a shared service); ``inherited``: the
    anonymous region of the host that spawned this process, by the descriptor it passed down (no name in
    any file system). ``array`` is a uint8 view over the whole region. Mapped with plain ``open``/``mmap``:
    Python's resource tracker never hears of it (it would unlink the host's region at our exit).
    """

    def __init__(self, name: str, fd: int, path: str = "") -> None:
        self.name, self._path = name, path
        self.size = os.fstat(fd).st_size
        self._mmap = mmap.mmap(fd, self.size)  # the mapping keeps its own reference to the memory
        self.array = np.ndarray((self.size,), np.uint8, buffer=self._mmap)

    @classmethod
    def attach(cls, name: str) -> DestRegion:
        """Map the region ``/dev/shm/<name>`` (``FileNotFoundError`` when there is no such name)."""
        path = "/dev/shm/" + name.lstrip("/")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return cls(name, fd, path)
        finally:
            os.close(fd)

    @classmethod
    def inherited(cls, name: str, fd: int) -> DestRegion:
        """Map the region behind ``fd`` (kept open: a later registration maps it again)."""
        return cls(name, fd)

    def exists(self) -> bool:
        """The region has a name that is still linked (an inherited one never has)."""
        return bool(self._path) and os.path.exists(self._path)

    def unlink(self) -> None:
        """Remove the region's name (existing mappings stay valid); a no-op if it has none."""
        if self._path:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def try_close(self) -> bool:
        """Unmap; False while other views of ``array`` are alive (the mapping stays; call again later)."""
        self.array = None  # drop the exported buffer before closing the mapping
        try:
            self._mmap.close()
        except BufferError:
            return False
        return True

    def close(self) -> None:
        if not self.try_close():
            logger.warning("dest region %s still has views; leaving it mapped", self.name)
