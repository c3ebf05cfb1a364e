"""The waiting_for_KV queue: requests whose prefix may be in the remote tier wait here, not in the
engine's waiting queue, while their chunks are looked up, fetched and decoded. States: ``parked.py``.

Three operations, all on the scheduler thread (store I/O and decoding run on worker threads):

- ``park(req)`` (a new request): match the prompt against the local tree (no I/O). If it has full chunks
  (or tail sub-chunks) beyond the local hit (always leaving the last prompt token to compute), park it in
  LOOKUP and count, on a worker, the tokens the store holds: leading full chunks, then the tail sub-chunks
  of the first chunk region it lacks. Otherwise the caller enqueues it normally.
- ``poll()`` (every scheduling pass): **observe → agree → act**. Every record is observed on local facts
  only (lookup answered? rows waited for too long? fetch done, verified, losing against recompute?), the TP
  ranks agree on every observation (``agreement.py``; the identity with one rank) and every record acts
  on the agreed verdict only. There is no other poll loop.
- ``abort(rid, abort_all)``: cancel matching records' fetches and hand the requests to the engine's own
  abort path.

Rows (admission without starvation; ``TreeOps.alloc``: host staging rows in the server, never SGLang's KV
slots, which SGLang allocates itself in the linker's ``load``): a record that chose to fetch reserves the
rows of its fetched span *before* fetching (RESERVE → FETCH), so staging never fails for lack of rows. Only
the oldest RESERVE record may reserve (FIFO: a large request is not overtaken forever by small ones); when
staging cannot give the rows it backs off and retries next pass, and after ``slot_wait_s`` it recomputes
(``failures{kind="no_staging_rows"}``). The queue holds at most ``max_pool_fraction`` of
``TreeOps.capacity()`` (rows reserved for fetches, dropped fetches not yet reaped, and staged hits not yet
admitted; the server sets 1: the whole staging area); a fetch larger than that is trimmed to its leading
chunks.

Releasing a request = the engine's original enqueue: its ``match_prefix`` then finds the fetched prefix
staged (the linker's ``lookup``) and SGLang loads it. Nothing is promised to the engine before the KV is
verified and decoded into staging (layer-wise: verified; the load then waits per layer). Requests without a
remote hit never wait on a fetching one.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time

from sgl_remote_kv.admission.agreement import MISS, NEUTRAL, PENDING, Verdict, choice_of, ready, row
from sgl_remote_kv.admission.install import Installer
from sgl_remote_kv.admission.parked import ParkedRequest, Phase
from sgl_remote_kv.admission.plan import FetchPlanner
from sgl_remote_kv.admission.ports import AdmissionSettings, Collaborators
from sgl_remote_kv.types import LOOKUP_RESULTS, FailureKind, KVFidelity, PathName

logger = logging.getLogger(__name__)

_CENSORED = (FailureKind.ABANDONED.value, FailureKind.FETCH_TIMEOUT.value)


def exact_outcome(local: int, fetch_end: int, prompt_len: int) -> str:
    """``exact_requests_total``'s outcome of an exact request that is not parked: ``local_hit`` when the
    local radix cache served the prompt up to what a remote hit could have (``local >= fetch_end``, the
    planner's ``fetch_end``: every full chunk and tail sub-chunk of the prompt) -- or, for a prompt too
    short for the tier to hold any of it (``fetch_end`` 0), at least half of it --; else ``recompute``:
    a match of a few leading tokens (a chat template's 2-12) still leaves the bulk to compute."""
    if local <= 0:
        return "recompute"
    reach = fetch_end if fetch_end > 0 else -(-prompt_len // 2)
    return "local_hit" if local >= reach else "recompute"


class WaitingForKV:
    """See module docstring."""

    def __init__(self, c: Collaborators, settings: AdmissionSettings) -> None:
        self.c, self.s = c, settings
        self.parked: dict[str, ParkedRequest] = {}  # park order = FIFO order, the same on every TP rank
        self.zombies: list[ParkedRequest] = []
        self.held: list[tuple[object, object, int]] = []  # (req, lock, rows staged) until admitted
        self._io = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="srkv-lookup")
        self.installer = Installer(c, settings.chunk_size, self._io)
        self.budget = int(c.tree.capacity() * settings.max_pool_fraction)  # rows this queue may hold
        self.planner = FetchPlanner(c, settings, self.budget)
        # KVFidelity.EXACT requests fetch on these paths only; while any path installs lossy KV into the
        # local tree, they also get a radix namespace of their own (``HostOps.isolate_exact``)
        self.exact_paths = {name: path for name, path in c.paths.items() if path.codec.exact}
        self.lossy_installs = len(self.exact_paths) < len(c.paths)

    # -- park --------------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.parked or self.zombies or (self.c.layerwise and self.c.layerwise.busy()))

    def park(self, req, parked_at: float | None = None) -> bool:
        """True if ``req`` was parked (the caller must not enqueue it)."""
        host, chunk = self.c.host, self.s.chunk_size
        paths = self.c.paths
        exact = host.fidelity(req) is KVFidelity.EXACT
        if exact:
            paths = self.exact_paths
            if self.lossy_installs:  # before any match: the request's radix keys change
                host.isolate_exact(req)
        count_exact = exact and parked_at is None  # once per request: not again for a re-parked follower
        rid = host.rid(req)
        if rid in self.parked:
            return False
        if not host.eligible(req):
            if count_exact:
                self.c.metrics.exact_request("recompute")  # no token prefix to reuse
            return False
        ids = host.prompt(req)
        local = self.c.tree.match(req, len(ids)).prefix_len
        end = self.planner.fetch_end(len(ids))
        if not paths or end <= local:
            # nothing beyond the local hit could come from the store (or no exact path may bring it)
            if count_exact:
                self.c.metrics.exact_request(exact_outcome(local, end, len(ids)))
            return False
        if count_exact:
            self.c.metrics.exact_request("exact_path")
        salt = host.salt(req)
        chain = self.planner.chains(ids, salt, paths)
        now = time.monotonic()
        # a re-parked follower keeps its first park time (bounded waits)
        p = ParkedRequest(req, rid, chain, local // chunk, parked_at if parked_at is not None else now, now)
        p.lookup = self._io.submit(self.planner.count, ids, salt, p.local_chunks, chain)
        self.parked[rid] = p
        return True

    # -- poll: observe -> agree -> act ----------------------------------------------------------------
    def poll(self) -> None:
        if self.c.layerwise is not None:
            self.c.layerwise.finish_all()  # before any lock release / row reuse below
        self._release_admitted_locks()
        records, zombies = list(self.parked.values()), list(self.zombies)
        if not records and not zombies:
            return  # idle: no collective
        self.c.wakeup.clear()
        now = time.monotonic()
        head = self._reserve_head()
        entries = [(f"{p.rid}:{p.phase.value}", self._observe(p, now, p is head)) for p in records]
        entries += [(f"zombie:{z.rid}", row(ready(1) if z.handle.done() else PENDING)) for z in zombies]
        verdicts = self.c.agreement.agree(entries)
        for z, v in zip(zombies, verdicts[len(records) :], strict=True):
            if not v.pending:  # every rank's backend stopped writing the dropped fetch's rows
                self._free(z)
                self.zombies.remove(z)
        for p, v in zip(records, verdicts[: len(records)], strict=True):
            if self.parked.get(p.rid) is p and (not v.pending or v.early):
                self._act(p, v, now)

    def _observe(self, p: ParkedRequest, now: float, head: bool) -> Verdict:
        """This rank's local facts about ``p`` (no effect on the tree, the staging or the engine)."""
        p.miss_reason = None
        age = now - p.since
        if p.phase is Phase.LOOKUP:
            return self._observe_lookup(p, age)
        if p.phase is Phase.FOLLOW:
            if p.leader not in self.parked:
                return row(ready(1))  # the leader installed or failed: re-park
            return row(self._miss(p, FailureKind.FETCH_TIMEOUT) if age > self.s.fetch_timeout_s else PENDING)
        if p.phase is Phase.RESERVE:
            if age > self.s.slot_wait_s:
                return row(self._miss(p, FailureKind.NO_STAGING_ROWS))
            return row(ready(1) if head else PENDING)  # only the FIFO head tries to reserve
        h = p.handle  # FETCH
        if h.done():  # ready(0) would read as PENDING: a fetch that got nothing is a miss
            return row(ready(h.ok_chunks) if h.ok_tokens > 0 else self._miss(p, h.failure or "empty"))
        verdict = self.c.policy.check(p.rid, h.fetched_bytes, h.fetch_s, now)  # losing or hung
        if verdict is None and age > self.s.fetch_timeout_s:
            verdict = FailureKind.FETCH_TIMEOUT
        if verdict is not None:
            return row(self._miss(p, verdict))
        return row(PENDING, early=self.c.layerwise is not None and h.verified.is_set())

    def _observe_lookup(self, p: ParkedRequest, age: float) -> Verdict:
        f = p.lookup
        if not f.done():
            return row(self._miss(p, "timeout") if age > self.s.lookup_timeout_s else PENDING)
        failed = f.exception()  # a store error (or a bug): counted apart from a cold miss
        counts = f.result() if failed is None else {}
        if max(counts.values(), default=0) <= 0:
            return row(self._miss(p, "error" if failed is not None else "miss"))
        if p.choice is None:  # every rank runs its policy once (estimates, probes, metrics)
            p.choice = choice_of(self._decide(p, counts))
        return row(ready(1), choice=p.choice if self.c.agreement.rank == 0 else NEUTRAL, counts=counts)

    @staticmethod
    def _miss(p: ParkedRequest, why) -> int:
        p.miss_reason = why.value if isinstance(why, FailureKind) else str(why)
        return MISS

    def _act(self, p: ParkedRequest, v: Verdict, now: float) -> None:
        """Apply the agreed verdict (identical on every rank)."""
        why = p.miss_reason or FailureKind.TP_PEER_MISS.value  # a miss another rank saw
        if p.phase is Phase.LOOKUP:
            self._act_lookup(p, v, now, why)
        elif p.phase is Phase.FOLLOW:
            if v.miss:
                self.c.metrics.failure(why)
                self._release(p)
            else:
                self._repark(p)
        elif p.phase is Phase.RESERVE:
            if v.miss:
                self.c.metrics.failure(why)
                self._release(p)
            else:
                self._reserve(p, now)
        elif v.miss:  # FETCH
            # The same steps on every rank, whatever its own fetch's state: a rank whose fetch already
            # ended must still keep a zombie for the reserved rows, or the ranks' zombie lists (and
            # with them the collectives of the next passes) would differ.
            if p.handle.done():  # nothing usable here (counted by ``account``), or a peer missed
                self.installer.account(p)
                if why == FailureKind.TP_PEER_MISS.value:
                    self.c.metrics.failure(why)
            else:
                self.c.metrics.failure(why)
                self.c.policy.fetch_ended(p.rid, censored=why in _CENSORED, now=now)
            self._drop(p)
            self._release(p)
        elif v.pending:  # every rank verified every chunk: layer-wise admission everywhere
            held = self.installer.admit_early(p, now)
            if held is not None:
                self._finish(p, held)
        else:
            self._finish(p, self.installer.complete(p, v.n))

    def _act_lookup(self, p: ParkedRequest, v: Verdict, now: float, why: str) -> None:
        m = self.c.metrics
        if v.miss:
            p.lookup.cancel()
            if why == FailureKind.TP_PEER_MISS.value:  # this rank had the chunks, another one did not
                m.failure(why)
            m.lookup(why if why in LOOKUP_RESULTS else "miss")
            self._release(p)
            return
        m.lookup("hit")
        path = v.path
        tokens = v.count(path) if path is not None else 0
        if tokens <= 0:  # rank 0 chose recompute, or some rank lacks the chosen path's chunks
            self._release(p)
            return
        if p.path is not path:  # this rank's own estimate was for another choice
            p.decision = None
        p.path = path
        if not self.planner.plan(p, tokens):
            m.failure(FailureKind.NO_STAGING_ROWS)
            self._release(p)
            return
        leader = self._leader(p)
        if leader is not None:  # in-flight dedup: wait for it, then re-match locally
            p.leader = leader.rid
            p.enter(Phase.FOLLOW, now)
            m.dedup()
            return
        p.enter(Phase.RESERVE, now)
        self._reserve(p, now)

    # -- decisions ---------------------------------------------------------------------------------
    def _decide(self, p: ParkedRequest, counts: dict[PathName, int]) -> PathName | None:
        """The policy's choice among the paths that have the prefix (``counts``: tokens found per path;
        None: recompute). Sets the record's path and estimates."""
        c = self.c
        options, depth = {}, {}
        for name, tokens in counts.items():
            if tokens <= 0:
                continue
            raw = tokens * c.bytes_per_token
            # learned wire/decoded ratio of the path; a guess before its first fetch
            guess = 1.0 if c.paths[name].codec.name == "lossless" else 0.5
            options[name.value] = (tokens, c.policy.wire_bytes(name.value, raw, guess), raw)
            depth[name.value] = c.paths[name].backend.queue_depth()
        decision = c.policy.decide_among(options, depth)
        c.metrics.decision(decision.path)
        if decision.probe:  # also counted under its path
            c.metrics.decision("probe")
        logger.debug("remote KV decision for %s: %s (counts %s)", p.rid, decision, counts)
        if decision.path == "recompute":
            return None
        path = PathName(decision.path)
        p.path = path
        p.decision, p.wire_bytes = decision, options[path.value][1]
        return path

    def _leader(self, p: ParkedRequest) -> ParkedRequest | None:
        """A record about to fetch or fetching this record's first chunk on the same path. Chunk keys
        chain the whole prefix, so equal first keys mean the same tokens from the same chunk on."""
        first = p.fetch_keys[:1]
        for q in self.parked.values():
            if q is not p and q.phase in (Phase.RESERVE, Phase.FETCH) and q.path is p.path:
                if q.fetch_keys[:1] == first:
                    return q
        return None

    def _reserve_head(self) -> ParkedRequest | None:
        return next((p for p in self.parked.values() if p.phase is Phase.RESERVE), None)

    def held_rows(self) -> int:
        """Rows the queue holds: reserved for fetches (and dropped ones) plus staged hits that the
        engine has not admitted yet."""
        recs = [*self.parked.values(), *self.zombies]
        return sum(len(p.rows) for p in recs if p.rows is not None) + sum(n for *_, n in self.held)

    # -- RESERVE -> FETCH --------------------------------------------------------------------------
    def _reserve(self, p: ParkedRequest, now: float) -> None:
        """The FIFO head tries to reserve its rows and submit its fetch; otherwise it waits."""
        if self._reserve_head() is not p:
            return
        c, chunk = self.c, self.s.chunk_size
        need = sum(p.fetch_tokens)
        if self.held_rows() + need > self.budget:
            return  # back off: the queue's share of the rows is in use
        start = p.local_chunks * chunk
        m = c.tree.match(p.req, start)
        if m.prefix_len < start:
            c.metrics.failure(FailureKind.LOCAL_PREFIX_EVICTED)
            self._release(p)
            return
        # hold the prefix the fetched span continues until it is staged: SGLang's eviction must not take
        # the device prefix, nor a last release the staged pages after it (``StagedTree.lock``)
        lock = c.tree.lock(m.node)
        rows = c.tree.alloc(need)
        if rows is None:
            c.tree.unlock(lock)
            return  # back off: every staging row is reserved or staged; retried next pass
        p.prefix_node, p.prefix_lock, p.rows = m.node, lock, rows
        if now - p.since > 0:
            c.metrics.slot_wait(now - p.since)
        try:
            p.handle = c.paths[p.path].backend.submit(p.rid, p.fetch_keys, start, rows, p.fetch_tokens)
        except Exception as e:  # boundary: a backend that cannot take the job is a miss
            c.metrics.failure(FailureKind.INTERNAL)
            logger.warning("remote KV fetch submit for %s failed: %r", p.rid, e)
            self._free(p)
            self._release(p)
            return
        p.enter(Phase.FETCH, now)
        if p.decision is not None:
            c.policy.fetch_started(p.rid, p.decision, p.wire_bytes, now)

    # -- leaving the queue -------------------------------------------------------------------------
    def _finish(self, p: ParkedRequest, held: tuple[object, int] | None) -> None:
        if held is not None:
            self.held.append((p.req, *held))
        self._release(p)

    def _release(self, p: ParkedRequest) -> None:
        self.parked.pop(p.rid, None)
        self.c.host.release(p.req)

    def _repark(self, p: ParkedRequest) -> None:
        """The leader installed (its chunks are device nodes now) or failed: start over."""
        self.parked.pop(p.rid, None)
        if not self.park(p.req, parked_at=p.parked_at):
            self.c.host.release(p.req)

    def _drop(self, p: ParkedRequest) -> None:
        """Give up on a record. Reserved rows are freed only once the backend stopped writing them."""
        if p.lookup is not None:
            p.lookup.cancel()
        if p.handle is None:
            return
        self.c.policy.fetch_ended(p.rid)
        p.handle.cancel()
        if p.rows is not None or p.prefix_lock is not None:
            p.enter(Phase.ZOMBIE, time.monotonic())
            self.zombies.append(p)

    def _free(self, p: ParkedRequest) -> None:
        self.c.tree.free(p.rows)
        self.c.tree.unlock(p.prefix_lock)
        p.rows = p.prefix_lock = None

    def _release_admitted_locks(self) -> None:
        if not self.held:
            return
        waiting = self.c.host.waiting()
        keep = []
        for req, lock, n in self.held:
            if id(req) in waiting:
                keep.append((req, lock, n))
            else:
                self.c.tree.unlock(lock)
        self.held = keep

    def abort(self, rid: str, abort_all: bool) -> None:
        """Cancel matching records and hand their requests to the engine's abort path (which runs right
        after this and finds them there)."""
        for key in list(self.parked):
            if abort_all or key.startswith(rid):
                p = self.parked.pop(key)
                self._drop(p)
                self.c.metrics.failure(FailureKind.ABORTED_WHILE_WAITING)
                self.c.host.hand_to_abort(p.req)

    def wait(self) -> None:
        """Block an otherwise idle scheduler until a worker reports progress (or ``idle_wait_s``)."""
        self.c.wakeup.wait(self.s.idle_wait_s)

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
