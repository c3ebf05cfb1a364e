"""The DPU client's receiver thread (``srkv-dpu-receiver``): the one thread that talks to the data plane.

It owns the link's ZeroMQ socket: it sends the frames the round bookkeeping queued (``RoundBook.outbox``;
none on an attached connection the service has not accepted), heartbeats every
``DpuClientConfig.heartbeat_s``, reads the data plane's messages and dispatches them -- ``Pong`` and
``Registered`` to the ``supervisor.Supervisor``, ``ChunksVerified`` to the verified-blob copies below,
every completion event to ``RoundBook.on_event`` -- runs the row writes those events queued, and lets
the supervisor replace or reconnect a lost data plane. An exception in one pass is counted
(``receiver_errors``) and logged; the thread goes on serving.

A chunk the data plane's store client failed on, or whose value it found corrupt (store frame, MAC or
codec CRCs), arrives as ``ChunkFailed`` with ``store_error``: it is passed to the client's
``on_store_error(op, kind, n)`` (the serving glue: ``store_errors_total{op="get",kind}``), once per chunk;
a corrupt one is also logged here (``store/corruption.py``, rate-limited).

Threads and buffers: socket I/O and the writes into the target's rows (scatters) run only on this thread,
the scatters outside the client's ``cv`` (``rounds.RoundBook``: a slow device write does not hold up ``submit``;
``cancel`` waits only for a write of its own fetch); the round bookkeeping is touched only under ``cv``.
The scatters read the client's destination region, which the data plane writes into; a slot is handed
out again only after this thread ran the writes of the event that freed it.

Layer-wise admission (``blob_slot_bytes`` > 0): each slot also has a blob area; the data plane copies a
round's verified compressed blobs there before ``ChunksVerified``. This thread copies them out (before it
can see that round's ``JobDone``), re-parses them here (header + checksum) and, once every chunk of a
fetch has them, sets ``ClientFetch.verified`` and calls the client's ``on_event``. The copies are what
the host decodes from if the data plane dies, stalls or is cancelled after that point.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import zmq

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.store import corruption

from .link import AttachedService, DataPlaneProcess
from .supervisor import Supervisor

if TYPE_CHECKING:
    from .owner import ClientState

logger = logging.getLogger(__name__)


class Receiver:
    """See module docstring. ``client``: the owning ``DpuClient`` (its ``cfg``, ``cv``, ``book``, ``io``,
    ``codec``, ``fingerprint``, ``counters`` and the hooks ``on_event`` / ``on_store_error`` are read when
    used); ``proc``: its link to the data plane; ``wake_rx``: the inproc socket the client's other threads
    wake this one through. ``start`` / ``stop`` / ``join`` are for the client's owning thread."""

    def __init__(
        self,
        client: ClientState,
        proc: DataPlaneProcess | AttachedService,
        supervisor: Supervisor,
        wake_rx: zmq.Socket,
    ) -> None:
        self.client, self.proc, self.supervisor, self._wake_rx = client, proc, supervisor, wake_rx
        self.running = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._run, name="srkv-dpu-receiver", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Ask the thread to end after its current pass (wake it up then, and ``join``)."""
        self.running = False

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout=timeout)

    # ---- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        c = self.client
        last_hb = 0.0
        while self.running:
            try:
                sock = self.proc.sock
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLIN)
                poller.register(self._wake_rx, zmq.POLLIN)
                monitor = getattr(self.proc, "monitor", None)  # attached: connection events
                if monitor is not None:
                    poller.register(monitor, zmq.POLLIN)
                ready = dict(poller.poll(int(c.cfg.heartbeat_s * 500)))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                self._flush_outbox(sock)
                if sock in ready:
                    P.drain(sock, self._on_message, self._bad_frame)
                    # the events may have queued frames (a JobDone frees a slot: the next round's submit);
                    # send them now, not after the next event or the poll's timeout (up to 250 ms a round)
                    self._flush_outbox(sock)
                now = time.monotonic()
                if now - last_hb >= c.cfg.heartbeat_s:
                    last_hb = now
                    self.proc.heartbeat()
                self.supervisor.supervise(now)
            except Exception:  # thread boundary: never let the receiver die while serving
                c.counters["receiver_errors"] += 1
                logger.exception("DPU receiver error")
                time.sleep(0.05)

    def _flush_outbox(self, sock) -> None:
        c = self.client
        while True:
            with c.cv:
                if not self.supervisor.accepting:
                    # Never submit on a connection the service has not accepted: the service could
                    # still take the job after ``supervise`` failed its round and freed its slot.
                    c.book.outbox.clear()
                    return
                if not c.book.outbox:
                    return
                frame = c.book.outbox.popleft()
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # no connection right now: the round ends as a miss when the link is lost
                c.counters["send_dropped"] += 1

    def _bad_frame(self, reason: str) -> None:
        self.client.counters["bad_frames"] += 1
        logger.warning("bad frame from data plane: %s", reason)

    # ---- dispatch ----------------------------------------------------------------------------------
    def _on_message(self, _head: list[bytes], msg: P.Message) -> None:
        c = self.client
        if isinstance(msg, P.Pong):
            self.supervisor.on_pong(msg)
        elif isinstance(msg, P.Registered):
            self.supervisor.on_registered(msg)
        elif isinstance(msg, P.ChunksVerified):
            self._on_verified(msg)
        else:
            if isinstance(msg, P.ChunkFailed) and msg.store_error:
                if msg.store_error == "corrupt":  # the data plane logged it too, in its own log
                    key, why = corruption.split_detail(msg.detail)
                    corruption.note(key, "found by the data plane", why)
                if c.on_store_error is not None:  # its store client failed, or a value was corrupt
                    c.on_store_error("get", msg.store_error, 1)
            with c.cv:
                c.book.on_event(msg)
                c.cv.notify_all()
            self._run_writes()

    def _run_writes(self) -> None:
        """Run the row writes the last event queued, outside ``cv`` (before this thread reads the next
        event or sends anything: a slot freed by ``JobDone`` is not handed out before its write ran)."""
        c = self.client
        while True:
            with c.cv:
                op = c.book.next_write()
                if op is None:
                    c.cv.notify_all()
                    return
            try:
                error, seconds = c.book.run_write(op)
            except Exception as e:  # boundary: a writer bug must not leave the fetch waiting for this write
                c.counters["receiver_errors"] += 1
                logger.exception("KV write raised unexpectedly")
                error, seconds = KVWriteError(f"unexpected {type(e).__name__}: {e}"), 0.0
            with c.cv:
                c.book.write_done(op, error, seconds, ran=True)
                c.cv.notify_all()

    def _on_verified(self, msg: P.ChunksVerified) -> None:
        """Copy out and re-parse a round's verified blobs (outside ``cv``: the slot cannot be reused
        before this thread handles the round's ``JobDone``), then record them on the handle."""
        c = self.client
        with c.cv:
            r = c.book.inflight.get(msg.job)
            if r is None:
                return
            r.last_event = time.monotonic()
            n = r.chunk_hi - r.chunk_lo
            if msg.ok < n or not msg.blobs or r.handle.cancelled or r.handle.first_fail < r.chunk_hi:
                return
            slot, h = r.slot, r.handle
        tokens = h.chunk_tokens[r.chunk_lo : r.chunk_hi]
        try:
            blobs, headers = c.io.verified_copies(slot, msg.blobs, c.codec, c.fingerprint, tokens)
        except ChunkError as e:  # never admitted early then; the normal completion path still works
            c.counters["verify_rejected"] += 1
            logger.warning("verified blobs of job %d rejected on the host: %s", msg.job, e)
            return
        with c.cv:
            if h.set_verified(r.chunk_lo, blobs, headers):
                c.counters["verified"] += 1
                if c.on_event is not None:
                    c.on_event()
            c.cv.notify_all()
