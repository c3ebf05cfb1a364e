"""A request waiting for its remote KV: one record, one explicit phase.

::

    park ──> LOOKUP ──miss/error/timeout──────────────────────────────> released (recompute)
               │ hit, policy chose a path
               ├──same chunks already being fetched──> FOLLOW ──leader gone──> re-parked (local hit)
               v
            RESERVE ──no staging rows within slot_wait_s──────────────> released (recompute)
               │ rows reserved (FIFO: only the oldest RESERVE request tries)
               v
             FETCH ──done──> rows staged (page hashes) ───────────────> released (SGLang loads them)
               │  └─verified (layer-wise)──> staged early ────────────> released (loaded per layer)
               └──losing / hung / aborted──> ZOMBIE ──backend stopped──> rows freed

Words: *rows* are host staging rows (``kvpool/staged.py``, through ``TreeOps.alloc`` in the server:
``staged_tree.StagedTree``; ``rows``: reserved by this queue, owned by it until ``insert`` stages them).
SGLang allocates its own KV slots later, in the linker's ``load``, and the queue never sees them; the
DPU's destination-region slots and staging buffers belong to the fetch backends and never appear here.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from enum import Enum

from sgl_remote_kv.types import PathName


class Phase(Enum):
    LOOKUP = "lookup"  # counting the request's chunks in the store (worker thread)
    FOLLOW = "follow"  # waiting on another parked request fetching the same chunks
    RESERVE = "reserve"  # the policy chose a path; waiting (FIFO, bounded) for staging rows
    FETCH = "fetch"  # fetching into the reserved staging rows
    ZOMBIE = "zombie"  # dropped; the backend may still write its rows (freed once it stopped)


@dataclass(eq=False)
class ParkedRequest:
    req: object  # SGLang's request (read only through the seam)
    rid: str
    chain: dict[PathName, list[bytes]]  # per fetch path: keys of the prompt's full chunks [0, usable)
    local_chunks: int  # full chunks already in the local tree when parked (the fetch starts after them)
    parked_at: float  # monotonic time of the first park (kept when a follower re-parks)
    since: float  # monotonic time the current phase began
    lookup: cf.Future | None = None  # LOOKUP: path -> chunks found
    phase: Phase = Phase.LOOKUP
    path: PathName | None = None  # RESERVE/FOLLOW/FETCH: the path the policy (rank 0) chose
    fetch_keys: list[bytes] | None = None  # RESERVE/FOLLOW/FETCH: full chunks, then tail sub-chunks
    fetch_tokens: list[int] | None = None  # tokens of each of them
    choice: int | None = None  # this rank's policy choice for the agreement (agreement.choice_of)
    decision: object = None  # the policy's Decision (estimates), None when another rank's choice won
    wire_bytes: int = 0
    leader: str | None = None  # FOLLOW: rid of the request fetching the same chunks
    prefix_node: object = None  # FETCH: node ending where the fetched span starts (device prefix + staged)
    prefix_lock: object = None
    rows: object = None  # FETCH/ZOMBIE: reserved staging rows not staged yet (torch int64), one per token
    handle: object = None  # FETCH/ZOMBIE: the backend's FetchHandle
    miss_reason: str | None = None  # this rank's own reason for a miss (metrics), set by observe

    def enter(self, phase: Phase, now: float) -> None:
        self.phase, self.since = phase, now
