"""The server launcher when its HTTP port is taken between picking it and the server binding it (seen in CI:
uvicorn logs the bind error and the server hangs instead of exiting, so the start waited its whole
timeout). A stand-in server (a child process, the fault) plays that: the launcher fails that start fast
and retries on another free port; with a fixed port it fails fast with ``PortInUse``."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from benchmarks.launcher import PortInUse, ServerSpec, SGLangServer

FAKE = textwrap.dedent(
    """
    import http.server, os, sys, time
    port, marker = int(sys.argv[1]), sys.argv[2]
    if not os.path.exists(marker):  # the first start: its port was taken; it says so and hangs
        open(marker, "w").close()
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        time.sleep(600)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


class FakeServer(SGLangServer):
    script = marker = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port), self.marker]


def _server(tmp_path, port: int = 0) -> FakeServer:
    srv = FakeServer(
        ServerSpec(
            model_path="unused",
            cpu=False,
            port=port,
            startup_timeout_s=60,
            log_path=str(tmp_path / f"server-{port}.log"),
        )
    )
    srv.script, srv.marker = FAKE, str(tmp_path / "first-start")
    return srv


def test_a_taken_port_is_retried_on_another(tmp_path):
    srv = _server(tmp_path)
    first = srv.port
    t0 = time.monotonic()
    with srv:
        assert srv.port != first and time.monotonic() - t0 < 20  # not the 60 s startup timeout
        import urllib.request

        with urllib.request.urlopen(srv.base_url + "/health", timeout=5) as r:
            assert r.status == 200
    assert not srv._alive()


def test_a_fixed_port_that_is_taken_fails_fast(tmp_path):
    from benchmarks.launcher import free_port

    srv = _server(tmp_path, port=free_port())
    t0 = time.monotonic()
    with pytest.raises(PortInUse, match="is taken"):
        srv.start()
    assert time.monotonic() - t0 < 20
    assert not srv._alive()  # the hung first start was stopped


# ---- the server log: removed with a server the launcher stopped, kept for one that did not start ---------

HEALTHY = textwrap.dedent(
    """
    import http.server, sys
    print("fake server up", flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)
DOOMED = "import sys; print('loading the model ... out of memory', flush=True); sys.exit(3)"


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """``$TMPDIR`` for the launcher's own log directories: ``tmp_path/tmp`` (checked empty at the end)."""
    import tempfile

    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _owned_log_server(script: str) -> FakeServer:
    srv = FakeServer(ServerSpec(model_path="unused", cpu=False, startup_timeout_s=60))  # no log_path
    srv.script = script
    return srv


def test_a_stopped_server_leaves_no_log_file_behind(own_tmp):
    srv = _owned_log_server(HEALTHY)
    log = srv.log_path
    assert log.parent.parent == own_tmp and log.parent.name.startswith("srkv-server-")
    with srv:
        assert log.exists() and "fake server up" in srv.log_text()
    assert not srv._alive()
    assert list(own_tmp.iterdir()) == []  # the launcher's log directory is gone
    assert "fake server up" in srv.log_text()  # still readable after the stop (tests read it then)
    srv.stop()  # idempotent


def test_a_server_that_fails_to_start_keeps_its_log_and_the_error_names_it(own_tmp):
    srv = _owned_log_server(DOOMED)
    with pytest.raises(RuntimeError, match="exited with 3 during startup") as e:
        srv.start()
    log = srv.log_path
    assert f"log kept: {log}" in str(e.value) and "out of memory" in str(e.value)
    assert log.exists() and "out of memory" in log.read_text()
    srv.stop()  # stopping it again does not remove the evidence
    assert log.exists()


def test_a_caller_given_log_path_is_never_removed(tmp_path, own_tmp):
    path = tmp_path / "mine.log"
    srv = FakeServer(ServerSpec(model_path="unused", cpu=False, startup_timeout_s=60, log_path=str(path)))
    srv.script = HEALTHY
    with srv:
        pass
    assert "fake server up" in path.read_text() and list(own_tmp.iterdir()) == []
