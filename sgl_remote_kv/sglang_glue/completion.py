"""Completion side of the waiting_for_KV queue: a finished (or, layer-wise, a verified) fetch
becomes device nodes in the radix tree.

``FetchCompletion`` is a mixin of ``waiting_queue.WaitingForKV`` (and is driven by ``tp_sync`` with
TP > 1, with ``agreed`` = the ranks' common chunk count). It uses the queue's ``rt`` (runtime),
``inst`` (``TreeInstaller``), ``held`` (tree locks until admission), ``layerwise``, ``_lookups``
(worker pool for store I/O) and ``_release``.

Threads: scheduler thread only. Slots: a direct backend's reserved slots (``p.slots``) stay the
queue's until inserted into the tree; whatever the tree did not take is freed here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.sglang_glue.fetch import FetchHandle
from sgl_remote_kv.types import FailureKind

if TYPE_CHECKING:
    from sgl_remote_kv.sglang_glue.waiting_queue import _Parked

logger = logging.getLogger(__name__)


class FetchCompletion:
    def _complete_fetch(self, p: _Parked, h: FetchHandle, now: float, agreed: int | None = None) -> None:
        """The fetch is done: count it, install its leading intact chunks (at most ``agreed``, the
        TP ranks' common count, see ``tp_sync``), free the rest and release the request."""
        self.rt.policy.fetch_ended(p.req.rid)
        if h.failure is not None:
            self.rt.metrics.failure(h.failure)
            self._drop_undecodable(p, h)  # this rank's own first bad chunk
        if agreed is not None:
            h.ok_chunks = min(h.ok_chunks, agreed)  # the worker is done with the handle
        self.rt.policy.observe_fetch(p.path, h.fetched_bytes, h.fetch_s, h.decoded_bytes, h.decode_s)
        ready = h.finished_at if h.finished_at is not None else now
        decode_s = h.decode_s if h.decoded_here else None
        self.rt.metrics.fetched(h.fetched_bytes, h.decoded_bytes, h.fetch_s, decode_s, ready - p.parked_at)
        try:
            self._install(p, h)
        except Exception as e:  # boundary: a failed install is a miss, never a crash
            self.rt.metrics.failure(FailureKind.INSTALL)
            # with TP > 1 a one-rank install failure is a bug the agreement cannot repair (docs)
            log = logger.error if agreed is not None else logger.warning
            log("installing fetched KV for %s failed: %r", p.req.rid, e)
        finally:
            self.inst.free(p.slots)  # whatever the tree did not take
            self.inst.unlock(p.prefix_lock)
        self._release(p)

    def _admit_early(self, p: _Parked, h: FetchHandle, now: float) -> None:
        """Layer-wise: every chunk is fetched and verified; insert the slots now and let the forward
        pass wait per layer (``layerwise.py``). Falls back to the normal path if no slots are free.
        Direct backends (DPU) insert the slots they were given at submit; they keep scattering into them
        until ``layerwise`` saw every layer (or cancelled the handle to decode the rest itself)."""
        direct = p.slots is not None
        slots = p.slots if direct else self.inst.alloc(h.n_chunks * h.chunk_size)
        if slots is None:
            return  # retried next pass; the normal completion path still works
        try:
            self._insert_hit(p, h, slots)
        except Exception as e:  # boundary: keep waiting on the normal completion path instead
            self.rt.metrics.failure(FailureKind.INSTALL)
            logger.warning("layer-wise install for %s failed: %r", p.req.rid, e)
            if not direct:
                self.inst.free(slots)
            return
        p.slots = None  # tree-owned now
        on_demand = p.path == "inproc"  # decode in the forward thread: no GIL convoy with a worker
        if on_demand:
            h.cancel()
        self.layerwise.add(h, slots, self.rt.paths[p.path].codec, on_demand=on_demand)
        self.rt.policy.fetch_ended(p.req.rid)
        self.rt.policy.observe_fetch(p.path, h.fetched_bytes, h.fetch_s, 0, 0.0)
        self.rt.metrics.fetched(h.fetched_bytes, h.n_chunks * h.chunk_size * self._bpt(), h.fetch_s, None,
                                now - p.parked_at)  # fmt: skip  (admitted at verified: KV ready per layer)
        self.rt.metrics.layerwise_admission()
        logger.debug("layer-wise: admitted %s before its KV is in the pool", p.req.rid)
        self.inst.unlock(p.prefix_lock)
        self._release(p)

    def _bpt(self) -> int:
        return self.rt.fingerprint.layout.bytes_per_token()

    def _install(self, p: _Parked, h: FetchHandle) -> None:
        ok = h.ok_tokens
        if ok <= 0:
            return
        if p.slots is not None:  # direct: the KV is already in the reserved slots
            self._insert_hit(p, h, p.slots[:ok])  # if it raises, the caller frees them all
            p.slots = p.slots[ok:]  # the rest (past the hit) is freed by the caller
            return
        if not h.has_staged():
            return
        slots = self.inst.alloc(ok)
        if slots is None:
            self.rt.metrics.failure("no_kv_slots")
            return
        p.slots = slots  # the caller frees them unless the tree takes them
        try:
            self.inst.write(slots, h)
        except KVWriteError as e:  # a failed write is a miss: the request recomputes
            self.rt.metrics.failure(FailureKind.WRITE)
            logger.warning("writing fetched KV for %s failed; recomputing: %s", p.req.rid, e)
            return
        self._insert_hit(p, h, slots)
        p.slots = None  # tree-owned (or freed by the insert as duplicates)

    def _insert_hit(self, p: _Parked, h: FetchHandle, slots) -> None:
        ok, start = len(slots), h.start_token
        self.held.append((p.req, self.inst.insert(p.req, p.prefix_node, start, slots)))
        p.req.storage_hit_length = ok
        p.req.storage_hit_start = start
        self.rt.metrics.hit(ok, ok // self.rt.chunk_size)
        if self.rt.writer is not None and self.rt.paths[p.path].codec is self.rt.codec:
            # Only the chunks that were installed are known good; the write-back re-offers the rest.
            self.rt.writer.note_present(p.req.rid, p.local_chunks + ok // self.rt.chunk_size)
        logger.debug("remote KV hit for %s: tokens [%d, %d)", p.req.rid, start, start + ok)

    def _drop_undecodable(self, p: _Parked, h: FetchHandle) -> None:
        """A well-framed chunk that failed to decode (corrupt / foreign) would stay in the store and cut
        every later hit short; delete it (on a worker thread: store I/O) so the write-back of this
        request's recompute replaces it."""
        kind, bad, keys = str(h.failure or ""), h.ok_chunks, p.keys[p.path]
        if bad < len(keys) and (kind.startswith("decode:") or kind in ("corrupt", "foreign")):
            self.rt.metrics.failure("repair_undecodable")
            self._lookups.submit(self.rt.client.delete_many, [keys[bad]])
