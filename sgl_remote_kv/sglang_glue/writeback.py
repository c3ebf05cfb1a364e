"""Write-back: newly computed full chunks are encoded and stored in the background.

The scheduler thread (``RemoteKVRadixCache.checkpoint``) calls ``WriteBack.offer`` after SGLang
inserted a request's KV into the radix tree (after each prefill chunk and at finish). ``offer`` works
out which full chunks are new for this request, copies their KV out of the pool (the slots may be
reused once the scheduler moves on) and queues one job; it never waits on the store. A bounded
queue: when full, the job is dropped and counted (``writeback_skipped{reason="queue_full"}``).

A single worker thread then dedups against the store (``count_prefix``: chunks the store already has
are not re-encoded), encodes the rest and ``put_many``s them. Stores publish a value only after it is
completely written, so readers never see a partial chunk.

Buffers: the job owns the copied numpy KV; the worker drops it after the put.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from sgl_remote_kv.types import FailureKind

logger = logging.getLogger(__name__)

_MAX_TRACKED = 65536


@dataclass
class _Job:
    keys: list[bytes]  # keys of chunks [0, last_chunk) of the request's token prefix
    first_chunk: int  # k/v hold chunks [first_chunk, last_chunk)
    k: np.ndarray
    v: np.ndarray


class WriteBack:
    def __init__(self, runtime, kv_writer, req_to_token_pool, max_queue: int) -> None:
        self.rt = runtime
        self.kv_writer = kv_writer  # reads the KV of finished chunks (scheduler thread)
        self.req_to_token_pool = req_to_token_pool
        self._q: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
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

    def forget(self, rid: str) -> None:
        self._progress.pop(rid, None)

    def offer(self, req, token_ids, up_to: int) -> None:
        """Queue the full chunks of ``token_ids[:up_to]`` not offered yet (see module docstring)."""
        c = self.rt.chunk_size
        last = up_to // c
        first = self._progress.get(req.rid, 0)
        if last <= first or req.kv.req_pool_idx is None:
            return
        salt = _salt_of(req)
        keys = self.rt.keys_for(token_ids, last, salt)
        idx = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, first * c : last * c]
        k, v = self.kv_writer.read(idx)
        self._set_progress(req.rid, last)
        try:
            self._q.put_nowait(_Job(keys, first, k, v))
            self._idle.clear()
        except queue.Full:
            self.rt.metrics.writeback_skipped("queue_full", last - first)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued job is written (tests, shutdown)."""
        return self._idle.wait(timeout) if self._q.unfinished_tasks else True

    def close(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass

    # -- worker thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception as e:  # thread boundary: a failed write-back is only a lost cache entry
                kind = type(e).__name__
                self.rt.metrics.failure(FailureKind.WRITEBACK)
                if kind not in self._errors_logged:
                    self._errors_logged.add(kind)
                    logger.warning("remote-kv write-back failed (%s): %s", kind, e)
            finally:
                self._q.task_done()
                if self._q.unfinished_tasks == 0:
                    self._idle.set()

    def _write(self, job: _Job) -> None:
        c = self.rt.chunk_size
        last = len(job.keys)
        present = self.rt.client.count_prefix(job.keys)
        start = max(present, job.first_chunk)
        if present > job.first_chunk:
            self.rt.metrics.writeback_skipped("present", min(present, last) - job.first_chunk)
        items = []
        for i in range(start, last):
            lo, hi = (i - job.first_chunk) * c, (i - job.first_chunk + 1) * c
            blob = self.rt.codec.encode(
                np.ascontiguousarray(job.k[:, lo:hi]),
                np.ascontiguousarray(job.v[:, lo:hi]),
                self.rt.fingerprint,
            )
            items.append((job.keys[i], blob))
        if not items:
            return
        stored = self.rt.client.put_many(items)
        self.rt.metrics.writeback(stored, sum(len(b) for _, b in items[:stored]))
        if stored < len(items):
            self.rt.metrics.failure("writeback:store")


def _salt_of(req) -> str | None:
    from sgl_remote_kv.sglang_glue.runtime import tenant_salt

    return tenant_salt(req.cache_salt, req.extra_key)
