"""A real ``--remote-kv dpu`` server attached to a data-plane service (``--remote-kv-dpu-endpoint``):
no private data plane is spawned, remote hits come through the service with the recompute's tokens,
a killed service makes requests recompute (same tokens), a restarted one serves hits again, and the
server stopped by SIGTERM detaches from it (one INFO ``detached (goodbye)`` line, no drop). Twice:
the server reaching the store itself, and the server given only the service's store proxy
(``--remote-kv-store dpu+ipc://...``: its lookups and write-backs go through the service too)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.fixtures.faults import ask, data_plane_procs, make_case, prime, wait_full_hit
from tests.fixtures.remote_kv_server import CHUNK, remote_kv_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~50 s; the service's contracts: tests/test_dpu_service.py


def _service(endpoint: str, store_url: str, log, store_ep: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", endpoint, "--store", store_url]
    cmd += ["--store-endpoint", store_ep]
    return subprocess.Popen(cmd + ["--log-level", "INFO"], stdout=log, stderr=log)


@pytest.mark.parametrize("server_store", ["direct", "through_the_service"])
def test_server_attached_to_a_service_hits_misses_and_recovers(model_dir, tmp_path, server_store):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    url = f"file://{tmp_path / 'store'}"
    ep, store_ep = f"ipc://{tmp_path}/dpu.sock", f"ipc://{tmp_path}/store.sock"
    log = open(tmp_path / "service.log", "ab")
    svc = _service(ep, url, log, store_ep)
    server_url = url if server_store == "direct" else f"dpu+{store_ep}"
    try:
        with remote_kv_server(
            model_dir, server_url, "--remote-kv-policy-margin", "1e9", "--remote-kv-dpu-endpoint", ep
        ) as srv:
            case = prime(srv, make_case(tok, "dpu-service"))
            assert data_plane_procs(srv.proc.pid) == []  # attached: no data plane of its own
            _, hit = ask(srv, case)  # tokens equal the recompute's
            assert hit == case.chunks * CHUNK
            svc.kill()
            svc.wait()
            _, hit = ask(srv, case)  # the service is gone: a miss, recomputed, same tokens
            assert hit == 0
            svc = _service(ep, url, log, store_ep)
            assert wait_full_hit(srv, case, timeout=120) == case.chunks * CHUNK
            assert data_plane_procs(srv.proc.pid) == []
        # the server stopped cleanly (SIGTERM): it said goodbye after its write-back drained, so the
        # service logs one INFO detach line, not a WARNING about a client gone silent
        text = (tmp_path / "service.log").read_text
        deadline = time.monotonic() + 15
        while "detached (goodbye)" not in text() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # past nothing but the goodbye: no drop may follow it
        lines = text().splitlines()
        assert len([ln for ln in lines if " INFO " in ln and "detached (goodbye)" in ln]) == 1, lines
        assert not [ln for ln in lines if "dropped (" in ln], lines
    finally:
        if svc.poll() is None:
            svc.kill()
        svc.wait()
        log.close()
