"""Host-side round bookkeeping of the DPU client: pending and in-flight host rounds, destination slots,
the outbox of frames for the data plane, and the data plane's completion events -> ``ClientFetch`` state.

A request's chunks are cut into host rounds (``plan_rounds``) that each fit one slot of the destination
region; each is one data-plane job. A slot is reused only after the data plane said ``JobDone`` for the
job using it (it then writes nothing more there). A failed chunk ends the usable prefix: later rounds of
the request are cancelled (queued ones dropped, in-flight ones sent ``Cancel``).

Threads: every method but ``run_write`` runs under the client's condition variable ``cv`` (``DpuClient``
takes it): ``add``/``cancel`` on the caller's thread, the rest on the client's receiver thread, which is
the only one writing the target's rows. Writes run *outside* ``cv``, so a slow device write never holds up
``submit``/``cancel`` or the heartbeats: ``try_write`` queues runs of finished layers (``WriteOp``, each
with the slot it reads, so freeing the slot after ``JobDone`` does not move it), the receiver thread takes
them (``next_write``), runs them (``run_write``: the target's ``KVWriter`` reads the destination region)
and reports back (``write_done``) before it handles the next event or sends anything, so the data plane
cannot be handed that slot again before the write read it. ``ClientFetch.writing`` counts a handle's queued
and running writes: the handle finishes only when it is 0, and ``DpuClient.cancel`` waits for it (the
caller frees the rows right after). A layer counts as written only after the write returned; a
write that raises fails its chunks and the round's later ones (kind ``write``) exactly like a chunk the data
plane failed on, so it is never a hit; a queued write of a round that is cancelled or past a miss by then is dropped.
With ``eager`` (the client's default) each chunk's run of layers is written as soon as it is in the region
(runs of consecutive chunks with the same layers in one write), overlapping the data plane's fetch and
decode of later chunks and layers, so only the last chunk's write follows its last byte; without it a round
is written once all its layers are in the region: one write (one scatter launch on a GPU) per round. A chunk
counts as written layer by layer only as a prefix in chunk order (``ClientFetch.mark_written``).
Process lifecycle is ``client.py``, heartbeats and event dispatch ``receiver.py``, restarts ``supervisor.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.sizing import plan_rounds
from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.types import KVLayout

from .jobs import DONE, FAILED, ClientFetch, HostRound, LayerWrite
from .round_io import RoundIO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteOp:
    """Layers ``lo..hi`` of ``round``'s chunks ``c0..c1`` (indices within the round; ``tokens`` tokens from
    the round's token ``t0`` on), read from ``slot``."""

    round: HostRound
    slot: int
    c0: int
    c1: int
    lo: int
    hi: int
    t0: int
    tokens: int


def failure_kind(msg: P.ChunkFailed) -> str:
    """The host's failure kind of a ``ChunkFailed``: the wire kind, except a failed store call, which
    becomes ``store_<store client kind>`` (e.g. ``store_timeout``, ``store_unavailable``)."""
    return f"store_{msg.store_error}" if msg.kind == "store_error" else msg.kind


class RoundBook:
    """See module docstring. ``submit_msg(round)`` builds the ``SubmitFetch`` of a round given a slot and
    a job id; ``counters`` is the client's counter dict; ``on_finished`` (may be None) is called when a
    fetch finished; ``eager``: write each chunk's layers as soon as they are in the region;
    ``on_write(seconds, layers, output)`` (may be None) after every write of a round's layers into the rows
    (``output``: ``"kv"`` or ``"codes"``, what the data plane wrote for it)
    (the receiver thread's time in the target's ``KVWriter``, failed writes included)."""

    def __init__(
        self,
        layout: KVLayout,
        io: RoundIO,
        slots: int,
        slot_bytes: int,
        submit_msg: Callable[[HostRound], P.SubmitFetch],
        counters: dict,
        on_finished: Callable[[], None] | None,
        eager: bool = False,
        on_write: Callable[[float, int, str], None] | None = None,
    ) -> None:
        self.layout, self.io, self.slot_bytes, self.eager = layout, io, slot_bytes, eager
        self._on_write = on_write
        self._submit_msg, self.counters, self._on_finished = submit_msg, counters, on_finished
        self.pending: deque[HostRound] = deque()
        self.inflight: dict[int, HostRound] = {}  # data-plane job id -> round
        self.free_slots = list(range(slots))
        self.outbox: deque[bytes] = deque()
        self.writes: deque[WriteOp] = deque()  # queued by ``try_write``, run by the receiver thread
        self._job_ids = itertools.count(1)

    # ---- caller side -------------------------------------------------------------------------------
    def add(self, h: ClientFetch) -> None:
        """Plan ``h``'s host rounds, queue them and hand out free slots."""
        t = 0
        for regions in plan_rounds(h.chunk_tokens, self.layout, self.slot_bytes, 1.0):
            n = sum(r.tokens for r in regions)
            r = HostRound(h, regions[0].index, regions[-1].index + 1, t, n)
            r.chunk_layers = [
                bytearray(self.layout.num_layers) for _ in range(r.chunk_hi - r.chunk_lo)
            ]  # ABSENT
            if h.codes:
                r.code_lengths = [[0] * self.layout.num_layers for _ in range(r.chunk_hi - r.chunk_lo)]
            h.rounds.append(r)
            self.pending.append(r)
            t += n
        self.pump()

    def cancel(self, h: ClientFetch) -> None:
        h.cancelled = True
        lead = next((i for i, s in enumerate(h.state) if s != DONE), len(h.state))
        h.first_fail = min(h.first_fail, lead)
        for r in h.rounds:
            if r.job and not r.terminal:
                self.outbox.append(P.encode(P.Cancel(r.job, 0)))
        self.drop_pending(h)
        self.pump()

    # ---- slots and rounds --------------------------------------------------------------------------
    def drop_pending(self, h: ClientFetch) -> None:
        """Forget ``h``'s queued rounds that can no longer produce hits (cancelled or past a miss)."""
        keep: deque[HostRound] = deque()
        for r in self.pending:
            if r.handle is h and (h.cancelled or r.chunk_lo >= h.first_fail):
                self.lose_round(r, None)
            else:
                keep.append(r)
        self.pending = keep

    def pump(self) -> None:
        """Hand pending rounds free destination slots (skipping rounds already beyond a miss)."""
        while self.pending and self.free_slots:
            r = self.pending.popleft()
            h = r.handle
            if h.cancelled or r.chunk_lo >= h.first_fail:
                self.lose_round(r, None)
                continue
            r.slot = self.free_slots.pop()
            r.job = next(self._job_ids)
            r.last_event = time.monotonic()
            self.inflight[r.job] = r
            self.outbox.append(P.encode(self._submit_msg(r)))

    def lose_round(self, r: HostRound, kind: str | None) -> None:
        """Round ends without (more) data: its unfinished chunks fail with ``kind`` (None: not fetched)."""
        h = r.handle
        for i in range(r.chunk_lo, r.chunk_hi):
            if kind is not None and h.state[i] != DONE:
                h.mark_failed(i, kind)
        r.terminal = True
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1
        self._check_finished(h)

    def _check_finished(self, h: ClientFetch) -> None:
        if h.check_finished() and self._on_finished is not None:
            self._on_finished()

    def lose_all(self, kind: str) -> int:
        """Every in-flight and queued round ends with ``kind`` (close; queued writes are dropped); the
        number of rounds lost."""
        while self.writes:
            self.write_done(self.writes.popleft(), None, 0.0)
        lost = list(self.inflight.values()) + list(self.pending)
        for r in lost:
            self.lose_round(r, kind)
        self.inflight.clear()
        self.pending.clear()
        return len(lost)

    def lose_inflight(self, kind: str) -> int:
        """The in-flight rounds end with ``kind`` (the data plane died); queued frames are dropped, and so
        are their requests' queued rounds past the miss (the request finishes now, not at its timeout)."""
        lost = list(self.inflight.values())
        self.inflight.clear()
        for r in lost:
            self.lose_round(r, kind)
        for h in {id(r.handle): r.handle for r in lost}.values():
            self.drop_pending(h)
        self.outbox.clear()
        return len(lost)

    def stale(self, now: float, timeout_s: float) -> int:
        """In-flight rounds without any event for ``timeout_s``."""
        return sum(now - r.last_event > timeout_s for r in self.inflight.values())

    # ---- data-plane events (receiver thread) -------------------------------------------------------
    def on_event(self, msg: P.Message) -> None:
        r = self.inflight.get(msg.job)
        if r is None:
            return  # a job of a previous data-plane generation, or already cancelled
        r.last_event = time.monotonic()
        h = r.handle
        if isinstance(msg, P.LayerDone):
            i = r.chunk_lo + msg.chunk
            if i < r.chunk_hi and msg.layer + msg.count <= h.num_layers and bool(msg.lengths) == h.codes:
                if h.codes:
                    r.code_lengths[msg.chunk][msg.layer : msg.layer + msg.count] = msg.lengths
                h.layers_seen[i] += msg.count
                row = r.chunk_layers[msg.chunk]
                for layer in range(msg.layer, msg.layer + msg.count):
                    if row[layer] == LayerWrite.ABSENT:
                        row[layer] = LayerWrite.WAITING
                self.try_write(r)
        elif isinstance(msg, P.ChunkDone):
            i = r.chunk_lo + msg.chunk
            if i < r.chunk_hi and h.layers_seen[i] >= h.num_layers and h.state[i] != FAILED:
                h.state[i] = DONE
                h.wire_bytes[i] = msg.wire_bytes
                self.counters["chunks_done"] += 1
        elif isinstance(msg, P.ChunkFailed):
            self._on_failed(r, r.chunk_lo + msg.chunk, failure_kind(msg))
        elif isinstance(msg, P.JobDone):
            self.try_write(r)
            del self.inflight[msg.job]
            self.counters["rounds"] += 1
            self.lose_round(r, "internal")  # chunks without ChunkDone by now are not trustworthy
            self.pump()

    def _on_failed(self, r: HostRound, i: int, kind: str) -> None:
        if not r.chunk_lo <= i < r.chunk_hi:
            return
        self.counters["chunks_failed"] += 1
        self._fail_from(r, i, kind)
        self.try_write(r)

    def _fail_from(self, r: HostRound, i: int, kind: str) -> None:
        """Chunk ``i`` of ``r``'s request failed: it and every later chunk are misses."""
        h = r.handle
        h.mark_failed(i, kind)
        for other in h.rounds:  # later rounds of this request are beyond the miss now
            if other.job and not other.terminal and other.chunk_lo > i:
                self.outbox.append(P.encode(P.Cancel(other.job, 0)))
        self.drop_pending(h)

    def try_write(self, r: HostRound) -> None:
        """Queue the layers in the region of the round's chunks before the first miss: one write per run of
        consecutive layers of a chunk, runs of consecutive chunks with the same layers merged (without
        ``eager``: nothing until every such layer is in the region, then one write for the round)."""
        h = r.handle
        if h.cancelled:
            return
        valid = max(0, min(r.chunk_hi, h.first_fail) - r.chunk_lo)
        rows = r.chunk_layers[:valid]
        if not self.eager and any(LayerWrite.ABSENT in row for row in rows):
            return  # one write per round, once every layer is in the region
        runs: list[list[int]] = []  # [c0, c1, lo, hi]
        for c, row in enumerate(rows):
            layer = 0
            while layer < h.num_layers:
                if row[layer] != LayerWrite.WAITING:
                    layer += 1
                    continue
                hi = layer
                while hi < h.num_layers and row[hi] == LayerWrite.WAITING:
                    hi += 1
                if runs and runs[-1][1] == c and runs[-1][2:] == [layer, hi]:
                    runs[-1][1] = c + 1
                else:
                    runs.append([c, c + 1, layer, hi])
                layer = hi
        lead = h.chunk_tokens[r.chunk_lo : r.chunk_hi]
        for c0, c1, lo, hi in runs:
            for row in rows[c0:c1]:
                row[lo:hi] = bytes([LayerWrite.QUEUED]) * (hi - lo)
            if h.target is not None:
                self.writes.append(WriteOp(r, r.slot, c0, c1, lo, hi, sum(lead[:c0]), sum(lead[c0:c1])))
                h.writing += 1
            else:
                self._written(r, c0, c1, lo, hi)

    def _written(self, r: HostRound, c0: int, c1: int, lo: int, hi: int) -> None:
        for row in r.chunk_layers[c0:c1]:
            row[lo:hi] = bytes([LayerWrite.WRITTEN]) * (hi - lo)
        r.handle.mark_written(r.chunk_lo + c0, r.chunk_lo + c1, lo, hi)

    def next_write(self) -> WriteOp | None:
        """The next queued write to run, dropping those of rounds cancelled or past a miss since."""
        while self.writes:
            op = self.writes.popleft()
            h = op.round.handle
            if not h.cancelled and op.round.chunk_lo + op.c0 < h.first_fail:
                return op
            self.write_done(op, None, 0.0)
        return None

    def run_write(self, op: WriteOp) -> tuple[KVWriteError | None, float]:
        """Run ``op`` (outside ``cv``; receiver thread): (the write's error or None, seconds)."""
        t0 = time.perf_counter()
        try:
            self.io.write_layers(
                op.slot, op.round, op.c0, op.c1, op.lo, op.hi, op.t0, op.tokens, op.round.handle.target
            )
        except KVWriteError as e:
            return e, time.perf_counter() - t0
        return None, time.perf_counter() - t0

    def write_done(self, op: WriteOp, error: KVWriteError | None, seconds: float, ran: bool = False) -> None:
        """Record ``op``'s outcome (``ran``: it ran, failing with ``error`` or not; else it was dropped)."""
        r, h = op.round, op.round.handle
        h.writing -= 1
        if ran:
            self.counters["write_s"] += seconds
            if self._on_write is not None:
                self._on_write(seconds, op.hi - op.lo, h.output)
            if error is None:
                self._written(r, op.c0, op.c1, op.lo, op.hi)
            else:
                self._fail_from(r, r.chunk_lo + op.c0, "write")
                self.counters["write_failed"] += 1
                logger.warning("KV write for %s failed; its round is a miss: %s", h.request_id, error)
        self._check_finished(h)
