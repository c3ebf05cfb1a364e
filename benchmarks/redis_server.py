"""Start and stop throwaway ``redis-server`` processes (standalone or a 3-node cluster).

Used by the tests, the store benchmark and the e2e benchmark; not by the serving path. Servers bind
to loopback (or to an address inside a network namespace we created), keep no persistence, live in
a caller-provided directory, and are stopped by PID.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def require_redis() -> None:
    """Raise a clear error if the Redis binaries are not installed (never skip silently)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not found: install Debian's redis-server and redis-tools "
            "(scripts/setup_env.sh does; or `apt-get install -y redis-server redis-tools`)"
        )


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 too, for a cluster node's bus)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55000)
        if _bindable(port) and (not cluster_bus or _bindable(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up (a password-protected one too)
    except OSError:
        return False


@dataclass
class RedisServer:
    """One ``redis-server`` process. ``start()`` blocks until it answers PING."""

    workdir: Path
    port: int
    host: str = "127.0.0.1"
    cluster: bool = False
    netns: str | None = None
    extra_args: Sequence[str] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def command(self) -> list[str]:
        d = self.workdir
        cmd = ["redis-server", "--port", str(self.port), "--bind", self.host, "--dir", str(d)]
        cmd += ["--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"]
        cmd += ["--logfile", str(d / "redis.log"), "--pidfile", str(d / "redis.pid")]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
            cmd += ["--cluster-node-timeout", "1500"]
        cmd += list(self.extra_args)
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd

    def start(self, timeout: float = 15.0) -> RedisServer:
        require_redis()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # `ip netns exec` execs the command, so proc.pid is redis-server's PID in both cases.
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: {self.log_tail()}")
            if self._ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout}s")

    def _ready(self) -> bool:
        if not self.netns:
            return ping(self.host, self.port)
        r = subprocess.run(
            ["ip", "netns", "exec", self.netns, "redis-cli", "-h", self.host, "-p", str(self.port), "ping"],
            capture_output=True,
            text=True,
        )
        return r.stdout.strip() == "PONG"

    def log_tail(self, n: int = 20) -> str:
        p = self.workdir / "redis.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else "(no log)"

    def stop(self, kill: bool = False) -> None:
        """Stop by PID: SIGTERM (SIGKILL if ``kill`` or if it does not exit in 5 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"


@dataclass
class RedisCluster:
    """A cluster of ``n`` masters with ``replicas`` replicas each on loopback, created with
    ``redis-cli --cluster create --cluster-replicas``."""

    workdir: Path
    n: int = 3
    replicas: int = 0
    nodes: list[RedisServer] = field(default_factory=list)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        require_redis()
        try:
            for i in range(self.n * (1 + self.replicas)):
                node = RedisServer(self.workdir / f"node{i}", free_port(cluster_bus=True), cluster=True)
                self.nodes.append(node.start())
            addrs = [f"127.0.0.1:{s.port}" for s in self.nodes]
            r = subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *addrs,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if r.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed: {r.stdout[-2000:]} {r.stderr[-2000:]}"
                )
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Block until every running node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self._state(s) for s in self.nodes if s.proc and s.proc.poll() is None]
            if states and all(st == "ok" for st in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"redis cluster not ok after {timeout}s")

    @staticmethod
    def _state(node: RedisServer) -> str:
        r = subprocess.run(
            ["redis-cli", "-p", str(node.port), "cluster", "info"], capture_output=True, text=True
        )
        for line in r.stdout.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    def masters(self) -> list[RedisServer]:
        """The running nodes that currently serve slots as masters."""
        out = []
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            r = subprocess.run(["redis-cli", "-p", str(node.port), "role"], capture_output=True, text=True)
            if r.stdout.startswith("master"):
                out.append(node)
        return out

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)
