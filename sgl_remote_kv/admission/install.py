"""A finished (or, layer-wise, a verified) fetch becomes pages SGLang can load (``TreeOps.insert``: in the
server, ``StagedTree`` stages the rows under SGLang's page hashes for the linker's ``lookup``).

``Installer`` is the admission queue's collaborator for the last step of a FETCH record. It never
releases a request itself: it returns the lock to hold until the request is admitted, or None.

Threads: scheduler thread only. Rows: a record's reserved staging ``rows`` stay the queue's until
``insert`` stages them; ``complete`` frees whatever was not taken, on every outcome.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging

from sgl_remote_kv.admission.parked import ParkedRequest
from sgl_remote_kv.admission.ports import Collaborators
from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.types import FailureKind, PathName

logger = logging.getLogger(__name__)


def _undecodable(failure) -> bool:
    kind = failure.value if isinstance(failure, FailureKind) else str(failure or "")
    return kind.startswith("decode:") or kind in (FailureKind.CORRUPT.value, FailureKind.FOREIGN.value)


class Installer:
    def __init__(self, c: Collaborators, chunk_size: int, io: cf.Executor) -> None:
        self.c, self.chunk, self.io = c, chunk_size, io

    def account(self, p: ParkedRequest) -> None:
        """Count a fetch that ended on this rank: its failure (and the repair of an undecodable chunk),
        the policy's estimates, the fetch metrics. No effect on the tree or the staging."""
        h, c = p.handle, self.c
        c.policy.fetch_ended(p.rid)
        if h.failure is not None:
            c.metrics.failure(h.failure)
            self._drop_undecodable(p)  # this rank's own first bad chunk
        c.policy.observe_fetch(p.path, h.fetched_bytes, h.fetch_s, h.decoded_bytes, h.decode_s)
        ready = h.finished_at if h.finished_at is not None else p.since
        decode_s = h.decode_s if h.decoded_here else None
        c.metrics.fetched(h.fetched_bytes, h.decoded_bytes, h.fetch_s, decode_s, ready - p.parked_at)

    def complete(self, p: ParkedRequest, agreed: int) -> tuple[object, int] | None:
        """The fetch is done on every rank: count it, install its leading intact chunks (at most
        ``agreed``, the TP ranks' common count), free the rest. Returns (tree lock, tokens) of the
        installed hit, or None."""
        h, c = p.handle, self.c
        self.account(p)
        h.ok_chunks = min(h.ok_chunks, agreed)  # the worker is done with the handle
        try:
            return self._install(p)
        except Exception as e:  # boundary: a failed install is a miss, never a crash
            c.metrics.failure(FailureKind.INSTALL)
            # with TP > 1 a one-rank install failure is a bug the agreement cannot repair (docs)
            log = logger.error if c.agreement.active else logger.warning
            log("installing fetched KV for %s failed: %r", p.rid, e)
            return None
        finally:
            c.tree.free(p.rows)  # whatever ``insert`` did not stage
            c.tree.unlock(p.prefix_lock)
            p.rows = p.prefix_lock = None

    def admit_early(self, p: ParkedRequest, now: float) -> tuple[object, int] | None:
        """Layer-wise: every chunk is fetched and verified; stage the reserved rows now and let the
        linker's load wait per layer (``layerwise.py``). Direct backends keep writing the rows until
        ``layerwise`` saw every layer (or cancelled the handle to decode the rest itself). None: not
        admitted (the record stays in FETCH and completes normally)."""
        h, c, rows = p.handle, self.c, p.rows
        try:
            lock = self._insert_hit(p, rows)
        except Exception as e:  # boundary: keep waiting on the normal completion path instead
            c.metrics.failure(FailureKind.INSTALL)
            logger.warning("layer-wise install for %s failed: %r", p.rid, e)
            return None
        p.rows = None  # staged now (the staging entry owns them)
        on_demand = p.path is PathName.INPROC  # decode in the forward thread: no GIL convoy with a worker
        if on_demand:
            h.cancel()
        c.layerwise.add(h, rows, c.paths[p.path].codec, on_demand=on_demand)
        c.policy.fetch_ended(p.rid)
        c.policy.observe_fetch(p.path, h.fetched_bytes, h.fetch_s, 0, 0.0)
        tokens = len(rows)
        c.metrics.fetched(h.fetched_bytes, tokens * c.bytes_per_token, h.fetch_s, None, now - p.parked_at)
        c.metrics.layerwise_admission()
        logger.debug("layer-wise: admitted %s before its KV is in the staging rows", p.rid)
        c.tree.unlock(p.prefix_lock)
        p.prefix_lock = None
        return lock, tokens

    def _install(self, p: ParkedRequest) -> tuple[object, int] | None:
        h = p.handle
        ok = h.ok_tokens
        if ok <= 0:
            return None
        rows = p.rows[:ok]
        if not h.direct:  # a direct backend already wrote the KV into the reserved rows
            if not h.has_staged():
                return None
            try:
                self.c.tree.write(rows, h)
            except KVWriteError as e:  # a failed write is a miss: the request recomputes
                self.c.metrics.failure(FailureKind.WRITE)
                logger.warning("writing fetched KV for %s failed; recomputing: %s", p.rid, e)
                return None
        lock = self._insert_hit(p, rows)  # if it raises, ``complete`` frees every reserved row
        p.rows = p.rows[ok:]  # the first ``ok`` are staged now; ``complete`` frees the rest
        return lock, ok

    def _insert_hit(self, p: ParkedRequest, rows):
        c = self.c
        ok, start = len(rows), p.handle.start_token
        lock = c.tree.insert(p.req, p.prefix_node, start, rows)
        c.host.mark_hit(p.req, start, ok)
        codec = c.paths[p.path].codec
        c.metrics.hit(ok, ok // self.chunk, codec.name, getattr(codec, "quality", None))
        if c.on_installed is not None and c.paths[p.path].codec is c.write_codec:
            # Only the chunks that were installed are known good; the write-back re-offers the rest.
            c.on_installed(p.rid, p.local_chunks + ok // self.chunk)
        logger.debug("remote KV hit for %s: tokens [%d, %d)", p.rid, start, start + ok)
        return lock

    def _drop_undecodable(self, p: ParkedRequest) -> None:
        """A well-framed chunk that failed to decode (corrupt / foreign) would stay in the store and cut
        every later hit short; delete it (on a worker thread: store I/O) so the write-back of this
        request's recompute replaces it."""
        h = p.handle
        bad, keys = h.ok_chunks, p.fetch_keys
        if bad < len(keys) and _undecodable(h.failure):
            self.c.metrics.failure(FailureKind.REPAIR_UNDECODABLE)
            self.io.submit(self.c.delete, [keys[bad]])
