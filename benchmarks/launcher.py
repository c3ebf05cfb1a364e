"""Start and stop a real SGLang server as a child process (used by the demo, tests and benchmarks).

``SGLangServer`` is a context manager: it launches ``python -m sglang.launch_server`` in its own process
group with the CPU platform plugin enabled when asked, waits for ``/health``, and on exit sends SIGTERM to
the whole group (SIGKILL after a grace period) so no scheduler subprocess outlives it, also on failure.
A port picked here (``ServerSpec.port`` 0) can be taken by another process before the server binds it;
the server then logs the bind error and hangs instead of exiting: that start fails fast (``PortInUse``)
and is retried on another free port (at most ``START_ATTEMPTS`` times).

The server's log (stdout and stderr) goes to ``ServerSpec.log_path`` (the caller's file: kept), or else to
``server-<port>.log`` in a temporary directory the launcher owns (``srkv-server-*`` under ``$TMPDIR``):
removed when the server it started is stopped (``log_text()`` still answers from memory afterwards), kept
when the server failed to start (the error names the file) or had exited by itself before ``stop`` (a
warning names it).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sgl_remote_kv import env

logger = logging.getLogger(__name__)

CPU_ARGS = (
    "--device",
    "cpu",
    "--sleep-on-idle",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
)


START_ATTEMPTS = 3
BIND_ERROR = "address already in use"  # uvicorn's log line when the HTTP port is taken


class PortInUse(RuntimeError):
    """The server could not bind its HTTP port."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    model_path: str
    extra_args: tuple[str, ...] = ()
    dtype: str = "float32"
    max_total_tokens: int = 16384
    cpu: bool = True
    port: int = 0  # 0 -> pick a free port
    log_path: str | None = None
    env: dict = field(default_factory=dict)
    startup_timeout_s: float = 300.0
    python: str = ""  # the interpreter that runs SGLang ("": this one), e.g. another virtual environment's
    cwd: str | None = None  # the server's working directory (None: this process's)


class SGLangServer:
    """A running server; ``base_url`` is valid inside the ``with`` block."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.healthy = False  # the last start reached /health
        # the log directory this launcher owns (no ServerSpec.log_path), until it is removed
        self._log_dir: Path | None = None if spec.log_path else Path(tempfile.mkdtemp(prefix="srkv-server-"))
        self._final_log: str | None = None  # the owned log's text, once its file is removed
        self._use_port(spec.port or free_port())

    def _use_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{self.port}"
        if self.spec.log_path:
            self.log_path = Path(self.spec.log_path)
        elif self._log_dir is not None:
            self.log_path = self._log_dir / f"server-{self.port}.log"

    def command(self) -> list[str]:
        cmd = [
            self.spec.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.spec.model_path,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            self.spec.dtype,
            "--max-total-tokens",
            str(self.spec.max_total_tokens),
        ]
        if self.spec.cpu:
            cmd += CPU_ARGS
        return cmd + list(self.spec.extra_args)

    def start(self) -> SGLangServer:
        """Launch and wait for ``/health``; on a taken port (``PortInUse``) retry on another free port
        unless ``ServerSpec.port`` fixed it."""
        attempt = 1
        while True:
            try:
                return self._start_once()
            except PortInUse:
                if self.spec.port or attempt >= START_ATTEMPTS:
                    raise
                logger.warning("port %d was taken before the server bound it; retrying on another", self.port)
                self._use_port(free_port())
                attempt += 1

    def _start_once(self) -> SGLangServer:
        child_env = dict(os.environ, **self.spec.env)
        if self.spec.cpu:
            child_env[env.CPU_PLATFORM] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        logger.info("starting: %s (log %s)", " ".join(self.command()), self.log_path)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        log.close()
        self.healthy = False
        try:
            self._wait_healthy()
        except BaseException:  # also Ctrl-C / SIGTERM during startup: never leave a server behind
            self.stop()  # the log is kept: not healthy
            raise
        self.healthy = True
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during startup (log kept: {self.log_path}); "
                    f"last log lines:\n{self.log_tail()}"
                )
            if BIND_ERROR in self.log_text():
                raise PortInUse(f"port {self.port} is taken (log: {self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"server not healthy after {self.spec.startup_timeout_s}s (log kept: {self.log_path}):\n"
            f"{self.log_tail()}"
        )

    def log_text(self) -> str:
        """The server's log so far (after ``stop`` removed a launcher-owned log: its last text)."""
        if self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return self._final_log or ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's main process (SGLang's own shutdown stops its children in order), then
        the process group if anything is left after half of ``grace_s``, then SIGKILL. Signalling the
        whole group first kills the scheduler under SGLang's subprocess watchdog, which then logs it
        as a crash. Idempotent. Then the launcher-owned log is removed (see module docstring)."""
        exited_by_itself = self.proc is not None and self.healthy and self.proc.poll() is not None
        try:
            self._stop_processes(grace_s)
        finally:
            self._release_log(keep=exited_by_itself)

    def _release_log(self, keep: bool) -> None:
        """Remove the launcher-owned log directory once the server it started was stopped; keep it when
        the server did not start (the start's error names the file) or ``keep`` (it had exited by itself)."""
        if self._log_dir is None:
            return  # the caller's log, or already removed or kept
        if self.proc is None:  # never started: nothing was logged
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
            return
        if self.proc.poll() is None:
            return  # still running (it would not stop): keep it
        if not self.healthy:
            return  # a failed start: its log is the evidence
        if keep:
            logger.warning(
                "server pid %d had exited by itself (status %s); its log is kept: %s",
                self.proc.pid,
                self.proc.returncode,
                self.log_path,
            )
            self._log_dir = None  # kept for good
            return
        self._final_log = self.log_text()
        shutil.rmtree(self._log_dir, ignore_errors=True)
        self._log_dir = None

    def _stop_processes(self, grace_s: float) -> None:
        if self.proc is None or not self._alive():
            return
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        half = time.monotonic() + grace_s / 2
        while time.monotonic() < half and self._alive():
            time.sleep(0.2)
        if self._alive():
            _signal_group(self.proc.pid, signal.SIGTERM)
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.2)
        if self._alive():
            logger.warning("server group %d ignored SIGTERM; killing", self.proc.pid)
            _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _alive(self) -> bool:
        """True while the launcher or any process of its group runs (reaps the launcher first, so its own
        zombie does not count as alive)."""
        self.proc.poll()
        return self.proc.returncode is None or _group_alive(self.proc.pid)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
