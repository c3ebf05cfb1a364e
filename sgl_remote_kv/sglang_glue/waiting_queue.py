"""The waiting_for_KV queue: requests whose prefix may be in the remote tier wait here, not in SGLang's
waiting queue, while their chunks are looked up, fetched and decoded.

Life of a request (all on the scheduler thread; store I/O and decoding on worker threads):

1. ``park(req)`` (from the ``_add_request_to_queue`` hook): match the prompt against the local tree
   (no I/O). If the prompt has full chunks beyond the local hit (always leaving the last prompt token
   to compute), park it and start an asynchronous ``count_prefix`` of those chunks' keys.
   Otherwise it goes straight to SGLang's waiting queue.
2. ``poll()`` (every scheduler iteration, from the ``_process_hicache_events`` hook):
   - lookup answered 0 / failed / slower than ``lookup_timeout_s``: release (a miss);
   - lookup answered n > 0: ask the policy; fetch the n chunks (only those beyond the local hit) or
     release to recompute;
   - fetch running longer than the policy allows (slower than recompute would be, or hung:
     ``Policy.check``): cancel it and release to recompute (metrics failure ``abandoned`` /
     ``fetch_timeout``); running fetches also feed the policy's link estimate;
   - fetch finished: install the leading chunks that arrived intact into the radix tree as device
     nodes (allocate slots, scatter KV, ``insert``), lock them until the request is admitted, then
     release the request. A partial or failed fetch installs fewer chunks or none: the rest is
     recomputed. Nothing is ever promised to SGLang before the KV is in the pool.
3. Release = SGLang's original ``_add_request_to_queue``: the request's ``match_prefix`` now finds
   the fetched prefix as a device hit. It joins at the next scheduling pass, not a later queue scan.

Requests without a remote hit never wait on a fetching one: fetches run on worker threads and the
scheduler keeps scheduling everything else. ``abort(...)`` cancels a parked request's fetch and hands
it back to SGLang's waiting queue so SGLang's own abort path finishes it.

TP ranks: with TP > 1 every rank runs this queue on its own shard of the KV and ``poll`` hands over to
``tp_sync.TPQueue``: every decision (lookup result, policy choice, timeouts, fetched chunk count,
zombie reaping) is agreed by one all-reduce MIN over the TP CPU group per pass (docs/INTEGRATION.md).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field

import torch

from sgl_remote_kv.policy.estimator import Decision
from sgl_remote_kv.sglang_glue import tp_sync
from sgl_remote_kv.sglang_glue.completion import FetchCompletion
from sgl_remote_kv.sglang_glue.fetch import FetchHandle
from sgl_remote_kv.sglang_glue.install import TreeInstaller
from sgl_remote_kv.sglang_glue.runtime import RemoteKVRuntime, tenant_salt
from sgl_remote_kv.store.base import StoreError

logger = logging.getLogger(__name__)


@dataclass
class _Parked:
    req: object
    keys: dict[str, list[bytes]]  # per fetch path: keys of chunks [local_chunks, usable)
    local_chunks: int
    path: str = ""  # the fetch path the policy chose
    follow: str | None = None  # rid of an in-flight fetch of the same chunks this request waits on
    parked_at: float = field(default_factory=time.monotonic)
    lookup: cf.Future | None = None
    handle: FetchHandle | None = None
    remote_chunks: int = 0
    fetch_started: float = 0.0
    prefix_node: object = None  # tree node ending at the fetched span's start, locked while fetching
    prefix_lock: object = None
    slots: torch.Tensor | None = None  # direct backends: reserved destination slots not yet in the tree
    decision: Decision | None = None  # the policy's choice (estimates) and the wire bytes it assumed
    wire_bytes: int = 0


class WaitingForKV(FetchCompletion):
    """See module docstring. ``release`` is SGLang's original enqueue function for one request."""

    sync = tp_sync.SINGLE  # TP rank agreement; inactive (no collective) at tp_size == 1

    def __init__(self, scheduler, rt: RemoteKVRuntime, release) -> None:
        self.s = scheduler
        self.rt = rt
        self._release_fn = release
        self.tree = scheduler.tree_cache
        self.inst = TreeInstaller(self.tree, rt.kv_writer)
        self.parked: dict[str, _Parked] = {}
        self.zombies: list[_Parked] = []  # dropped fetches whose backend may still write their slots
        self.held: list[tuple[object, object]] = []  # (req, tree lock) until the req is admitted
        self._lookups = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="srkv-lookup")
        self.enabled = self._check_supported()
        self.sync = tp_sync.for_scheduler(scheduler)
        self.layerwise = None  # --remote-kv-layerwise: early admission of verified fetches
        if self.enabled and rt.config.layerwise:
            from sgl_remote_kv.sglang_glue import layerwise

            self.layerwise = layerwise.attach(self.inst.kvcache, rt.kv_writer, rt.fingerprint, rt.metrics)

    def _check_supported(self) -> bool:
        if getattr(self.tree.tree_core, "is_eagle", False):
            logger.warning("remote KV reads disabled: EAGLE bigram radix keys are not supported")
            return False
        if self.rt.chunk_size % max(1, self.tree.page_size):
            logger.warning("remote KV reads disabled: chunk size not a multiple of page size")
            return False
        return True

    # -- admission ---------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.parked or self.zombies or (self.layerwise and self.layerwise.busy()))

    def park(self, req) -> bool:
        """True if ``req`` was parked (the caller must not enqueue it)."""
        if not self.enabled or req.rid in self.parked:
            return False
        if getattr(req, "input_embeds", None) is not None or getattr(req, "session", None) is not None:
            return False  # embeddings have no token keys; streaming sessions own their KV row
        ids = req.origin_input_ids
        c = self.rt.chunk_size
        usable = (len(ids) - 1) // c  # always leave the last prompt token to compute
        if usable <= 0:
            return False
        local = self.inst.match(req, len(ids)).device_prefix_len
        local_chunks = local // c
        if local_chunks >= usable:
            return False
        salt = tenant_salt(req.cache_salt, req.extra_key)
        by_codec: dict[str, list[bytes]] = {}
        keys = {}
        for name, path in self.rt.paths.items():
            cname = path.codec.name
            if cname not in by_codec:
                by_codec[cname] = self.rt.keys_for(ids, usable, salt, path.codec)[local_chunks:]
            keys[name] = by_codec[cname]
        p = _Parked(req=req, keys=keys, local_chunks=local_chunks)
        p.lookup = self._lookups.submit(self._count, keys)
        self.parked[req.rid] = p
        return True

    def _count(self, keys: dict[str, list[bytes]]) -> dict[str, int]:
        """Remote chunk count per path (one store round trip per distinct codec). Raises
        ``StoreError`` if a store call failed and no path found anything: an error, not a miss."""
        try:
            seen: dict = {}  # id(keys) -> PrefixLookup
            out = {}
            for name, ks in keys.items():
                if id(ks) not in seen:
                    seen[id(ks)] = self.rt.client.lookup_prefix(ks)
                out[name] = seen[id(ks)].found
            errors = [r.error for r in seen.values() if r.error]
            if errors and not any(out.values()):
                raise StoreError(f"remote KV lookup failed ({errors[0]})")
            return out
        finally:
            self.rt.wakeup.set()

    # -- progress ----------------------------------------------------------------------------------
    def poll(self) -> None:
        """Advance every parked request (scheduler thread, once per scheduling pass)."""
        if self.layerwise is not None:
            self.layerwise.finish_all()  # before any lock release / slot reuse below
        self._release_admitted_locks()
        if self.sync.active:  # TP > 1: every decision agreed by all ranks (tp_sync.py)
            self.sync.poll(self, time.monotonic())
            return
        if self.zombies:
            self._reap_zombies()
        if not self.parked:
            return
        self.rt.wakeup.clear()
        now = time.monotonic()
        for rid in list(self.parked):
            p = self.parked[rid]
            if p.follow is not None:
                self._poll_follower(p, now)
            elif p.handle is None:
                self._poll_lookup(p, now)
            else:
                self._poll_fetch(p, now)

    def _poll_lookup(self, p: _Parked, now: float) -> None:
        assert p.lookup is not None
        if not p.lookup.done():
            if now - p.parked_at > self.rt.settings.lookup_timeout_s:
                p.lookup.cancel()
                self.rt.metrics.lookup("timeout")
                self._release(p)
            return
        failed = p.lookup.exception()  # a store error (or a bug): counted apart from a cold miss
        counts = p.lookup.result() if failed is None else {}
        n = max(counts.values(), default=0)
        self.rt.metrics.lookup("hit" if n else "miss" if failed is None else "error")
        if n == 0 or not self._decide_fetch(p, counts):
            self._release(p)
            return
        self._start_fetch(p, now)

    def _start_fetch(self, p: _Parked, now: float) -> None:
        """``p.path``/``p.remote_chunks`` are chosen: follow an in-flight fetch of the same chunks,
        or submit one (released to recompute if it cannot be submitted). Also used by ``tp_sync``."""
        p.fetch_started = now
        leader = self._inflight_leader(p)
        if leader is not None:  # in-flight dedup: wait for it, then re-match locally
            p.follow = leader.req.rid
            self.rt.metrics.dedup()
            return
        if not self._submit(p):
            self._release(p)
            return
        if p.decision is not None:
            self.rt.policy.fetch_started(p.req.rid, p.decision, p.wire_bytes, now)

    def _inflight_leader(self, p: _Parked) -> _Parked | None:
        """A parked request already fetching this request's first chunk on the same path. Chunk keys
        chain the whole prefix, so equal first keys mean the same tokens from the same chunk on."""
        first = p.keys[p.path][:1]
        for q in self.parked.values():
            if q is not p and q.handle is not None and q.path == p.path and q.keys[q.path][:1] == first:
                return q
        return None

    def _poll_follower(self, p: _Parked, now: float) -> None:
        if p.follow in self.parked:
            if now - p.fetch_started > self.rt.settings.fetch_timeout_s:
                self.rt.metrics.failure("fetch_timeout")
                self._release(p)
            return
        # The leader is installed (its chunks are now device nodes) or failed: start over.
        self.parked.pop(p.req.rid, None)
        if not self.park(p.req):
            self._release_fn(p.req)

    def _decide_fetch(self, p: _Parked, counts: dict[str, int]) -> bool:
        """Policy choice among the paths that have the prefix (sets ``p.path``/``p.remote_chunks``)."""
        c, bpt = self.rt.chunk_size, self.rt.fingerprint.layout.bytes_per_token()
        options, depth = {}, {}
        for name, n in counts.items():
            if n <= 0:
                continue
            raw = n * c * bpt
            # learned wire/decoded ratio of the path; a guess before its first fetch
            wire = self.rt.policy.wire_bytes(
                name, raw, 1.0 if self.rt.paths[name].codec.name == "lossless" else 0.5
            )
            options[name] = (n * c, wire, raw)
            depth[name] = self.rt.paths[name].backend.queue_depth()
        decision = self.rt.policy.decide_among(options, depth)
        self.rt.metrics.decision(decision.path)
        if decision.probe:  # also counted under its path
            self.rt.metrics.decision("probe")
        logger.debug("remote KV decision for %s: %s (counts %s)", p.req.rid, decision, counts)
        if decision.path == "recompute":
            return False
        p.path, p.remote_chunks = decision.path, counts[decision.path]
        p.decision, p.wire_bytes = decision, options[decision.path][1]
        return True

    def _submit(self, p: _Parked) -> bool:
        """Lock the local prefix the fetched chunks extend; reserve slots first for direct backends."""
        start = p.local_chunks * self.rt.chunk_size
        m = self.inst.match(p.req, start)
        if m.device_prefix_len < start:
            self.rt.metrics.failure("local_prefix_evicted")
            return False
        p.prefix_node, p.prefix_lock = m.last_device_node, self.inst.lock(m.last_device_node)
        keys = p.keys[p.path][: p.remote_chunks]
        fetcher = self.rt.paths[p.path].backend
        if getattr(fetcher, "direct", False):
            p.slots = self.inst.alloc(p.remote_chunks * self.rt.chunk_size)
            if p.slots is None:
                self.rt.metrics.failure("no_kv_slots")
                self.inst.unlock(p.prefix_lock)
                return False
            p.handle = fetcher.submit(p.req.rid, keys, start, p.slots)
        else:
            p.handle = fetcher.submit(p.req.rid, keys, start)
        return True

    def _poll_fetch(self, p: _Parked, now: float) -> None:
        h = p.handle
        assert h is not None
        if not h.done():
            if self.layerwise is not None and h.verified.is_set():
                self._admit_early(p, h, now)
                return
            # losing (slower than recompute) or hung: cancel and recompute (policy.estimator docstring)
            verdict = self.rt.policy.check(p.req.rid, h.fetched_bytes, h.fetch_s, now)
            if verdict is not None:
                self.rt.metrics.failure(verdict)
                self.rt.policy.fetch_ended(p.req.rid, censored=True, now=now)
                self._drop(p)
                self._release(p)
            return
        self._complete_fetch(p, h, now)

    # -- release / abort ---------------------------------------------------------------------------
    def _release(self, p: _Parked) -> None:
        self.parked.pop(p.req.rid, None)
        self._release_fn(p.req)

    def _drop(self, p: _Parked) -> None:
        """Give up on a fetch. Reserved slots are freed only once the backend stopped writing them."""
        if p.lookup is not None:
            p.lookup.cancel()
        if p.handle is None:
            return
        self.rt.policy.fetch_ended(p.req.rid)
        p.handle.cancel()
        if p.slots is not None or p.prefix_lock is not None:
            self.zombies.append(p)

    def _reap_zombies(self) -> None:
        keep = []
        for p in self.zombies:
            if p.handle.done():
                self.inst.free(p.slots)
                self.inst.unlock(p.prefix_lock)
            else:
                keep.append(p)
        self.zombies = keep

    def _release_admitted_locks(self) -> None:
        if not self.held:
            return
        waiting = {id(r) for r in self.s.waiting_queue}
        keep = []
        for req, lock in self.held:
            if id(req) in waiting:
                keep.append((req, lock))
            else:
                self.inst.unlock(lock)
        self.held = keep

    def abort(self, rid: str, abort_all: bool) -> None:
        """Cancel matching parked requests and put them in SGLang's waiting queue, where SGLang's own
        ``abort_request`` (which runs right after this) finds and finishes them."""
        for key in list(self.parked):
            if abort_all or key.startswith(rid):
                p = self.parked.pop(key)
                self._drop(p)
                self.rt.metrics.failure("aborted_while_waiting")
                self.s.waiting_queue.append(p.req)

    def wait(self, timeout: float) -> None:
        """Block an otherwise idle scheduler until a worker reports progress (or ``timeout``)."""
        self.rt.wakeup.wait(timeout)
