"""The data plane's records: pipeline settings, per-job and per-chunk state, stage statistics, and the
table of admitted rounds (which chunks of a round are through fetch, which slot it holds).

Threads: ``JobState`` is created by the server thread and mutated by pipeline workers under its
``lock``; a ``ChunkTask`` under its job's ``lock``; ``RoundTable`` is thread-safe (its own lock). Nothing
here owns a buffer: a chunk's staging regions belong to the worker holding one of its slabs
(``pipeline.py``), its blob (``bytes`` from the store client, or the array a streamed blob is received
into) to the task until the chunk is terminal.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sgl_remote_kv.contract.messages import BlobRef, ChunkDest, ChunksVerified, LayerDone
from sgl_remote_kv.contract.sizing import ChunkRegion
from sgl_remote_kv.types import numpy_storage_dtype


class JobState:
    """A submitted job as the pipeline sees it. Created by the server thread; counters under ``lock``."""

    def __init__(
        self,
        job: int,
        peer: bytes,
        codec,
        fingerprint,
        layout,
        dests: list[ChunkDest],
        blob_area: tuple[int, int] = (0, 0),
        dest=None,
        request_id: str = "",
        lead: JobState | None = None,
        codes: bool = False,
    ) -> None:
        self.job, self.peer, self.codec, self.fingerprint = job, peer, codec, fingerprint
        # the client's request; ``lead``: the request's first job still active when this one arrived
        # (None: this one); ``first_round``: the id of this job's first admitted round (``slab_key``)
        self.request_id, self.lead, self.first_round = request_id, lead, -1
        self.dest = dest  # uint8 view of the destination region of the job's client (host-owned shm)
        # True: the inflate stage writes each layer's lossless output straight into ``dest`` (output
        # ``codes``; no dequant, no DMA); False: decoded KV through all four stages
        self.codes = codes
        self.layout = layout
        self.dtype = numpy_storage_dtype(layout.dtype)
        self.dests = dests
        self.cancel_from = len(dests)  # chunks with index >= cancel_from are cancelled
        self.lock = threading.Lock()
        self.terminal = self.done = self.failed = 0
        # fetch-stage outcome per chunk (ChunksVerified), and the host-visible blob area (offset, cap)
        self.fetched = 0
        self.parsed = [False] * len(dests)
        self.blob_off, self.blob_cap = blob_area
        self.blob_used = 0
        self.blob_refs: list[BlobRef | None] = [None] * len(dests)

    def verified_message(self) -> ChunksVerified:
        """``ChunksVerified`` for the current state (call once ``fetched == len(dests)``)."""
        with self.lock:
            ok = 0
            while ok < min(self.cancel_from, len(self.dests)) and self.parsed[ok]:
                ok += 1
            refs = self.blob_refs[:ok]
        blobs = list(refs) if self.blob_cap and all(r is not None for r in refs) else []
        return ChunksVerified(self.job, ok, blobs)

    def cancel(self, from_chunk: int) -> None:
        with self.lock:
            self.cancel_from = min(self.cancel_from, from_chunk)


@dataclass
class ChunkTask:
    """One admitted chunk: its job, slot, regions and progress. Mutated under ``JobState.lock``."""

    job: JobState
    region: ChunkRegion
    slot: int
    round_id: int
    blob: bytes | np.ndarray | None = None  # the whole blob, or the buffer a streamed one arrives in
    header: object = None
    decoded: list[int] = field(default_factory=list)  # per layer: bytes the lossless stage wrote
    # holders not yet finished: the fetch stage (``fetch_held``) and each slab queued so far; the chunk is
    # terminal when it drops to 0
    pending: int = 1
    fetch_held: bool = True
    failed: bool = False
    own: tuple | None = None  # (src, inflate) arrays allocated per chunk (no-prealloc ablation only)
    wire_bytes: int = 0
    fetch_reported: bool = False  # ``_fetched`` ran for this chunk
    # False while a streamed blob's store frame is unverified: its DMA'd slabs' ``LayerDone`` wait in
    # ``held`` until it passed, and are dropped if it fails
    verified: bool = True
    held: list[LayerDone] = field(default_factory=list)


@dataclass
class StageStats:
    items: int = 0
    bytes: int = 0  # decoded-KV bytes the stage produced (fetch: compressed bytes received)
    busy_s: float = 0.0  # wall time inside the stage's work (includes waiting for a core or the GIL)
    cpu_s: float = 0.0  # thread CPU time inside the stage's work
    errors: int = 0
    streamed: int = 0  # (fetch) chunks received in pieces, decoding as they arrived


class RoundTable:
    """Admitted rounds: per round id, the chunks not yet terminal, its slot, the chunks not yet through
    the fetch stage and the parsed ones. ``add`` runs on the server thread, the rest on workers."""

    def __init__(self) -> None:
        self._rounds: dict[int, list] = {}
        self._lock = threading.Lock()
        self._next = 0

    def add(self, chunks: int, slot: int) -> int:
        """Register a round of ``chunks`` chunks in ``slot``; its id."""
        with self._lock:
            rid = self._next
            self._next += 1
            self._rounds[rid] = [chunks, slot, chunks, []]
        return rid

    def fetched(self, task: ChunkTask, ok: bool) -> list[ChunkTask]:
        """``task`` left the fetch stage (``ok``: parsed). When it was the round's last chunk to do so,
        the round's parsed chunks in chunk order (their slabs may start); else ``[]``."""
        with self._lock:
            entry = self._rounds[task.round_id]
            entry[2] -= 1
            if ok:
                entry[3].append(task)
            return sorted(entry[3], key=lambda t: t.region.index) if entry[2] == 0 else []

    def chunk_terminal(self, rid: int) -> int | None:
        """A chunk of round ``rid`` is terminal; the round's slot when it was the last one (round over)."""
        with self._lock:
            entry = self._rounds[rid]
            entry[0] -= 1
            if entry[0] > 0:
                return None
            del self._rounds[rid]
        return entry[1]


def layer_major(ready: list[ChunkTask], num_layers: int, group: int):
    """The slabs ``(task, lo, hi)`` of a round's parsed chunks, layer-major: layer group 0 of every
    chunk first, then group 1, ... (with one worker per stage, layers then complete in order)."""
    g = max(1, group)
    for lo in range(0, num_layers, g):
        for t in ready:
            yield t, lo, min(num_layers, lo + g)


def slab_key(task: ChunkTask, lo: int) -> tuple[int, int, int, int]:
    """Priority of slab ``(task, lo, ..)`` at every stage after fetch, lowest first: rounds in the order
    they were admitted (which is per-client fair, ``FairQueue``), lowest layer group first within a
    round, then chunk order. A layer-wise consumer's job (one with a blob area) instead takes the place
    of its request's first round and goes layer group by layer group across *all* the request's jobs and
    chunks: its forward pass needs layer l of every chunk before layer l + 1 of any, and a request cut
    into two jobs must not finish the first before the second's layer 0 (a real server test caught it)."""
    job = task.job
    if job.blob_cap:
        lead = (
            job.lead if job.lead is not None and job.lead.first_round >= 0 else job
        )  # (lead: not cancelled)
        return (lead.first_round, lo, task.round_id, task.region.index)
    return (task.round_id, lo, task.round_id, task.region.index)


class SlabQueue(queue.PriorityQueue):
    """The input of every stage after fetch: slabs ``(task, lo, hi)`` handed out by ``slab_key``. A
    chunk's slabs are queued as soon as it was fetched, so decoding overlaps the later fetches, and the
    order holds behind a slow stage's backlog too. ``None`` (stop a worker) sorts last."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self._seq = itertools.count()

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        key = (math.inf,) if item is None else slab_key(item[0], item[1])
        super().put((key, next(self._seq), item), block, timeout)

    def get(self, block: bool = True, timeout: float | None = None):
        return super().get(block, timeout)[2]


class FairQueue:
    """Rounds waiting for a staging slot, one FIFO per client, handed out round-robin across clients:
    one client's job of many rounds delays another client's next round by at most one round per other
    client with work queued (per-client fairness of admission). Server thread only."""

    def __init__(self) -> None:
        self._queues: OrderedDict[bytes, deque] = OrderedDict()  # client -> its rounds; order = turn

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def append(self, client: bytes, item) -> None:
        self._queues.setdefault(client, deque()).append(item)

    def popleft(self):
        """The next round: the head of the client whose turn it is (that client then goes last)."""
        client, q = next(iter(self._queues.items()))
        item = q.popleft()
        del self._queues[client]
        if q:
            self._queues[client] = q  # to the back of the turn order
        return item

    def filter(self, client: bytes, keep: Callable[[object], object]) -> None:
        """Replace each of ``client``'s rounds by ``keep(round)`` (a falsy result drops it)."""
        q = self._queues.get(client)
        if q is None:
            return
        out = deque(x for x in map(keep, q) if x)
        if out:
            self._queues[client] = out
        else:
            del self._queues[client]

    def pop_client(self, client: bytes) -> list:
        """Remove and return every round of ``client``."""
        return list(self._queues.pop(client, ()))
