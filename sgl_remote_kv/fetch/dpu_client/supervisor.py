"""Supervision of the DPU client's data plane: whether it accepted this client, and its replacement when
it dies, hangs or forgets us.

A spawned data plane (``link.DataPlaneProcess``) that exited, missed heartbeats
(``DpuClientConfig.heartbeat_timeout_s``) or made no progress on an in-flight round
(``job_timeout_s``) is killed and spawned again: its in-flight chunks become misses (kind
``dataplane_lost``), later submissions go to the new process. An attached client
(``link.AttachedService``) never starts or kills the service: when its connection goes down, it misses
heartbeats, or the service no longer knows it (``Pong.registered`` False: it restarted), the client
fails its in-flight rounds (``dataplane_lost``), opens a new connection and registers again; until the
service accepted it (``registered``), every submission fails at once (``dataplane_lost``), so a fetch
never waits on a service that is down. Each replacement or reconnect calls the client's ``on_restart``
hook with its reason (``exited`` / ``hung`` / ``restarted``).

Threads: created by ``DpuClient.start`` once the data plane accepted its first ``Register``; every
method then runs on the client's receiver thread only (``receiver.Receiver``), which also owns the
link's socket. It takes the client's ``cv`` around the round bookkeeping (``client.book``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sgl_remote_kv.contract import protocol as P

from .link import AttachedService, DataPlaneProcess

if TYPE_CHECKING:
    from .owner import ClientState

logger = logging.getLogger(__name__)


class Supervisor:
    """See module docstring. ``client``: the owning ``DpuClient`` (its ``cfg``, ``cv``, ``book``,
    ``counters`` and ``on_restart`` are read when used); ``proc``: its link to the data plane."""

    def __init__(self, client: ClientState, proc: DataPlaneProcess | AttachedService) -> None:
        self.client, self.proc = client, proc
        self.attached = bool(client.cfg.endpoint)
        self.registered = True  # attached: the service accepted our current connection's Register
        self.forgotten = False  # attached: a Pong said the service does not know this connection
        self.connect_at = 0.0
        self.last_pong: P.Pong | None = None

    @property
    def accepting(self) -> bool:
        """May submissions be sent on the current connection? (Attached: only once it is registered.)"""
        return not self.attached or self.registered

    # ---- the data plane's answers (dispatched by the receiver) -------------------------------------
    def on_pong(self, msg: P.Pong) -> None:
        self.proc.pong(msg)
        self.last_pong = msg
        if self.attached and self.registered and not msg.registered:
            logger.error("the data-plane service no longer knows this client (it restarted?)")
            self.forgotten = True  # ``supervise`` reconnects (not here: the receiver is reading the socket)

    def on_registered(self, msg: P.Registered) -> None:
        if msg.ok and self.proc.accepted:
            return  # the answer to a repeated Register of this connection (``wait_ready`` resends)
        if self.proc.registered(msg):
            if self.attached:
                logger.info(
                    "registered with the data-plane service %s (pid %s)",
                    self.client.cfg.endpoint,
                    self.proc.pid,
                )
            self.registered = True
            with self.client.cv:
                self.client.book.pump()  # may end requests (rounds past a miss): wake their waiters
                self.client.cv.notify_all()
        else:
            logger.error("the data-plane service refused this client: %s", msg.detail)

    # ---- health ------------------------------------------------------------------------------------
    def supervise(self, now: float) -> None:
        """Replace a dead or hung data plane (spawned), or reconnect to the service (attached)."""
        c = self.client
        if not self.attached:
            why = self._unhealthy(now)
            if why is not None:
                self._restart(why)
            return
        down = self.proc.disconnected()  # drains the connection's events in every state
        if self.registered:
            why = "restarted" if self.forgotten else "exited" if down else self._unhealthy(now)
            if why is not None:
                self._reconnect(why)
        else:  # not registered (service down, restarting, or refusing us): every fetch is a miss
            with c.cv:
                if c.book.lose_all("dataplane_lost"):
                    c.cv.notify_all()
                c.book.outbox.clear()
            if now - self.connect_at > c.cfg.heartbeat_timeout_s:
                self._reconnect(None)

    def _reconnect(self, why: str | None) -> None:
        """Attached: in-flight rounds become misses; a new connection registers again (answered in
        ``on_registered``). ``why`` None: a retry while still unregistered."""
        c = self.client
        self.registered = self.forgotten = False
        with c.cv:
            lost = c.book.lose_inflight("dataplane_lost") + c.book.lose_all("dataplane_lost")
            c.cv.notify_all()
        if why is not None:
            c.counters["restarts"] += 1
            logger.warning(
                "reconnecting to the data-plane service %s (%s; %d rounds lost)", c.cfg.endpoint, why, lost
            )
            if c.on_restart is not None:
                c.on_restart(why)
        self.proc.stop(kill=True)
        self.proc.spawn()
        self.connect_at = time.monotonic()

    def _unhealthy(self, now: float) -> str | None:
        """Why the data plane must be replaced (``exited`` / ``hung``), or None."""
        c = self.client
        if not self.proc.alive():
            logger.error("data plane exited (rc=%s)", self.proc.returncode())
            return "exited"
        if now - self.proc.last_pong_at > c.cfg.heartbeat_timeout_s:
            logger.error("data plane missed heartbeats for %.1f s", now - self.proc.last_pong_at)
            return "hung"
        with c.cv:
            stale = c.book.stale(now, c.cfg.job_timeout_s)
        if stale:
            logger.error("data plane made no progress on %d rounds for %.1f s", stale, c.cfg.job_timeout_s)
        return "hung" if stale else None

    def _restart(self, why: str) -> None:
        """Kill and replace the data plane; its in-flight rounds become misses."""
        c = self.client
        with c.cv:
            lost = c.book.lose_inflight("dataplane_lost")
            c.counters["restarts"] += 1
            c.cv.notify_all()
        logger.warning("restarting data plane (%d rounds lost)", lost)
        if c.on_restart is not None:
            c.on_restart(why)
        self.proc.stop(kill=True)
        self.proc.spawn()
        if not self.proc.wait_ready(c.cfg.start_timeout_s):
            logger.error("restarted data plane not ready yet; will retry")
        with c.cv:
            c.book.pump()
            c.cv.notify_all()
