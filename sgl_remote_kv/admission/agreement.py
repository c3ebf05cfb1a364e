"""The agree step of every poll: TP ranks take each decision together (the identity at TP = 1).

With tensor parallelism every TP rank runs its own scheduler, radix tree and waiting_for_KV queue on its
own shard of the KV, stored under its own keys (the fingerprint carries ``tp_rank``/``tp_size``). SGLang
requires every rank to build the same batch, and its radix trees and KV allocators stay identical only
because every rank applies the same operations. Lookups, fetch completions, partial fetches, timeouts
and policy estimates are per rank, so no decision may be taken on local facts.

Why the parked set is the same on every rank: rank 0 pulls requests from the tokenizer and SGLang
broadcasts them over the TP CPU group every loop iteration; the park hook then sees the same requests in
the same order and matches them against identical trees, and aborts ride the same broadcast. Every
removal from the parked set is agreed, so the set stays identical; a digest of it is checked every pass.

Protocol (scheduler thread, once per poll, on every rank): every rank encodes what it *observes* for
every parked request and zombie fetch (queue order) as one int64 row ``[code, early, choice, count per
path ...]``; one all-reduce MIN of all rows over the TP CPU group (gloo) — none while the queue is empty,
and no collective at all with one rank; every rank acts on the agreed rows only.

``code``: ``MISS = 0 < PENDING = 1 < READY(n) = 1 + n``. MIN therefore means: a miss, failure or timeout
on any rank is a miss on all ranks in the same pass; otherwise any pending rank keeps the request waiting
everywhere; otherwise all ranks act on the same ``min(n)``. Timeouts are time based, hence per rank, and
only ever act through this code. ``choice`` is rank 0's policy decision (``0`` = recompute, ``i + 1`` =
the i-th ``PathName``); other ranks send ``NEUTRAL``, so MIN is a broadcast from rank 0 inside the same
all-reduce. ``early`` (layer-wise admission) is 1 only while a rank's fetch is verified but not finished,
so it holds only if every rank can admit early.

SGLang-independent (torch.distributed only); the TP group comes from the SGLang seam.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from sgl_remote_kv.types import PathName

logger = logging.getLogger(__name__)

MISS, PENDING = 0, 1
NEUTRAL = 2**62  # "no opinion": larger than any real value, so it never wins a MIN
PATHS = tuple(PathName)  # fixed column order on every rank (a rank may lack a path)
_HEAD = 3  # code, early, choice


def ready(n: int) -> int:
    return 1 + n


@dataclass(frozen=True)
class Verdict:
    """The agreed row of one parked request or zombie fetch."""

    code: int
    early: bool = False
    choice: int = NEUTRAL
    counts: tuple[int, ...] = (NEUTRAL,) * len(PATHS)

    @property
    def pending(self) -> bool:
        return self.code == PENDING

    @property
    def miss(self) -> bool:
        return self.code == MISS

    @property
    def n(self) -> int:
        """The agreed count of a ``READY(n)`` row."""
        return max(0, self.code - 1)

    @property
    def path(self) -> PathName | None:
        """Rank 0's decision: a path, or None for recompute (or no decision sent)."""
        return PATHS[self.choice - 1] if 0 < self.choice <= len(PATHS) else None

    def count(self, path: PathName) -> int:
        c = self.counts[PATHS.index(path)]
        return 0 if c >= NEUTRAL else c


def row(code: int, early: bool = False, choice: int = NEUTRAL, counts: dict | None = None) -> Verdict:
    """One rank's observation, in the agreed row's shape (``counts``: path -> chunks in the store)."""
    cols = (NEUTRAL,) * len(PATHS) if counts is None else tuple(int(counts.get(p, 0)) for p in PATHS)
    return Verdict(code, bool(early), choice, cols)


def choice_of(path: PathName | None) -> int:
    return 0 if path is None else PATHS.index(path) + 1


def _digest(keys: list[str]) -> int:
    h = hashlib.blake2b("\n".join(keys).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2  # < 2**62


class Agreement:
    """MIN all-reduce of observations over the TP CPU group; the identity, without any tensor or
    collective, when ``size == 1``. ``collectives`` counts the all-reduces issued (tests, debugging)."""

    def __init__(self, group=None, rank: int = 0, size: int = 1) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.collectives = 0
        self.divergences = 0

    @property
    def active(self) -> bool:
        return self.size > 1

    @classmethod
    def over(cls, group) -> Agreement:
        """The agreement among the ranks of ``group`` (a torch.distributed CPU group, or None)."""
        if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return cls()
        size = torch.distributed.get_world_size(group=group)
        if size <= 1:
            return cls()
        return cls(group, torch.distributed.get_rank(group=group), size)

    def agree(self, entries: list[tuple[str, Verdict]]) -> list[Verdict]:
        """Agree on ``entries`` (key, this rank's observation), in an order that must be the same on
        every rank. One collective when ``entries`` is non-empty and ``size > 1``; none otherwise. A
        header row carries a digest of the keys (and its negation): MIN of both tells whether all ranks
        sent the same keys; a mismatch is logged and counted (it would mean the TP ranks diverged)."""
        if not entries or self.size <= 1:
            return [v for _, v in entries]
        width = _HEAD + len(PATHS)
        d = _digest([k for k, _ in entries])
        rows = [[d, -d] + [NEUTRAL] * (width - 2)]
        rows += [[v.code, int(v.early), v.choice, *v.counts] for _, v in entries]
        t = torch.tensor(rows, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        if int(t[0, 0]) != -int(t[0, 1]):
            self.divergences += 1
            logger.error(
                "remote KV: TP ranks disagree on the parked set (digest mismatch); pass %d", self.collectives
            )
        return [
            Verdict(int(r[0]), int(r[1]) == 1, int(r[2]), tuple(int(x) for x in r[_HEAD:])) for r in t[1:]
        ]
