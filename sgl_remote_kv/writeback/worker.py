"""Write-back: newly computed full chunks are encoded and stored in the background.

The scheduler thread (``scheduler_hooks.after_checkpoint``, an AFTER hook on
``UnifiedRadixCache.checkpoint``) calls ``WriteBack.offer`` after SGLang inserted a request's KV into the
radix tree (after each prefill chunk and at finish). ``offer`` works out which full chunks are new for this
request, copies their KV out of the pool (the slots may be reused once the scheduler moves on:
``KVWriter.read_later``, an async copy on device pools that the worker waits for) and queues one job; it
never waits on the store or the device. The queue is bounded by the KV bytes it holds (``max_bytes``,
``--remote-kv-writeback-queue-mb``): when a new job takes it past the bound, the *oldest* queued jobs are
dropped (a prefix not yet written is simply not in the tier yet), counted
(``writeback_skipped{reason="queue_full"}``, chunks) and logged at most once a minute; the queue's bytes are
a gauge (``writeback_queue_bytes``). The newest job is always kept.

On a device pool with a codec that quantizes on the device (``codec.device_encode``: the ``quant_*``
codecs, and the transform codec with Deflate, either quantizer), the copy is ``KVWriter.read_quantized_later``
instead: the device quantizes (for the transform codec also transforms) on its side stream and only codes and
scales come back, so the worker runs the lossless stage alone (``encode_quantized``: the same bytes as a host
encode for ``quant_*``; for the transform codec the same format, within float32 rounding of the host's
symbols). Other codecs, host pools and the NVDEC path's versions read KV and encode on the host.

Where the encode runs: with ``processes`` (the server's choice: a host encode, ``encoders.HostEncode``)
a host encode runs in encoder processes, ``threads`` of them, started by the worker thread before its first
job at niceness ``+nice``, so the scheduler process keeps its CPU and its GIL: the worker copies each
chunk's KV into an encoder's slot and stores the blob it gets back (the bytes an in-process encode with one
numeric thread writes; the transform codec's float GEMM may round otherwise with more BLAS threads). An
encoder that cannot start (logged once, with why) leaves the encode in this process's threads; one lost
mid-encode fails that job (counted as a write-back failure) and is started afresh for the next, and if that
fresh start fails, the encode stays in this process's threads from then on (logged once). A device
encode's lossless stage, and the NVDEC path's versions, always run in this process.

The worker never takes the serving thread's place: while the scheduler runs batches (``note_serving``, on
every batch; within ``SERVING_GRACE_S``), after each chunk it encoded it pauses so that encoding takes at
most ``cpu_share`` of the wall time (``--remote-kv-writeback-cpu``; 0: it waits for the server to go idle;
1: no pause): an encoder process's CPU time for the chunk (``Encoded.cpu_s``: a niced encoder waits while
the forward's threads run, which is not encoding), else the encode's wall time in this process. An idle
server writes back at full speed; a shutdown drain is never paced. A ``cpu_share`` of N >= 2 is N cores'
worth: ``int(N)`` encoder threads (each driving its encoder process, or encoding here: their lossless stages
release the GIL) encode a job's chunks side by side, never pausing; the blobs are the same and stored in the
same order.

A single worker thread then dedups against the store (``count_prefix``: chunks the store already has
are not re-encoded), encodes the rest and ``put_many``s them. With ``versions`` (the NVDEC path's
adaptive resolution, ``nvdec/versions.py``) each stored full chunk is then also encoded at the other
resolutions, stored after the chunks' own keys (hits first; a fetch falls back until they land). Stores
publish a value only after it is completely written, so readers never see a partial chunk.

Buffers: the job owns the copied numpy KV (or codes); the worker drops it after the put.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sgl_remote_kv.codec.quantized import QuantizedChunks, TransformCodes
from sgl_remote_kv.kvpool.writer import PendingRead
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.types import FailureKind
from sgl_remote_kv.writeback.encoders import EncoderPool, HostEncode

logger = logging.getLogger(__name__)

_MAX_TRACKED = 65536
SERVING_GRACE_S = 0.25  # a batch this recently: the server is serving (the write-back paces itself)
DROP_LOG_S = 60.0  # at most one warning about dropped write-backs per this many seconds


@dataclass
class _Job:
    keys: list[bytes]  # keys of chunks [0, last_chunk) of the request's token prefix
    first_chunk: int  # kv holds chunks [first_chunk, last_chunk)
    kv: PendingRead  # the KV copied out of the pool ([L, T, H, D] each) or its codes, maybe still on its way
    tokens: int  # per chunk: a full chunk, or a tail sub-chunk
    start: int  # sequence position of k[:, 0] (codecs that undo RoPE need each chunk's position)
    tenant_tag: bytes  # keys.tenant_tag of the request's salt, framed with each value (admin stats)
    nbytes: int = 0  # host bytes the job holds (the queue's bound counts them)


class RequestReader(Protocol):
    """What the write-back reads of a request (``sglang_glue.assemble.WriteBackRequests`` over SGLang's)."""

    def rid(self, req) -> str: ...
    def fill_ids(self, req) -> list[int]: ...  # the request's token ids so far
    def salt(self, req) -> str | None: ...  # its cache salt (the key namespace of a tenant)
    def kv_indices(self, req, lo: int, hi: int): ...  # pool slots of tokens [lo, hi), or None


class WriteBack:
    """``keys``: the deployment's ``runtime.KeySpace`` (write codec); ``requests``: how to read a request
    (``RequestReader``; the SGLang glue passes SGLang's). No SGLang import here."""

    def __init__(
        self,
        codec,
        fingerprint,
        client,
        keys,
        metrics,
        kv_writer,
        requests: RequestReader,
        max_bytes: int,
        cpu_share: float = 1.0,
        tail_granule: int = 0,
        versions=None,
        processes: bool = False,
        nice: int = 0,
    ) -> None:
        self.codec, self.fingerprint, self.client, self.keys, self.metrics = (
            codec,
            fingerprint,
            client,
            keys,
            metrics,
        )
        self.chunk_size = keys.chunk_size
        self.tail_granule = tail_granule  # tail sub-chunk tokens written at a request's end (0: none)
        # nvdec.versions.ChunkVersions: each full chunk's other resolutions (adaptive resolution), or None
        self.versions = versions
        self.kv_writer = kv_writer  # reads the KV of finished chunks (scheduler thread)
        # quantize on the device, encode only the lossless stage here (see module docstring)
        self.device_encode = bool(getattr(codec, "device_encode", False)) and versions is None
        self.device_spec = codec.device_encode_spec(fingerprint) if self.device_encode else None
        self.requests = requests
        self.max_bytes = max_bytes
        self.cpu_share = cpu_share
        # cpu_share >= 2: that many encoder threads (see module docstring); owned by the worker thread
        self.threads = int(cpu_share) if cpu_share >= 2 else 1
        self._encoders = (
            cf.ThreadPoolExecutor(self.threads, thread_name_prefix="srkv-wb-encode")
            if self.threads > 1
            else None
        )
        # host encode in encoder processes (see module docstring); the worker thread starts and owns it
        host_encode = versions is None and not (self.device_encode and kv_writer.device_dequant)
        pool = EncoderPool(codec, fingerprint, self.chunk_size, self.threads, nice)
        self._host = HostEncode(codec, fingerprint, pool if processes and host_encode else None)
        self._pool_started = threading.Event()  # the pool started, or the worker gave up on it
        self._serving_at = float("-inf")  # monotonic time of the scheduler's last batch
        self._jobs: deque[_Job] = deque()  # queued, oldest first (not the one being written)
        self._cv = threading.Condition()
        self._queued_bytes = 0
        self._unfinished = 0  # queued + being written
        self._closed = False
        self._dropped = 0  # chunks dropped since the last warning
        self._drop_logged = float("-inf")
        # rid -> chunks already offered or known present; bounded (an aborted request never finishes)
        self._progress: OrderedDict[str, int] = OrderedDict()
        self._errors_logged: set[str] = set()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name="srkv-writeback", daemon=True)
        self._thread.start()

    # -- scheduler thread -------------------------------------------------------------------------
    def note_present(self, rid: str, chunks: int) -> None:
        """The first ``chunks`` chunks of ``rid``'s prompt are known to be in the store."""
        self._set_progress(rid, max(self._progress.get(rid, 0), chunks))

    def _set_progress(self, rid: str, chunks: int) -> None:
        self._progress[rid] = chunks
        self._progress.move_to_end(rid)
        while len(self._progress) > _MAX_TRACKED:
            self._progress.popitem(last=False)

    def note_serving(self) -> None:
        """The scheduler runs a batch now (every batch: a float store, no lock)."""
        self._serving_at = time.monotonic()

    def forget(self, rid: str) -> None:
        self._progress.pop(rid, None)

    def offer(self, req, up_to: int, final: bool = False) -> None:
        """Queue the full chunks of the request's first ``up_to`` tokens not offered yet (see module
        docstring); ``final`` (the request's last checkpoint): also the tail sub-chunks of the partial
        chunk after them."""
        c, g = self.chunk_size, self.tail_granule
        last = up_to // c
        rid = self.requests.rid(req)
        first = self._progress.get(rid, 0)
        subs = (up_to - last * c) // g if final and g else 0
        if last <= first and not subs:
            return
        ids, salt = self.requests.fill_ids(req), self.requests.salt(req)
        keys = self.keys.keys_for(ids, last, salt)
        tag = keys_mod.tenant_tag(salt)
        if last > first and self._queue(req, keys, first, first * c, last * c, c, tag):
            self._set_progress(rid, last)
        if subs:
            tail = self.keys.tail_keys(ids, last, keys[-1] if last else None, salt, None, g)[:subs]
            self._queue(req, tail, 0, last * c, last * c + subs * g, g, tag)

    def _queue(self, req, keys: list[bytes], first: int, lo: int, hi: int, tokens: int, tag: bytes) -> bool:
        """Copy tokens ``[lo, hi)`` out of the pool and queue them as chunks ``keys[first:]``."""
        idx = self.requests.kv_indices(req, lo, hi)
        if idx is None:
            return False
        lay = self.fingerprint.layout
        kv = (
            self.kv_writer.read_quantized_later(idx, self.device_spec, tokens, lo)
            if self.device_encode
            else None
        )
        nbytes = (hi - lo) * lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim  # codes, about
        if kv is None:  # device pools: an async copy, waited for by the worker
            kv, nbytes = self.kv_writer.read_later(idx), (hi - lo) * lay.bytes_per_token()
        job = _Job(keys, first, kv, tokens, lo, tag, nbytes)
        dropped: list[_Job] = []
        with self._cv:
            self._jobs.append(job)
            self._queued_bytes += job.nbytes
            self._unfinished += 1
            self._idle.clear()
            while self._queued_bytes > self.max_bytes and len(self._jobs) > 1:  # the oldest go first
                old = self._jobs.popleft()
                self._queued_bytes -= old.nbytes
                self._unfinished -= 1
                dropped.append(old)
            queued = self._queued_bytes
            self._cv.notify()
        self.metrics.writeback_queue(queued)
        if dropped:
            self._count_dropped(sum(len(j.keys) - j.first_chunk for j in dropped))
        return True

    def _count_dropped(self, chunks: int) -> None:
        """Dropped chunks: counted at once, logged at most once per ``DROP_LOG_S`` (scheduler thread)."""
        self.metrics.writeback_skipped("queue_full", chunks)
        self._dropped += chunks
        now = time.monotonic()
        if now - self._drop_logged >= DROP_LOG_S:
            logger.warning(
                "remote-kv write-back behind: dropped the %d oldest unwritten chunks (queue over %d MiB); "
                "those prefixes are not in the tier until requested again",
                self._dropped,
                self.max_bytes >> 20,
            )
            self._dropped, self._drop_logged = 0, now

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued job is written (``/flush_cache``, tests); False on timeout."""
        return self._idle.wait(timeout)

    def pending(self) -> int:
        """Jobs queued or being written."""
        with self._cv:
            return self._unfinished

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def encoder_pids(self, timeout: float = 60.0) -> list[int]:
        """The encoder processes' pids once the worker started them ([]: the encode runs in this process)."""
        self._pool_started.wait(timeout)
        return self._host.pids()

    # -- worker thread ---------------------------------------------------------------------------
    def _serving(self) -> bool:
        return time.monotonic() - self._serving_at < SERVING_GRACE_S

    def _pace(self, busy_s: float) -> None:
        """After ``busy_s`` of encoding: pause while the server serves (see module docstring)."""
        share = self.cpu_share
        if share >= 1.0 or self._closed or not self._serving():
            return
        if share > 0.0:
            if busy_s > 0.0:
                time.sleep(min(busy_s * (1.0 - share) / share, 5.0))
            return
        while self._serving() and not self._closed:  # share 0: defer until the server is idle
            time.sleep(0.05)

    def _loop(self) -> None:
        try:
            self._host.start()
        finally:
            self._pool_started.set()
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:  # closed and drained
                    if self._encoders is not None:
                        self._encoders.shutdown(wait=False)
                    self._host.close()
                    return
                job = self._jobs.popleft()
                self._queued_bytes -= job.nbytes
                queued = self._queued_bytes
            self.metrics.writeback_queue(queued)
            try:
                self._write(job)
            except Exception as e:  # thread boundary: a failed write-back is only a lost cache entry
                kind = type(e).__name__
                self.metrics.failure(FailureKind.WRITEBACK)
                if kind not in self._errors_logged:
                    self._errors_logged.add(kind)
                    logger.warning("remote-kv write-back failed (%s): %s", kind, e)
            finally:
                with self._cv:
                    self._unfinished -= 1
                    if self._unfinished == 0:
                        self._idle.set()

    def _write(self, job: _Job) -> None:
        read = job.kv.result()  # KVWriteError if the device copy did not complete: counted, not stored
        c = job.tokens
        last = len(job.keys)
        present = self.client.count_prefix(job.keys)
        start = max(present, job.first_chunk)
        if present > job.first_chunk:
            self.metrics.writeback_skipped("present", min(present, last) - job.first_chunk)

        def encode(i: int) -> tuple[bytes, float | None]:
            """Chunk ``i``'s blob, and the CPU-seconds an encoder process spent on it (None: encoded here)."""
            j = i - job.first_chunk
            if isinstance(
                read, (QuantizedChunks, TransformCodes)
            ):  # coded on the device: lossless stage here
                return self.codec.encode_quantized(read, j, self.fingerprint), None
            k, v = read
            return self._host.encode(k[:, j * c : (j + 1) * c], v[:, j * c : (j + 1) * c], job.start + j * c)

        if self._encoders is not None and last - start > 1:  # side by side, unpaced
            blobs = [b for b, _ in self._encoders.map(encode, range(start, last))]
            items = list(zip(job.keys[start:last], blobs, strict=True))
        else:
            items, busy = [], 0.0
            for i in range(start, last):
                self._pace(busy)  # after the previous chunk's encoding (share 0: before any)
                t0 = time.perf_counter()
                blob, cpu_s = encode(i)
                items.append((job.keys[i], blob))
                # busy: this process's wall time, or the encoder process's CPU time (a niced encoder's wall
                # time counts the time the forward's threads held the cores, which pacing must not add to)
                busy = time.perf_counter() - t0 if cpu_s is None else cpu_s
        if not items:
            return
        stored = self.client.put_many(items, job.tenant_tag)
        self.metrics.writeback(stored, sum(len(b) for _, b in items[:stored]))
        if stored < len(items):
            self.metrics.failure("writeback:store")
        if self.versions is not None and stored:  # versions: never device-encoded (read is KV)
            self._write_versions(job, *read, start, start + stored, [b for _, b in items[:stored]])

    def _write_versions(self, job: _Job, k, v, first: int, end: int, anchors: list[bytes]) -> None:
        """Chunks ``[first, end)``'s other resolutions (adaptive resolution), after their own keys: a hit is
        servable as soon as possible (and at a shutdown drain); until its versions land, a fetch falls back
        to the chunk's own key."""
        c, extra = job.tokens, []
        for i in range(first, end):
            lo, hi = (i - job.first_chunk) * c, (i - job.first_chunk + 1) * c
            extra += self.versions.encode(
                job.keys[i],
                np.ascontiguousarray(k[:, lo:hi]),
                np.ascontiguousarray(v[:, lo:hi]),
                job.start + lo,
            )
        done = self.client.put_many([(key, b) for key, b, _ in extra], job.tenant_tag) if extra else 0
        if done < len(extra):
            self.metrics.failure("writeback:store")
        self.metrics.writeback(0, sum(len(b) for _, b, _ in extra[:done]))
        self.versions.written(extra[:done], anchors)
