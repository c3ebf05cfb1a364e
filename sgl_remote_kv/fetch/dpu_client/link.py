"""The host's link to a data plane: its ZeroMQ DEALER socket and registration, and either the process
it spawned (``DataPlaneProcess``, the default) or the endpoint of a shared service it attached to
(``AttachedService``, ``--remote-kv-dpu-endpoint``).

Both send ``Register`` (this client's fingerprint, codec and destination region) on every new socket;
``wait_ready`` returns once the data plane answered ``Registered`` (``refused`` holds its reason when it
said no). Threads: ``spawn``/``wait_ready``/``stop`` run on the thread that owns the client
(``start``/``close``) or on the DPU client's receiver thread (restarts, reconnects); never
concurrently. ``sock`` is used only by that thread. Each generation gets a fresh socket (and a spawned
child a fresh IPC endpoint), so late frames of a dead process can never be mistaken for the new one's.

A spawned child inherits the destination region's descriptor (anonymous memory, ``host_region.py``).
Its endpoint is a socket file in a private run directory (``shm_names.run_dir``), removed as soon as the
child accepted our ``Register`` (the connection stays up without it; nobody else may connect to a
server's own data plane) -- or at ``stop`` --, so a server killed together with its data plane (SGLang's
``kill_process_tree`` SIGKILLs both, also on SIGTERM and ``Engine.shutdown``) leaves nothing in /dev/shm
or the temp dir. The child logs to the host's stderr (the server's log), prefixed ``dpu[<pid>]``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import zmq

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.contract.settings import DataPlaneSettings

logger = logging.getLogger(__name__)


def auto_cpus() -> tuple[int, ...]:
    """Cores for the data plane away from the serving process: the last quarter when >= 4 cores."""
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < 4:
        return ()
    return tuple(avail[-max(1, len(avail) // 4) :])


def resolved(settings: DataPlaneSettings) -> DataPlaneSettings:
    """``settings`` as a spawned data plane runs with them: ``cpus`` None (auto) -> ``auto_cpus()``."""
    if settings.cpus is None:  # auto: away from the serving process when the machine has the cores
        return dataclasses.replace(settings, cpus=auto_cpus())
    return settings


def command(
    settings: DataPlaneSettings, endpoint: str, warm: str | None = None, regions: dict[str, int] | None = None
) -> list[str]:
    """The data plane's command line; the store URL (it may hold a password) goes to its stdin. ``warm``:
    ``protocol.Warmup`` JSON (the codec and model it will decode; it warms up before serving);
    ``regions``: destination region name -> the descriptor the child inherits (``HostRegion.fd``)."""
    settings = resolved(settings)
    cmd = [sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", endpoint, "--store", "-"]
    cmd += ["--parent-pid", str(os.getpid()), "--client-timeout", "0"]  # exits if the host dies
    cmd += ["--warm", warm] if warm else []
    cmd += [a for name, fd in (regions or {}).items() for a in ("--region-fd", f"{name}={fd}")]
    return cmd + ["--settings-json", settings.to_json()]


class _Link:
    """The DEALER socket to a data plane and the registration handshake (see module docstring)."""

    def __init__(self, ctx: zmq.Context, register: P.Register, auth_key: bytes = b"") -> None:
        self.ctx, self.register, self._auth_key = ctx, register, auth_key
        self.generation = 0
        self.sock: zmq.Socket | None = None
        self.last_pong_at = 0.0
        self.refused = ""  # the data plane's reason when it refused our last Register
        self.accepted = False  # the data plane accepted this connection's Register
        self.client_timeout_s = 0.0  # from Registered: heartbeat more often than this
        self._seq = 0

    def next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def _connect(self, endpoint: str) -> None:
        """A fresh socket on ``endpoint`` with ``Register`` and a ``Heartbeat`` queued on it."""
        self._close_sock()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES + 1024)
        if self._auth_key:
            from sgl_remote_kv.contract import auth

            auth.connect_as_client(self.sock, self._auth_key)
        self._before_connect()
        self.accepted = False
        self.sock.connect(endpoint)
        self.send(self.register)
        self.heartbeat()
        self.last_pong_at = time.monotonic()

    def _before_connect(self) -> None:
        """Called on the fresh socket before it connects (a subclass attaches its monitor here)."""

    def send(self, msg: P.Message) -> bool:
        """Queue ``msg`` without blocking; False when it cannot be queued now (no connection: a tcp://
        peer not reachable yet or its handshake failed) -- heartbeats and ``Register`` are simply sent
        again, lost submissions end as misses when the link is declared lost."""
        try:
            self.sock.send(P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def heartbeat(self) -> bool:
        return self.send(P.Heartbeat(self.next_seq(), time.time_ns()))

    def _close_sock(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def registered(self, msg: P.Registered) -> bool:
        """Record the answer to our ``Register``; True if accepted."""
        if msg.ok:
            self.refused = ""
            self.accepted = True
            self.client_timeout_s = msg.client_timeout_ms / 1000
            self.last_pong_at = time.monotonic()
        else:
            self.refused = msg.detail or "refused"
        return msg.ok

    def wait_ready(self, timeout: float) -> bool:
        """Heartbeat until the data plane answers our ``Register`` (True: accepted; False: refused --
        ``refused`` says why --, timeout, or the process exited). Drops other frames."""
        deadline = time.monotonic() + timeout
        resend = time.monotonic() + 1.0
        while time.monotonic() < deadline and self.alive():
            if time.monotonic() > resend:  # not queued, or queued on a connection that failed: again
                self.send(self.register)  # (a repeated Register of this peer replaces its own)
                resend = time.monotonic() + 1.0
            if self.sock.poll(200):
                try:
                    msg = P.decode(self.sock.recv())
                except P.ProtocolError:
                    continue
                if isinstance(msg, P.Pong):
                    self.pong(msg)
                elif isinstance(msg, P.Registered):
                    return self.registered(msg)
            else:
                self.heartbeat()
        return False

    def pong(self, msg: P.Pong) -> None:
        self.last_pong_at = time.monotonic()

    def alive(self) -> bool:
        return True


class AttachedService(_Link):
    """A shared data-plane service at ``endpoint`` (not ours to start, stop or kill). ``spawn`` only
    (re)connects; ``stop`` says ``Goodbye`` (unless ``kill``: the service is presumed dead or hung)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, register: P.Register, auth_key: bytes = b"") -> None:
        super().__init__(ctx, register, auth_key)
        self.endpoint = endpoint
        self.service_pid: int | None = None
        self.monitor: zmq.Socket | None = None  # the connection's DISCONNECTED events (a dead service)
        self._was_connected = False

    @property
    def pid(self) -> int | None:
        return self.service_pid

    def spawn(self) -> None:
        self.generation += 1
        self._close_monitor()
        self._connect(self.endpoint)
        logger.info("attaching to data-plane service %s (connection %d)", self.endpoint, self.generation)

    def _before_connect(self) -> None:
        # before connect(): an ipc:// connection can complete at once, and a monitor attached after it
        # would never see its CONNECTED event, so its DISCONNECTED would be ignored
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._was_connected = False

    def pong(self, msg: P.Pong) -> None:
        super().pong(msg)
        self.service_pid = msg.pid

    def registered(self, msg: P.Registered) -> bool:
        if msg.ok:
            self.service_pid = msg.pid
        return super().registered(msg)

    def disconnected(self) -> bool:
        """True once the connection that was up went down (the service exited or closed it): much sooner
        than a missed heartbeat. Reads the monitor's queued events; never blocks."""
        from zmq.utils.monitor import recv_monitor_message

        down = False
        while self.monitor is not None and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._was_connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._was_connected:
                down = True
        return down

    def _close_monitor(self) -> None:
        if self.monitor is not None:
            if self.sock is not None:
                self.sock.disable_monitor()
            self.monitor.close(0)
            self.monitor = None

    def returncode(self) -> int | None:
        return None

    def stop(self, kill: bool = False, grace_s: float = 0.2) -> None:
        self._close_monitor()
        if self.sock is not None and not kill:
            try:
                self.sock.setsockopt(zmq.LINGER, int(grace_s * 1000))
                self.sock.send(P.encode(P.Goodbye()), zmq.NOBLOCK)
            except zmq.ZMQError as e:  # nothing to do about it: the service times us out instead
                logger.debug("goodbye not sent: %s", e)
            self.sock.close()
            self.sock = None
        self._close_sock()


class DataPlaneProcess(_Link):
    def __init__(
        self,
        ctx: zmq.Context,
        spec: DataPlaneSettings,
        store_url: str,
        register: P.Register,
        warm: str | None = None,
        regions: dict[str, int] | None = None,
    ) -> None:
        super().__init__(ctx, register)
        self.spec, self.store_url = spec, store_url
        self.warm = warm
        self.regions = dict(regions or {})  # name -> descriptor every child inherits
        self.proc: subprocess.Popen | None = None
        self.run_dir: str | None = None  # this generation's endpoint directory, until it is accepted
        self.endpoint = ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def spawn(self) -> None:
        self.generation += 1
        self._remove_run_dir()
        self.run_dir = shm_names.run_dir()
        self.endpoint = endpoint = f"ipc://{self.run_dir}/dp.sock"
        cmd = command(self.spec, endpoint, self.warm, self.regions)
        # stdout, stderr: the host's
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=tuple(self.regions.values()))
        try:
            self.proc.stdin.write(self.store_url.encode() + b"\n")
            self.proc.stdin.close()
        except OSError:  # it died at once: the supervisor sees the exit and restarts it
            pass
        self._connect(endpoint)
        logger.info("data plane generation %d pid %d: %s", self.generation, self.proc.pid, " ".join(cmd))

    def registered(self, msg: P.Registered) -> bool:
        ok = super().registered(msg)
        if ok:
            self._remove_run_dir()  # connected: the socket file has done its job
        return ok

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, kill: bool = False, grace_s: float = 5.0) -> None:
        """SIGTERM (or SIGKILL when ``kill``) and reap; SIGKILL if it outlives ``grace_s``."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("data plane pid %d ignored SIGTERM; killing", p.pid)
                p.kill()
                p.wait()
        self._close_sock()
        self._remove_run_dir()
