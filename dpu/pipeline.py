"""The four-stage chunked pipeline: fetch -> inflate -> dequantize -> "DMA" (ShadowServe §4.2).

Each stage has its own worker threads (counts from ``PipelineConfig``) and a bounded input queue.
A chunk is split into *slabs* of ``layer_group`` consecutive layers that flow through the other three
stages independently, so inflate, dequantization and the copy of different chunks and layers overlap.
The fetch stage (``fetch_stage.py``) queues a streamed chunk's slabs as their bytes arrive, a whole
value's after parsing it; it calls back into this module's chunk bookkeeping (``fetch_stage.ChunkBook``:
``fail``, ``skip``, ``fetched``, ``release_fetch``, ``copy_blob``, ``forward``). The DMA stage emits a
``LayerDone`` per slab as soon as its layers sit in the destination region -- for a streamed chunk only
once the whole value's store frame verified (until then they wait in ``ChunkTask.held``; a frame that
fails drops them and fails the chunk, so the host never uses a layer of a misplaced or changed value).
A chunk is held by the fetch and by each slab queued so far (``ChunkTask.pending``); it is terminal at 0.
A job with output ``codes`` (``JobState.codes``) stops after inflate: its inflate worker writes each
layer's lossless output straight into the destination and reports the slab (``LayerDone.lengths``); the
dequant and DMA stages and the staging buffers are not used (the round still holds its staging slot).

Order: a chunk's slabs are queued as soon as their bytes are in and checked; every stage after fetch takes
its input from a priority queue (``SlabQueue``, order ``tasks.slab_key``): rounds in admission order,
lowest layer group first within a round; a layer-wise consumer's request at the place of its first
round, lowest layer group first across all its jobs and chunks. So decoding overlaps the later fetches
(only the last chunk's decode follows the last byte), and with one worker per stage layers complete in
order, also behind a slow stage's backlog: the host can start attention on layer 0 while later layers
decode. The ablation ``round_barrier`` keeps the previous order (a round's slabs only after its last
fetch).

When every chunk of a *job* was fetched, the pipeline emits ``ChunksVerified`` (leading intact chunks;
with ``blob_cap`` the blobs were copied into the host-visible blob area first, so the host can decode
them itself if this process dies afterwards). A chunk after a miss may be decoded before the miss is
known (wasted work; the host uses only the prefix before the first failure).

Threads: ``submit_round`` is called by the server thread; everything else runs in worker threads.
The ``emit`` callback must be thread-safe (the server gives one that pushes to an inproc socket).
Buffers: a chunk's staging regions belong to the worker holding one of its slabs; the destination
bytes of a chunk (in ``JobState.dest``, the region of the job's client) are written only by the DMA
worker holding its slab (and its blob, by the fetch worker, into the job's blob area). The server
releases a client's regions only after every job of that client reported ``JobDone``. Blobs (``bytes`` from the store
client) are owned by the chunk task and dropped when the chunk is terminal.

Failures: a ``ChunkError`` fails the chunk (kind ``corrupt``/``foreign``) and cancels every later chunk
of the job (a prefix cache cannot use KV after a hole); damaged bytes (``CORRUPTION``: a codec CRC) are
logged here (``store/corruption.py``, rate-limited) and reported with ``store_error="corrupt"``, so the
host counts them as ``store_errors_total{op="get",kind="corrupt"}``; an unexpected exception is caught at the
worker boundary, counted, logged and reported as kind ``internal``. A chunk the store client returned
no value for: ``fetch_stage.py``.

The job/chunk records and the round table live in ``tasks.py``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from sgl_remote_kv.codec.errors import CORRUPTION, ChunkError, ForeignChunk
from sgl_remote_kv.codec.format import layer_section
from sgl_remote_kv.contract.messages import BlobRef, ChunkDone, ChunkFailed, JobDone, LayerDone, Message
from sgl_remote_kv.contract.settings import STAGES, PipelineConfig
from sgl_remote_kv.contract.sizing import ChunkRegion, layer_bytes
from sgl_remote_kv.store import corruption

from .buffers import StagingBuffers
from .fetch_stage import FetchStage
from .tasks import ChunkTask, JobState, RoundTable, SlabQueue, StageStats, layer_major

logger = logging.getLogger(__name__)


class Pipeline:
    """Worker threads + queues. ``on_round_free(slot)`` is called (from a worker) when a round's
    chunks are all terminal and its slot may be reused."""

    def __init__(
        self,
        cfg: PipelineConfig,
        buffers: StagingBuffers,
        store,
        emit: Callable[[bytes, Message], None],
        on_round_free: Callable[[int], None],
    ) -> None:
        self.cfg, self.buf, self.store = cfg, buffers, store
        self.emit, self.on_round_free = emit, on_round_free
        # fetch is bounded by admission (slots x chunks per round); the others by queue_depth
        self.queues = {s: queue.Queue() if s == "fetch" else SlabQueue(cfg.queue_depth) for s in STAGES}
        self.stats = {s: StageStats() for s in STAGES}
        self._stats_lock = threading.Lock()
        self._rounds = RoundTable()
        self.fetch = FetchStage(cfg, store, self)
        self.gate = self.fetch.gate
        self._threads: list[threading.Thread] = []
        counts = (cfg.fetch_workers, cfg.inflate_workers, cfg.dequant_workers, cfg.dma_workers)
        work = (self.fetch.run, self._inflate, self._dequant, self._dma)
        for si, (stage, n, fn) in enumerate(zip(STAGES, counts, work, strict=True)):
            cpus = cfg.stage_cpus[si] if si < len(cfg.stage_cpus) else ()
            for w in range(n):
                t = threading.Thread(
                    target=self._worker, args=(stage, fn, cpus), name=f"dpu-{stage}-{w}", daemon=True
                )
                t.start()
                self._threads.append(t)

    # ---- server-thread API ----------------------------------------------------------------------
    def submit_round(self, job: JobState, regions: list[ChunkRegion], slot: int) -> None:
        """Admit one round (all fits ``slot``). Blocks only if the fetch queue is full."""
        rid = self._rounds.add(len(regions), slot)
        if job.first_round < 0:
            job.first_round = rid
        for r in regions:
            self.queues["fetch"].put(ChunkTask(job, r, slot, rid))

    def close(self) -> None:
        """Stop all workers (in-flight items are finished or dropped); called by the server thread."""
        for stage, n in zip(STAGES, self._counts(), strict=True):
            for _ in range(n):
                self.queues[stage].put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _counts(self) -> tuple[int, int, int, int]:
        c = self.cfg
        return (c.fetch_workers, c.inflate_workers, c.dequant_workers, c.dma_workers)

    def stats_snapshot(self) -> dict:
        with self._stats_lock:
            return {s: vars(st).copy() for s, st in self.stats.items()}

    # ---- worker plumbing ------------------------------------------------------------------------
    def _worker(self, stage: str, fn: Callable, cpus: tuple[int, ...]) -> None:
        if cpus:
            try:
                os.sched_setaffinity(threading.get_native_id(), cpus)
            except OSError as e:
                logger.warning("cannot pin %s to %s: %s", threading.current_thread().name, cpus, e)
        q = self.queues[stage]
        while True:
            item = q.get()
            if item is None:
                return
            task = item[0] if isinstance(item, tuple) else item
            t0, c0 = time.perf_counter(), time.thread_time()
            nbytes = 0
            try:
                nbytes = fn(item)
            except Exception as e:  # thread boundary: count, log, report, keep the worker alive
                self._failed_item(task, stage, e)
            with self._stats_lock:
                st = self.stats[stage]
                st.items += 1
                st.bytes += nbytes or 0
                st.busy_s += time.perf_counter() - t0
                st.cpu_s += time.thread_time() - c0
            item = task = None  # hold no job (nor its client's region) while waiting for the next item

    def _failed_item(self, task: ChunkTask, stage: str, e: Exception) -> None:
        """An item of ``stage`` raised: fail its chunk (``ChunkError``: corrupt/foreign; anything else is
        an internal error, counted and logged) and finish the item."""
        if isinstance(e, CORRUPTION):  # damaged stored bytes: logged here, counted by the host (store_error)
            key = task.job.dests[task.region.index].key
            corruption.note(key, f"data plane {stage} stage", str(e))
            self.fail(task, "corrupt", corruption.detail(key, str(e)), store_error="corrupt")
        elif isinstance(e, ChunkError):
            self.fail(task, "foreign" if isinstance(e, ForeignChunk) else "corrupt", str(e))
        else:
            logger.error("%s failed on job %d chunk %d", stage, task.job.job, task.region.index, exc_info=e)
            with self._stats_lock:
                self.stats[stage].errors += 1
            self.fail(task, "internal", f"{type(e).__name__}: {e}")
        if stage != "fetch":
            self._slab_finished(task)
            return
        if not task.fetch_reported:
            self.fetched(task, False)
        self.release_fetch(task)  # slabs already queued skip the failed chunk and finish it

    def fetched(self, task: ChunkTask, ok: bool, streamed: bool = False) -> None:
        """A chunk left the fetch stage (``ok``: parsed, slabs pending). Emits ``ChunksVerified`` when it
        was the job's last chunk to do so; queues its slabs unless ``streamed`` (queued as they arrived;
        ``round_barrier``: the round's, layer-major, when it was the round's last).
        Must run before the fetch's ``_release_fetch`` (which may end the job and free the round)."""
        job = task.job
        with job.lock:
            task.fetch_reported = True
            job.parsed[task.region.index] = ok
            job.fetched += 1
            job_fetched = job.fetched == len(job.dests)
        if job_fetched:
            self.emit(job.peer, job.verified_message())
        ready = self._rounds.fetched(task, ok)
        if not self.cfg.round_barrier:  # this chunk's slabs start now (the queue orders them)
            ready = [task] if ok and not streamed else []
        for slab in layer_major(ready, job.layout.num_layers, self.cfg.layer_group):
            self.forward("inflate", slab)

    def copy_blob(self, job: JobState, blob: bytes) -> BlobRef | None:
        """Copy a verified blob into the job's host-visible blob area; ``None`` if none or full."""
        with job.lock:
            off = job.blob_used
            if not job.blob_cap or off + len(blob) > job.blob_cap:
                return None
            job.blob_used += len(blob)
        at = job.blob_off + off
        job.dest[at : at + len(blob)] = np.frombuffer(blob, np.uint8)
        return BlobRef(at, len(blob))

    def skip(self, task: ChunkTask) -> bool:
        """True if this chunk is failed or cancelled (reporting the cancellation once)."""
        job = task.job
        with job.lock:
            if task.failed:
                return True
            cancelled = task.region.index >= job.cancel_from
        if cancelled:
            self.fail(task, "cancelled", "")
        return cancelled

    def fail(self, task: ChunkTask, kind: str, detail: str, store_error: str = "") -> None:
        job = task.job
        with job.lock:
            if task.failed:
                return
            task.failed = True
            if kind != "cancelled":
                job.cancel_from = min(job.cancel_from, task.region.index + 1)
            # under the lock, like ChunkDone: before any thread can end the job and send JobDone
            self.emit(job.peer, ChunkFailed(job.job, task.region.index, kind, detail[:500], store_error))

    def release_fetch(self, task: ChunkTask) -> None:
        """The fetch stage is done with the chunk (its slabs, if any, hold it on)."""
        with task.job.lock:
            if not task.fetch_held:
                return
            task.fetch_held = False
        self._slab_finished(task)

    def _slab_finished(self, task: ChunkTask) -> None:
        """One holder of the chunk (a slab, or the fetch: ``_release_fetch``) is done with it."""
        job = task.job
        with job.lock:
            task.pending -= 1
            if task.pending > 0:
                return
            task.blob = task.header = task.own = None
            task.held = []
            job.terminal += 1
            if task.failed:
                job.failed += 1
            else:
                job.done += 1
            job_over = job.terminal == len(job.dests)
            # A chunk's outcome is emitted under the job's lock (here and in ``_fail``), so it reaches the
            # host before the JobDone another thread may send once it sees the job over (the host takes a
            # chunk without an outcome at JobDone as lost).
            if not task.failed:
                self.emit(job.peer, ChunkDone(job.job, task.region.index, task.wire_bytes))
        if job_over:
            self.emit(job.peer, JobDone(job.job, job.done, job.failed))
        self._round_chunk_terminal(task.round_id)

    def _round_chunk_terminal(self, rid: int) -> None:
        slot = self._rounds.chunk_terminal(rid)
        if slot is not None:
            self.on_round_free(slot)

    def count_streamed(self) -> None:
        with self._stats_lock:
            self.stats["fetch"].streamed += 1

    def _src(self, task: ChunkTask):
        if task.own is None:
            return self.buf.src_chunk(task.slot, task.region, task.job.layout, task.job.dtype)
        lay = task.job.layout
        shape = (lay.num_layers, task.region.tokens, lay.num_kv_heads, lay.head_dim)
        k, v = np.split(task.own[0].view(task.job.dtype), 2)
        return k.reshape(shape), v.reshape(shape)

    def _infl(self, task: ChunkTask, layer: int) -> np.ndarray:
        if task.own is None:
            return self.buf.infl_layer(task.slot, task.region, layer)
        n = task.region.infl_layer
        return task.own[1][layer * n : (layer + 1) * n]

    def forward(self, stage: str, item) -> None:
        """Hand a slab to the next stage (inline in the serial ablation, failing only that slab)."""
        if not self.cfg.serial:
            self.queues[stage].put(item)
            return
        try:
            {"inflate": self._inflate, "dequant": self._dequant, "dma": self._dma}[stage](item)
        except Exception as e:  # the inline stage's boundary (a worker's, in the pipelined mode)
            self._failed_item(item[0], stage, e)

    # ---- the three stages after fetch (each returns the bytes it produced) ----------------------
    def _inflate(self, item: tuple[ChunkTask, int, int]) -> int:
        task, lo, hi = item
        if self.skip(task):
            self._slab_finished(task)
            return 0
        job, n = task.job, 0
        for layer in range(lo, hi):
            out = self._codes_area(task, layer) if job.codes else self._infl(task, layer)
            task.decoded[layer] = job.codec.lossless_stage(layer_section(task.blob, task.header, layer), out)
            n += task.decoded[layer]
        if job.codes:  # the layers' codes are in the destination: the pool's writer dequantizes them
            self._deliver(task, lo, hi, task.decoded[lo:hi])
        else:
            self.forward("dequant", item)
        return n

    def _codes_area(self, task: ChunkTask, layer: int) -> np.ndarray:
        d = task.job.dests[task.region.index]
        at = d.k_off + layer * d.layer_stride
        return task.job.dest[at : at + d.layer_stride]

    def _dequant(self, item: tuple[ChunkTask, int, int]) -> int:
        task, lo, hi = item
        if self.skip(task):
            self._slab_finished(task)
            return 0
        job = task.job
        k, v = self._src(task)
        for layer in range(lo, hi):
            dec = self._infl(task, layer)[: task.decoded[layer]]
            job.codec.dequant_stage(task.header, layer, dec, k[layer], v[layer])
        self.forward("dma", item)
        return 2 * (hi - lo) * layer_bytes(job.layout, task.region.tokens)

    def _dma(self, item: tuple[ChunkTask, int, int]) -> int:
        task, lo, hi = item
        if self.skip(task):
            self._slab_finished(task)
            return 0
        job = task.job
        d = job.dests[task.region.index]
        k, v = self._src(task)
        lb = layer_bytes(job.layout, task.region.tokens)
        if self.cfg.dma_delay_s:
            time.sleep(self.cfg.dma_delay_s)
        for layer in range(lo, hi):
            ko, vo = d.k_off + layer * d.layer_stride, d.v_off + layer * d.layer_stride
            job.dest[ko : ko + lb] = k[layer].reshape(-1).view(np.uint8)
            job.dest[vo : vo + lb] = v[layer].reshape(-1).view(np.uint8)
        self._deliver(task, lo, hi)
        return 2 * (hi - lo) * lb

    def _deliver(self, task: ChunkTask, lo: int, hi: int, lengths: list[int] | None = None) -> None:
        """Layers ``lo..hi`` of the chunk are in the destination (``lengths``: output ``codes``, the bytes
        of each): tell the host, or hold the message until a streamed blob's frame verified. Ends the slab."""
        job = task.job
        done = LayerDone(job.job, task.region.index, lo, hi - lo, list(lengths or ()))
        with job.lock:
            hold = not task.verified  # a streamed blob's frame is not verified yet: tell the host then
            if hold:
                task.held.append(done)
        if not hold:
            self.emit(job.peer, done)
        self._slab_finished(task)
