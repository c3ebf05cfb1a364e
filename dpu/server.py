"""The data-plane process: a ZeroMQ ROUTER front end, its event loop, and the pipeline it drives.

One process serves any number of host clients (``DpuClient``: one per TP rank of each server): a child
spawned by one client (the default; it exits with its parent) or a long-lived service on an endpoint
(``ipc://`` or, authenticated with CURVE, ``tcp://``), as its ``config.DataPlaneConfig`` says. The
server thread answers ``Heartbeat`` here, hands ``Register``/``Goodbye`` to the client table
(``clients.py``: registrations, drops, destination regions) and ``SubmitFetch``/``Cancel`` to the job
table (``jobs.py``: checks, round admission into the shared staging slots and pipeline), and forwards the
pipeline's completions to their clients.

Logs: one INFO line when serving (version, pid, endpoint, store, staging, auth); WARNING for bad frames
(the tables log registrations, drops and rejected jobs). A stopped service removes its ``ipc://``
socket file (``ipc_file.py``).

Threads: the *server thread* (the process's main thread, ``DataPlaneServer.run``) owns the sockets,
the client and job tables (the pending-round queue and the free-slot list are the job table's); it is
the only thread touching them. Pipeline workers send their completions back through one lock-protected
PUSH socket on an inproc endpoint that the server thread polls. With an auth key, pyzmq's ZAP
authenticator runs one more thread.

Ownership: the staging buffers and the store client belong to this process; destination regions belong
to the hosts that created them (``clients.py``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import zmq

from sgl_remote_kv import __version__
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import auth
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.store.base import redact_url

from .buffers import StagingBuffers
from .clients import ClientTable
from .config import DataPlaneConfig
from .ipc_file import BoundFile
from .jobs import JobTable
from .pipeline import Pipeline
from .validate import Codecs, fingerprint

logger = logging.getLogger(__name__)

_SLOT_FREE = b"slot"
_EVENTS = "inproc://dpu-events"


class DataPlaneServer:
    def __init__(self, cfg: DataPlaneConfig) -> None:
        from sgl_remote_kv.store.client import ClientConfig, open_client

        self.cfg = cfg
        st = cfg.settings
        if st.cpus:
            try:
                os.sched_setaffinity(0, st.cpus)
            except OSError as e:  # e.g. a core outside our cpuset: serve unpinned, say so
                logger.error("cannot pin the data plane to cores %s: %s; running unpinned", st.cpus, e)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # completions are small; never drop one
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES + 1024)
        self.zap = auth.bind_server(self.ctx, self.router, cfg.endpoint, cfg.auth_key)
        self.socket_file = BoundFile.after_bind(cfg.endpoint)  # removed at close
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(_EVENTS)
        self._push_sock = self.ctx.socket(zmq.PUSH)
        self._push_sock.setsockopt(zmq.LINGER, 0)
        self._push_sock.setsockopt(zmq.SNDHWM, 0)
        self._push_sock.connect(_EVENTS)
        self._push_lock = threading.Lock()
        self.buffers = StagingBuffers(st.slots, st.slot_bytes, st.inflate_ratio)
        self.store = open_client(cfg.store_url, ClientConfig(timeout_s=st.store_timeout_s))
        self.pipeline = Pipeline(st.pipeline(), self.buffers, self.store, self._emit, self._slot_freed)
        self.codecs = Codecs()
        self._stop = False
        self.counters = {"submitted": 0, "rejected": 0, "bad_frames": 0, "cancels": 0, "handler_errors": 0}
        self.counters.update(
            {"registered": 0, "register_refused": 0, "register_deferred": 0, "clients_dropped": 0}
        )
        self.clients = ClientTable(cfg, self.codecs, self.counters, self._send, self._cancel_client_jobs)
        self.jobs = JobTable(
            cfg, self.codecs, self.counters, self._send, self.pipeline.submit_round, self.clients
        )

    # ---- called from any thread -------------------------------------------------------------------
    def _push(self, frames: list[bytes]) -> None:
        # One socket under one lock: events reach the host in the order workers emitted them (a
        # chunk's LayerDone always precedes its ChunkDone and the job's JobDone).
        with self._push_lock:
            self._push_sock.send_multipart(frames)

    def _emit(self, peer: bytes, msg: P.Message) -> None:
        self._push([peer, P.encode(msg)])

    def _slot_freed(self, slot: int) -> None:
        self._push([_SLOT_FREE, slot.to_bytes(4, "little")])

    # ---- server thread ----------------------------------------------------------------------------
    def request_stop(self, *_: object) -> None:
        self._stop = True

    def _send(self, peer: bytes, msg: P.Message, flags: int = 0) -> None:
        self.router.send_multipart([peer, P.encode(msg)], flags)

    def _cancel_client_jobs(self, peer: bytes, job_ids: set[int]) -> None:
        self.jobs.cancel_client(peer, job_ids)

    def run(self, notes: tuple[str, ...] = ()) -> None:
        """Serve until SIGTERM/SIGINT (or ``request_stop``); then shut down cleanly. ``notes``: more for
        the start line (e.g. the store proxy's endpoint)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        warm = self.warm_up()
        logger.info("%s", self.start_line((warm, *notes) if warm else notes))
        try:
            while not self._stop:
                ready = dict(poller.poll(100))
                if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                    # INFO: how a server's own data plane ends when SGLang stops the scheduler (no close)
                    logger.info("host pid %d is gone; exiting", self.cfg.parent_pid)
                    break
                if self.events in ready:
                    self._drain_events()
                if self.router in ready:
                    self._drain_router()
                self.clients.expire(time.monotonic())
                self.clients.unmap_released()
        finally:
            self.close()

    def _drain_events(self) -> None:
        while True:
            try:
                frames = self.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[0] == _SLOT_FREE:
                self.jobs.slot_freed(int.from_bytes(frames[1], "little"))
                continue
            msg = P.decode(frames[1])
            if isinstance(msg, P.JobDone):
                self.jobs.job_over(frames[0], msg.job)
            self.router.send_multipart(frames, zmq.NOBLOCK)

    def _drain_router(self) -> None:
        P.drain(self.router, self._on_message, self._bad_frame, parts=2)

    def _bad_frame(self, reason: str) -> None:
        self.counters["bad_frames"] += 1
        logger.warning("dropping bad frame from peer: %s", reason)

    def _on_message(self, head: list[bytes], msg: P.Message) -> None:
        peer = head[0]
        self.clients.touch(peer)
        try:
            self._handle(peer, msg)
        except Exception:  # process boundary: a message must never take the server thread down
            self.counters["handler_errors"] += 1
            logger.exception("handling %s failed", type(msg).__name__)
            if isinstance(msg, P.SubmitFetch):
                self.jobs.internal_error(peer, msg)

    def _handle(self, peer: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.Heartbeat):
            stats = {"pipeline": self.pipeline.stats_snapshot(), **self.counters}
            stats["fetch_gate"] = self.pipeline.gate.snapshot()
            stats["cpus"] = sorted(os.sched_getaffinity(0))  # effective affinity (benchmarks check it)
            stats["clients"] = len(self.clients)
            stats["auth_refused"] = self.zap.refused if self.zap else 0
            pong = P.Pong(
                msg.seq,
                msg.sent_ns,
                os.getpid(),
                len(self.jobs),
                json.dumps(stats).encode(),
                peer in self.clients,
            )
            self._send(peer, pong, zmq.NOBLOCK)
        elif isinstance(msg, P.Register):
            self.clients.register(peer, msg)
        elif isinstance(msg, P.Goodbye):
            self.clients.goodbye(peer)
        elif isinstance(msg, P.SubmitFetch):
            self.jobs.submit(peer, msg)
        elif isinstance(msg, P.Cancel):
            self.jobs.cancel(peer, msg)
        else:
            self.counters["bad_frames"] += 1

    def start_line(self, notes: tuple[str, ...] = ()) -> str:
        """The one INFO line a data plane logs when it starts serving."""
        cfg, st = self.cfg, self.cfg.settings
        auth_how = "CURVE" if cfg.auth_key else "socket file 0600" if cfg.endpoint.startswith("ipc") else ""
        parts = [
            f"store {redact_url(cfg.store_url)}",
            f"staging {st.slots} x {st.slot_bytes / 2**20:.0f} MiB",
            st.describe_workers(),
            f"auth: {auth_how}" if auth_how else "",
            f"client timeout {cfg.client_timeout_s:g} s" if cfg.client_timeout_s else "",
            f"{len(cfg.allowed_fingerprints)} models allowed" if cfg.allowed_fingerprints else "",
            *notes,
        ]
        detail = ", ".join(p for p in parts if p)
        return (
            f"sgl-remote-kv {__version__} data plane pid {os.getpid()} serving on {cfg.endpoint} ({detail})"
        )

    def warm_up(self) -> str:
        """Decode one synthetic chunk of ``cfg.warm``'s codec and model (before ``run`` answers its first
        ping, so the host's ``wait_ready`` covers it); what the start line says about it ("" when nothing
        was warmed up). A failure is logged and costs only the first job's latency: the data plane serves
        all the same."""
        w = self.cfg.warm
        if w is None:
            return ""
        try:
            codec = self.codecs.get(w.codec, w.codec_params.encode())
            fp = fingerprint(w.fingerprint)
        except (ValueError, KeyError, ChunkError) as e:  # unknown codec, bad params, ...
            logger.warning("warm-up of codec %s failed (%r); the first job loads its kernels", w.codec, e)
            return ""
        seconds = self.codecs.warm(codec, w.codec, w.codec_params.encode(), fp)
        return "" if seconds is None else f"codec {w.codec} warmed up in {seconds * 1000:.0f} ms"

    def close(self) -> None:
        logger.info("data plane shutting down")
        self.pipeline.close()
        self.store.close()
        with self._push_lock:
            self._push_sock.close(0)
        self.events.close(0)
        self.router.close(0)
        if self.socket_file is not None:
            self.socket_file.remove()
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()
        self.clients.close()
