"""The pipeline's first stage: a chunk's value from the store, checked, cut into slabs (``pipeline.py``).

Where the store streams (``StoreClient.stream_get``, ``stream_piece`` > 0, not the round-barrier ablation)
the value is received in pieces (``receive.ChunkReceiver``) and each slab is queued once its sections are
in and their CRCs passed; its ``LayerDone`` waits (``ChunkTask.verified``/``held``, released here) until
the whole value's store frame verified, and a frame that fails drops them and fails the chunk. Otherwise
the whole value is fetched and parsed (every section CRC) and all its slabs are queued at once. Both end
with the chunk's ``fetched`` report and the release of the fetch's hold on it (``ChunkTask.pending``).
Admission into the store goes through the ``FetchGate``.

Failures: no value is ``miss`` (absent), ``corrupt`` (the store framing failed; the client deleted it) or
``store_error`` with the client's kind; a bad header or section raises ``ChunkError`` to the worker
boundary (``Pipeline``), which fails the chunk.

Threads: ``run`` is called by the fetch workers, one chunk each. Buffers: the blob, or a streamed value's
receive buffer, belongs to the chunk's task from here on (``tasks.py``).
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.contract.messages import BlobRef, Message
from sgl_remote_kv.contract.settings import PipelineConfig
from sgl_remote_kv.contract.sizing import layer_bytes
from sgl_remote_kv.store import corruption
from sgl_remote_kv.store.streaming import StreamOutcome

from .fetch_gate import FetchGate
from .receive import ChunkReceiver
from .tasks import ChunkTask, JobState


class ChunkBook(Protocol):
    """What the fetch stage needs of the pipeline: the chunk and job bookkeeping (``Pipeline``)."""

    def emit(self, peer: bytes, msg: Message) -> None: ...
    def fail(self, task: ChunkTask, kind: str, detail: str, store_error: str = "") -> None: ...
    def skip(self, task: ChunkTask) -> bool: ...
    def fetched(self, task: ChunkTask, ok: bool, streamed: bool = False) -> None: ...
    def release_fetch(self, task: ChunkTask) -> None: ...
    def copy_blob(self, job: JobState, blob) -> BlobRef | None: ...
    def forward(self, stage: str, item) -> None: ...
    def count_streamed(self) -> None: ...


class FetchStage:
    def __init__(self, cfg: PipelineConfig, store, book: ChunkBook) -> None:
        self.cfg, self.store, self.book = cfg, store, book
        self.gate = FetchGate(cfg.fetch_workers, adaptive=cfg.adaptive_fetch)
        # The store client's error kind of this thread's last failed get (its listener runs on the
        # calling thread): tells a store failure or a value failing the store framing from a miss.
        self._store_err = threading.local()
        if hasattr(store, "on_error"):
            store.on_error = self._on_store_error

    def _on_store_error(self, op: str, kind: str, n: int = 1) -> None:
        """The store client's error listener (runs on the calling worker thread; never raises)."""
        if op == "get":
            self._store_err.kind = kind

    def run(self, task: ChunkTask) -> int:
        """The stage's work on one chunk (a fetch worker); the bytes received."""
        if self.book.skip(task):
            self.book.fetched(task, False)
            self.book.release_fetch(task)
            return 0
        job = task.job
        key = job.dests[task.region.index].key
        stream = None
        if self.cfg.stream_piece and not self.cfg.round_barrier:  # (None: the client cannot stream it)
            stream = self.store.stream_get(key, self._max_blob(task), self.cfg.stream_piece)
        if stream is not None:
            return self._fetch_streamed(task, stream)
        self._store_err.kind = ""
        with self.gate.slot() as admitted:
            blob = self.store.get_many([key])[0]
            admitted.nbytes = len(blob) if blob is not None else 0
        if blob is None:
            self.book.fail(task, *_miss_kind(self._store_err.kind, key))
            self.book.fetched(task, False)
            self.book.release_fetch(task)
            return 0
        self._open_chunk(task, blob, job.codec.parse(blob, job.fingerprint))
        ref = self.book.copy_blob(job, blob)
        with job.lock:
            task.pending += -(-job.layout.num_layers // max(1, self.cfg.layer_group))
            task.wire_bytes = len(blob)
            job.blob_refs[task.region.index] = ref
        self.book.fetched(task, True)
        self.book.release_fetch(task)
        return len(blob)

    def _max_blob(self, task: ChunkTask) -> int:
        """The longest blob accepted for a chunk: twice its decoded size plus 1 MiB (no codec comes near)."""
        lay = task.job.layout
        return 4 * lay.num_layers * layer_bytes(lay, task.region.tokens) + (1 << 20)

    def _open_chunk(self, task: ChunkTask, blob, hdr):
        """Check a parsed header against the chunk's region; attach blob and header to the task."""
        job = task.job
        if hdr.num_tokens != task.region.tokens:
            raise CorruptChunk(f"chunk holds {hdr.num_tokens} tokens, expected {task.region.tokens}")
        for layer in range(job.layout.num_layers):
            if job.codec.scratch_bytes(hdr, layer) > task.region.infl_layer:
                raise CorruptChunk("lossless output larger than the inflate occupancy")
        own = None
        if not self.cfg.prealloc:
            lay, r = job.layout, task.region
            own = (
                np.empty(2 * lay.num_layers * layer_bytes(lay, r.tokens), np.uint8),
                np.empty(lay.num_layers * r.infl_layer, np.uint8),
            )
        with job.lock:
            task.blob, task.header, task.own = blob, hdr, own
            task.decoded = [0] * job.layout.num_layers
        return hdr

    def _fetch_streamed(self, task: ChunkTask, stream) -> int:
        """Receive a chunk in pieces (``receive.ChunkReceiver``); queue each layer group once its sections
        are in and verified; hold the slabs' ``LayerDone`` until the store frame verified (``verified``)."""
        job = task.job
        with job.lock:
            task.verified = False
        rx = None
        pieces = stream.pieces()
        try:
            with self.gate.slot() as admitted:
                for piece in pieces:
                    if rx is None:  # the frame's length, bounded by max_bytes
                        rx = ChunkReceiver(
                            stream.payload_len,
                            job.layout.num_layers,
                            self.cfg.layer_group,
                            lambda head, buf: self._open_chunk(
                                task, buf, job.codec.parse(head, job.fingerprint, complete=False)
                            ),
                        )
                    for lo, hi in rx.add(piece):
                        with job.lock:
                            task.pending += 1
                        self.book.forward("inflate", (task, lo, hi))
                    if self.book.skip(task):
                        break
                admitted.nbytes = rx.filled if rx is not None and stream.outcome is StreamOutcome.OK else 0
        finally:
            pieces.close()
        if stream.outcome is not StreamOutcome.OK:
            if stream.outcome is not StreamOutcome.ABORTED:  # (aborted: this chunk failed or was cancelled)
                self.book.fail(task, *_miss_kind(_stream_kind(stream), job.dests[task.region.index].key))
            self.book.fetched(task, False)
            self.book.release_fetch(task)
            return 0
        if rx is None or not rx.complete:
            raise CorruptChunk("the store value ends before its chunk header")
        ref = self.book.copy_blob(job, rx.buf)
        self.book.count_streamed()
        with job.lock:
            task.wire_bytes = rx.filled
            job.blob_refs[task.region.index] = ref
            task.verified = True
            held, task.held = task.held, []
        for done in held:
            self.book.emit(job.peer, done)
        self.book.fetched(task, True, streamed=True)
        self.book.release_fetch(task)
        return rx.filled


def _stream_kind(stream) -> str:
    """The store client's error kind of a streamed get that ended without a value ("" when absent)."""
    if stream.outcome is StreamOutcome.ABSENT:
        return ""
    return "corrupt" if stream.outcome is StreamOutcome.CORRUPT else stream.error or "error"


def _miss_kind(store_kind: str, key: bytes) -> tuple[str, str, str]:
    """``ChunkFailed`` (kind, detail, store_error) of a chunk the store client returned no value for:
    absent (``miss``), a value failing the store framing (``corrupt``; the client logged and deleted it),
    or a failed store call (``store_error``). The store kind is cut to the protocol's 64 safe characters."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "_:.-") else "_" for c in store_kind)[:64]
    if not safe:
        return "miss", "", ""
    if safe == "corrupt":
        return "corrupt", corruption.detail(key, "the store frame or MAC failed (deleted)"), safe
    return "store_error", f"store client: {safe}", safe
