"""TP rank agreement for the waiting_for_KV queue (TP > 1).

With tensor parallelism every TP rank runs its own scheduler, radix tree and ``WaitingForKV`` on its
own shard of the KV, stored under its own keys (the fingerprint carries ``tp_rank``/``tp_size``).
SGLang requires every rank to build the same batch, and its radix trees and KV allocators stay
identical only because every rank applies the same operations. Lookups, fetch completions, partial
fetches, timeouts and policy estimates are per rank, so no decision may be taken on local facts.

Why the parked set is the same on every rank: rank 0 pulls requests from the tokenizer and
``SchedulerRequestReceiver._broadcast_reqs_across_ranks`` broadcasts them over the TP CPU group
(``dp_tp_cpu_group``: the attention-TP group with DP attention, else the whole TP group) every loop
iteration; ``_add_request_to_queue`` (our ``park``) then sees the same requests in the same order and
matches them against identical trees, and aborts ride the same broadcast. Every removal from the
parked set below is agreed, so the set stays identical; a digest of it is checked every pass.

Protocol (scheduler thread, once per scheduling pass, from ``WaitingForKV.poll``, which SGLang calls
once per ``get_next_batch_to_run`` on every rank):

1. every rank encodes what it *observes* for every parked request (in rid order) and every zombie
   fetch (list order) as one int64 row ``[code, early, choice, count per path ...]``;
2. one all-reduce MIN of all rows over the TP CPU group (gloo) — none while nothing is parked or
   dropped, and no collective at all when ``tp_size == 1`` (the queue then keeps its own handlers);
3. every rank acts on the agreed rows only.

``code``: ``MISS = 0 < PENDING = 1 < READY(n) = 1 + n``. MIN therefore means: a miss, failure or
timeout on any rank is a miss on all ranks in the same pass; otherwise any pending rank keeps the
request waiting everywhere; otherwise all ranks install the same ``min(n)`` chunks (a rank that got
more frees the rest). Timeouts are time based, hence per rank, and only ever act through this code.
``choice`` is the policy's decision of rank 0 (``0`` = recompute, ``i + 1`` = ``PATH_NAMES[i]``); the
other ranks send ``NEUTRAL``, so MIN is a broadcast from rank 0 inside the same all-reduce.
``early`` (layer-wise admission) is 1 only while a rank's fetch is verified but not finished, so it
is agreed only if every rank can admit early.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MISS, PENDING = 0, 1
NEUTRAL = 2**62  # "no opinion": larger than any real value, so it never wins a MIN
PATH_NAMES = ("dpu", "inproc", "nvdec")  # fixed column order on every rank (a rank may lack a path)
_HEAD = 3  # code, early, choice


def ready(n: int) -> int:
    return 1 + n


@dataclass(frozen=True)
class Verdict:
    """The agreed row of one parked request or zombie fetch."""

    code: int
    early: bool
    choice: int
    counts: tuple[int, ...]

    @property
    def pending(self) -> bool:
        return self.code == PENDING

    @property
    def miss(self) -> bool:
        return self.code == MISS

    @property
    def chunks(self) -> int:
        return max(0, self.code - 1)

    @property
    def path(self) -> str | None:
        """Rank 0's decision: a path name, or None for recompute (or no decision sent)."""
        return PATH_NAMES[self.choice - 1] if 0 < self.choice <= len(PATH_NAMES) else None

    def count(self, path: str) -> int:
        c = self.counts[PATH_NAMES.index(path)]
        return 0 if c >= NEUTRAL else c


def row(code: int, early: int = 0, choice: int = NEUTRAL, counts: dict[str, int] | None = None) -> list[int]:
    cols = [NEUTRAL] * len(PATH_NAMES) if counts is None else [int(counts.get(n, 0)) for n in PATH_NAMES]
    return [code, early, choice, *cols]


def _digest(keys: list[str]) -> int:
    h = hashlib.blake2b("\n".join(keys).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2  # < 2**62


class Agreement:
    """MIN all-reduce of int64 rows over the TP CPU group; the identity without a collective when
    ``size == 1``. ``collectives`` counts the all-reduces issued (tests, debugging)."""

    def __init__(self, group=None, rank: int = 0, size: int = 1) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.collectives = 0
        self.divergences = 0

    @property
    def active(self) -> bool:
        return self.size > 1

    @classmethod
    def for_scheduler(cls, scheduler) -> Agreement:
        """The group of ranks sharing this scheduler's waiting queue (SGLang's ``dp_tp_cpu_group``)."""
        group = getattr(scheduler, "dp_tp_cpu_group", None)
        if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return cls()
        size = torch.distributed.get_world_size(group=group)
        if size <= 1:
            return cls()
        return cls(group, torch.distributed.get_rank(group=group), size)

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        if self.size <= 1:
            return rows
        torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        return rows

    def agree(self, entries: list[tuple[str, list[int]]]) -> list[Verdict]:
        """Agree on ``entries`` (key, local row), in the given order, which must be the same on every
        rank. One collective when ``entries`` is non-empty and ``size > 1``; none otherwise. A header
        row carries a digest of the keys (and its negation): MIN of both tells whether all ranks sent
        the same keys; a mismatch is logged and counted (it would mean the TP ranks diverged)."""
        if not entries:
            return []
        width = _HEAD + len(PATH_NAMES)
        d = _digest([k for k, _ in entries])
        t = torch.tensor([[d, -d] + [NEUTRAL] * (width - 2)] + [r for _, r in entries], dtype=torch.int64)
        t = self.reduce(t)
        if int(t[0, 0]) != -int(t[0, 1]):
            self.divergences += 1
            logger.error("remote KV: TP ranks disagree on the parked set (digest mismatch); pass %d",
                         self.collectives)  # fmt: skip
        return [
            Verdict(int(r[0]), int(r[1]) == 1, int(r[2]), tuple(int(x) for x in r[_HEAD:])) for r in t[1:]
        ]


class TPQueue:
    """The TP > 1 poll of a ``WaitingForKV``: observe, agree (one collective), act. Scheduler thread.

    It reuses the queue's building blocks (``_decide_fetch``, ``_start_fetch``, ``_drop``,
    ``_release``; ``_admit_early`` and ``_complete_fetch`` from ``completion.py``) and mirrors its
    per-request handlers, with every local fact replaced by the agreed one. With ``tp_size == 1`` it is never used.
    """

    def __init__(self, agreement: Agreement) -> None:
        self.ag = agreement
        self._choice: dict[str, int] = {}  # rid -> this rank's policy choice, made once per lookup
        self._why: dict[str, str] = {}  # rid -> this rank's own reason for a miss (metrics)

    @property
    def active(self) -> bool:
        return self.ag.active

    # -- one pass ------------------------------------------------------------------------------
    def poll(self, q, now: float) -> None:
        rids = sorted(q.parked)
        entries = [(f"{rid}:{_phase(q.parked[rid])}", self._observe(q, q.parked[rid], now)) for rid in rids]
        zombies = list(q.zombies)
        entries += [(f"zombie:{z.req.rid}", row(ready(1) if z.handle.done() else PENDING)) for z in zombies]
        if not entries:
            return  # idle: no collective
        verdicts = self.ag.agree(entries)
        self._reap(q, zombies, verdicts[len(rids) :])
        q.rt.wakeup.clear()
        for rid, v in zip(rids, verdicts[: len(rids)], strict=True):
            p = q.parked.get(rid)
            if p is not None and (not v.pending or v.early):
                self._act(q, p, v, now)
        for notes in (self._choice, self._why):  # requests aborted while parked
            for rid in [r for r in notes if r not in q.parked]:
                del notes[rid]

    def _reap(self, q, zombies: list, verdicts: list[Verdict]) -> None:
        """Free a dropped fetch's slots only once every rank's backend stopped writing them."""
        done = {id(z) for z, v in zip(zombies, verdicts, strict=True) if not v.pending}
        for z in zombies:
            if id(z) in done:
                q.inst.free(z.slots)
                q.inst.unlock(z.prefix_lock)
        q.zombies = [z for z in q.zombies if id(z) not in done]

    # -- observe (local facts only, no effect on SGLang state) -------------------------------------
    def _observe(self, q, p, now: float) -> list[int]:
        if p.follow is not None:
            if p.follow not in q.parked:
                return row(ready(1))  # the leader installed or failed: re-park
            return row(self._miss(p, "fetch_timeout") if self._fetch_expired(q, p, now) else PENDING)
        if p.handle is None:
            return self._observe_lookup(q, p, now)
        h = p.handle
        if h.done():
            return row(ready(h.ok_chunks) if h.ok_tokens > 0 else self._miss(p, h.failure or "empty"))
        if self._fetch_expired(q, p, now):
            return row(MISS)
        early = q.layerwise is not None and h.verified.is_set()
        return row(PENDING, early=int(early))

    def _observe_lookup(self, q, p, now: float) -> list[int]:
        f = p.lookup
        if not f.done():
            late = now - p.parked_at > q.rt.settings.lookup_timeout_s
            return row(self._miss(p, "timeout") if late else PENDING)
        failed = f.exception()
        counts = f.result() if failed is None else {}
        if max(counts.values(), default=0) <= 0:
            return row(self._miss(p, "error" if failed is not None else "miss"))
        rid = p.req.rid
        if rid not in self._choice:  # every rank runs its policy once (estimates, probes, metrics)
            self._choice[rid] = PATH_NAMES.index(p.path) + 1 if q._decide_fetch(p, counts) else 0
        choice = self._choice[rid] if self.ag.rank == 0 else NEUTRAL
        return row(ready(1), choice=choice, counts=counts)

    def _fetch_expired(self, q, p, now: float) -> bool:
        """Losing against recompute / hung (the policy's rule), or past the glue's hard cap."""
        h = p.handle
        kind = None
        if h is not None:
            kind = q.rt.policy.check(p.req.rid, h.fetched_bytes, h.fetch_s, now)
        if kind is None and now - p.fetch_started > q.rt.settings.fetch_timeout_s:
            kind = "fetch_timeout"
        if kind is not None:
            self._miss(p, kind)
        return kind is not None

    def _miss(self, p, why: str) -> int:
        self._why[p.req.rid] = why
        return MISS

    # -- act (agreed facts only; identical on every rank) ------------------------------------------
    def _act(self, q, p, v: Verdict, now: float) -> None:
        rid = p.req.rid
        why = self._why.pop(rid, "tp_peer_miss")  # a miss another rank saw
        if p.follow is not None:
            self._act_follower(q, p, v, why)
        elif p.handle is None:
            self._choice.pop(rid, None)
            self._act_lookup(q, p, v, now, why)
        elif v.miss:
            q.rt.metrics.failure(why)
            q.rt.policy.fetch_ended(rid, censored=why in ("abandoned", "fetch_timeout"), now=now)
            q._drop(p)
            q._release(p)
        elif v.pending:  # every rank verified every chunk: layer-wise admission everywhere
            q._admit_early(p, p.handle, now)
        else:
            self._finish(q, p, v.chunks, now)

    def _act_follower(self, q, p, v: Verdict, why: str) -> None:
        if v.miss:
            q.rt.metrics.failure(why)
            q._release(p)
            return
        q.parked.pop(p.req.rid, None)  # same as WaitingForKV._poll_follower: start over
        if not q.park(p.req):
            q._release_fn(p.req)

    def _act_lookup(self, q, p, v: Verdict, now: float, why: str) -> None:
        if v.miss:
            p.lookup.cancel()
            if why == "tp_peer_miss":  # this rank had the chunks, another one did not
                q.rt.metrics.failure(why)
            q.rt.metrics.lookup(why if why in ("timeout", "error", "miss") else "miss")
            q._release(p)
            return
        q.rt.metrics.lookup("hit")
        path = v.path
        n = v.count(path) if path is not None else 0
        if n <= 0:  # rank 0 chose recompute, or some rank lacks the chosen path's chunks
            q._release(p)
            return
        if p.path != path:  # this rank's own estimate was for another choice
            p.decision = None
        p.path, p.remote_chunks = path, n
        q._start_fetch(p, now)

    def _finish(self, q, p, n: int, now: float) -> None:
        """Every rank's fetch finished with >= ``n`` intact chunks: install exactly ``n`` chunks."""
        q._complete_fetch(p, p.handle, now, agreed=n)


def _phase(p) -> str:
    return "follow" if p.follow is not None else "lookup" if p.handle is None else "fetch"


def for_scheduler(scheduler) -> TPQueue:
    return TPQueue(Agreement.for_scheduler(scheduler))


SINGLE = TPQueue(Agreement())  # tp_size == 1: inactive, the queue keeps its own handlers
