"""Spawning, watching and stopping the data-plane process, and its ZeroMQ DEALER socket.

Threads: ``spawn``/``wait_ready``/``stop`` run on the thread that owns the client (``start``/``close``)
or on the DPU client's receiver thread (restarts); never concurrently. ``sock`` is used only by that
thread. Each generation gets a fresh IPC endpoint and socket, so late frames of a dead process can
never be mistaken for the new one's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from sgl_remote_kv.dpu import protocol as P
from sgl_remote_kv.dpu.settings import DataPlaneSettings

logger = logging.getLogger(__name__)


def auto_cpus() -> tuple[int, ...]:
    """Cores for the data plane away from the serving process: the last quarter when >= 4 cores."""
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < 4:
        return ()
    return tuple(avail[-max(1, len(avail) // 4) :])


def command(settings: DataPlaneSettings, endpoint: str, dest_name: str, warm: str | None = None) -> list[str]:
    """The data plane's command line; the store URL (it may hold a password) goes to its stdin. ``warm``:
    ``protocol.Warmup`` JSON (the codec and model it will decode; it warms up before serving)."""
    if settings.cpus is None:  # auto: away from the serving process when the machine has the cores
        settings = dataclasses.replace(settings, cpus=auto_cpus())
    cmd = [sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", endpoint, "--store", "-"]
    cmd += ["--dest-shm", dest_name, "--parent-pid", str(os.getpid())]  # exits if the host dies
    cmd += ["--warm", warm] if warm else []
    return cmd + ["--settings-json", settings.to_json()]


class DataPlaneProcess:
    def __init__(
        self, ctx: zmq.Context, spec: DataPlaneSettings, store_url: str, dest_name: str, tmp: str,
        warm: str | None = None,
    ) -> None:  # fmt: skip
        self.ctx, self.spec, self.store_url, self.dest_name = ctx, spec, store_url, dest_name
        self.warm = warm
        self.tmp = Path(tmp)
        self.generation = 0
        self.proc: subprocess.Popen | None = None
        self.sock: zmq.Socket | None = None
        self.last_pong_at = 0.0
        self._seq = 0
        self.log_path: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def spawn(self) -> None:
        self.generation += 1
        endpoint = f"ipc://{self.tmp}/dp-{self.generation}.sock"
        self.log_path = self.tmp / f"dp-{self.generation}.log"
        cmd = command(self.spec, endpoint, self.dest_name, self.warm)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=log)
        try:
            self.proc.stdin.write(self.store_url.encode() + b"\n")
            self.proc.stdin.close()
        except OSError:  # it died at once: the supervisor sees the exit and restarts it
            pass
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES + 1024)
        self.sock.connect(endpoint)
        self.last_pong_at = time.monotonic()
        logger.info("data plane generation %d pid %d: %s", self.generation, self.proc.pid, " ".join(cmd))

    def wait_ready(self, timeout: float) -> bool:
        """Heartbeat until the first Pong (True) or timeout / process exit (False). Drops other frames."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            self.sock.send(P.encode(P.Heartbeat(self.next_seq(), time.time_ns())), zmq.NOBLOCK)
            if self.sock.poll(200):
                try:
                    msg = P.decode(self.sock.recv())
                except P.ProtocolError:
                    continue
                if isinstance(msg, P.Pong):
                    self.pong(msg)
                    return True
        return False

    def pong(self, msg: P.Pong) -> None:
        self.last_pong_at = time.monotonic()

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
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
