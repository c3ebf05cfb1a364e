"""The data plane as a long-lived service (``python -m sgl_remote_kv.dpu --endpoint ...``) shared by many
host clients (``DpuClient`` with ``endpoint``): isolation, fairness across clients, clients that die, a
service that dies and comes back. Registration checks and the authenticated tcp:// endpoint:
``test_dpu_service_auth.py``.

Every service here is a real process on the embedded file store; every client a real ``DpuClient``
(two clients stand in for two TP ranks: different fingerprints, different destination regions).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from dpu_helpers import CHUNK, codecs, make_pool, put_chunks
from dpu_service_helpers import (
    CB,
    LAYOUT32,
    ask,
    assert_exact,
    random_kv,
    rank_fp,
    raw_socket,
    service_env,
    service_stats,
    slots_flags,
    wait_until,
)

from sgl_remote_kv.contract import protocol as P


@pytest.fixture
def env(tmp_path):
    yield from service_env(tmp_path)


# ---- sharing ---------------------------------------------------------------------------------------


def test_two_clients_share_one_service_token_identical(env):
    """Two ranks (different fingerprints and regions) on one service: float32 + lossless KV arrives
    token-identical in each rank's pool, concurrently; one service process serves both."""
    url, make_service, make_client = env
    svc = make_service(*slots_flags())
    data = {r: random_kv(5, seed=10 + r) for r in (0, 1)}
    keys = {
        r: put_chunks(url, codecs()["lossless"], data[r], rank_fp(r), prefix=b"r%d" % r)[0] for r in (0, 1)
    }
    c0, c1 = make_client(svc, rank_fp(0)), make_client(svc, rank_fp(1))
    assert c0.pid == c1.pid == svc.proc.pid  # both attached to the one service, none spawned
    assert c0.dest.name != c1.dest.name
    targets = {r: make_pool(LAYOUT32, 512, 5 * CHUNK, seed=r) for r in (0, 1)}
    h0 = c0.submit("a", keys[0], CHUNK, targets[0])
    h1 = c1.submit("b", keys[1], CHUNK, targets[1])
    r0, r1 = h0.wait(timeout=30), h1.wait(timeout=30)
    assert (r0.hit_chunks, r1.hit_chunks) == (5, 5) and not r0.failures and not r1.failures
    assert_exact(targets[0], data[0], 5)
    assert_exact(targets[1], data[1], 5)
    st = service_stats(c0)
    assert st["clients"] == 2 and st["registered"] == 2 and st["rejected"] == 0
    # a rank asking for the other rank's chunks gets foreign chunks (fingerprint), never its KV
    res = c0.fetch("x", keys[1][:1], CHUNK, make_pool(LAYOUT32, 512, CHUNK), timeout=30)
    assert res.hit_chunks == 0 and res.failures[0] == "foreign"


def test_a_big_job_does_not_starve_another_clients_small_one(env):
    """One staging slot of one chunk, a slow copy stage: client A's 8-chunk job is 8 data-plane rounds.
    Client B's 1-chunk job, submitted after A's, is admitted round-robin and finishes while A's is
    still running (FIFO admission would finish it after all 8)."""
    url, make_service, make_client = env
    svc = make_service(*slots_flags(slots=1, chunks_per_slot=1), "--dma-delay-s", "0.1")
    a_data, b_data = random_kv(8, seed=1), random_kv(1, seed=2)
    a_keys, _ = put_chunks(url, codecs()["lossless"], a_data, rank_fp(0), prefix=b"a")
    b_keys, _ = put_chunks(url, codecs()["lossless"], b_data, rank_fp(1), prefix=b"b")
    a, b = make_client(svc, rank_fp(0), dest_chunks=8), make_client(svc, rank_fp(1))
    ta, tb = make_pool(LAYOUT32, 512, 8 * CHUNK, seed=1), make_pool(LAYOUT32, 512, CHUNK, seed=2)
    ha = a.submit("big", a_keys, CHUNK, ta)
    wait_until(lambda: service_stats(a)["submitted"] >= 1, 10, "A's job at the service")
    hb = b.submit("small", b_keys, CHUNK, tb)
    rb = hb.wait(timeout=30)
    a_done_when_b_done = ha.wait(timeout=0) is not None
    ra = ha.wait(timeout=60)
    assert rb.hit_chunks == 1 and ra.hit_chunks == 8
    assert not a_done_when_b_done, "B's one-round job waited for all of A's rounds"
    assert_exact(ta, a_data, 8)
    assert_exact(tb, b_data, 1)


# ---- clients that leave or die ---------------------------------------------------------------------


def test_goodbye_releases_the_client_at_once(env):
    url, make_service, make_client = env
    svc = make_service(*slots_flags())
    c0, c1 = make_client(svc, rank_fp(0)), make_client(svc, rank_fp(1))
    assert service_stats(c1)["clients"] == 2
    region = c0.dest.name.lstrip("/")
    maps = Path(f"/proc/{svc.proc.pid}/maps")
    assert region in maps.read_text()
    c0.close()  # Goodbye; the client unlinks its own region
    st = service_stats(c1)
    assert st["clients"] == 1 and st["clients_dropped"] == 1
    wait_until(lambda: region not in maps.read_text(), 3, "the service to unmap the region")


def test_a_graceful_scheduler_exit_detaches_at_info_not_dropped_with_a_warning(env):
    """A server stopped cleanly (SIGTERM / ``Engine.shutdown``: SGLang's ``release_host_resources`` ->
    ``RemoteKVLinker.close`` -> ``RemoteKVRuntime.on_shutdown``) drains its write-back, then closes its
    fetch paths: the attached DPU client says ``Goodbye`` and the service logs one INFO ``detached
    (goodbye)`` line -- not, ``--client-timeout`` later, the WARNING of a client that went silent."""
    import threading

    from sgl_remote_kv import runtime
    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.fetch.base import FetchPath
    from sgl_remote_kv.fetch.dpu import DpuFetchBackend
    from sgl_remote_kv.store.client import open_client
    from sgl_remote_kv.types import PathName

    url, make_service, make_client = env
    svc = make_service(*slots_flags(), "--client-timeout", "1")
    c = make_client(svc, rank_fp(0))
    codec = codecs()["lossless"]
    path = FetchPath(PathName.DPU, DpuFetchBackend(c, None, CHUNK), codec)
    cfg = RemoteKVConfig(mode="dpu", chunk_size=CHUNK)
    rt = runtime.build(cfg, rank_fp(0), codec, open_client(url), [path], threading.Event())
    assert service_stats(c)["clients"] == 1
    rt.on_shutdown()
    wait_until(lambda: b"detached (goodbye)" in svc.log.read_bytes(), 5, "the goodbye")
    time.sleep(1.5)  # past the service's client timeout: nothing more is said about this client
    lines = svc.log.read_text().splitlines()
    assert not [ln for ln in lines if "WARNING" in ln or "ERROR" in ln], lines
    (bye,) = [ln for ln in lines if "detached (goodbye)" in ln]
    assert " INFO " in bye and "pid" in bye, bye
    rt.close()  # idempotent: the paths are closed already


_DYING_CLIENT = """
import sys, time
sys.path.insert(0, {tests!r})
from dpu_helpers import CHUNK, codecs
from dpu_service_helpers import CB, rank_fp
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
cfg = DpuClientConfig({url!r}, dest_slot_bytes=8 * CB, endpoint={ep!r}, heartbeat_s=0.2)
c = DpuClient(cfg, rank_fp(0), codecs()["lossless"])
c.start()
keys = [bytes.fromhex(k) for k in {keys!r}]
c.submit("doomed", keys, CHUNK, None)
print(c.dest.name.lstrip("/"), flush=True)
time.sleep(120)
"""


def test_a_client_that_dies_releases_its_region_and_jobs(env, tmp_path):
    """A client process SIGKILLed mid-fetch: after the client timeout its job is cancelled (the slow
    store would have kept the service busy for 8 x 0.4 s) and its region, whose creator is gone, is
    unlinked; another client is served throughout."""
    url, make_service, make_client = env
    slow = f"faulty+file://{tmp_path}/store?latency_s=0.4"
    svc = make_service(*slots_flags(), "--client-timeout", "1", store_url=slow)
    keys, _ = put_chunks(url, codecs()["lossless"], random_kv(8, seed=3), rank_fp(0), prefix=b"d")
    other = make_client(svc, rank_fp(1))
    script = _DYING_CLIENT.format(
        tests=str(Path(__file__).parent), url=url, ep=svc.endpoint, keys=[k.hex() for k in keys]
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        region = host.stdout.readline().strip()
        assert region and Path("/dev/shm", region).exists()
        wait_until(lambda: service_stats(other)["submitted"] >= 1, 10, "the doomed job at the service")
        assert service_stats(other)["clients"] == 2
        host.kill()
        host.wait()
        wait_until(lambda: service_stats(other)["clients_dropped"] >= 1, 5, "the dead client to be dropped")
        wait_until(lambda: other.last_pong.jobs_active == 0, 3, "its job to be cancelled")
        wait_until(lambda: not Path("/dev/shm", region).exists(), 3, "its region to be unlinked")
        maps = Path(f"/proc/{svc.proc.pid}/maps")
        wait_until(lambda: region not in maps.read_text(), 3, "the service to unmap its region")
        assert service_stats(other)["clients"] == 1
        lines = svc.log.read_text().splitlines()  # a silent client, unlike one that said Goodbye
        (dropped,) = [ln for ln in lines if "dropped (silent for" in ln]
        assert " WARNING " in dropped, dropped
        assert not [ln for ln in lines if "detached" in ln], lines
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{region}")
    mine, _ = put_chunks(url, codecs()["lossless"], random_kv(1, seed=4), rank_fp(1), prefix=b"o")
    assert other.fetch("alive", mine, CHUNK, None, timeout=30).hit_chunks == 1


# ---- the service dies and comes back ---------------------------------------------------------------


def test_service_killed_then_restarted_misses_then_reconnects(env, tmp_path):
    url, make_service, make_client = env
    data = random_kv(6, seed=5)
    keys, _ = put_chunks(url, codecs()["lossless"], data, rank_fp(0))
    slow = f"faulty+file://{tmp_path}/store?latency_s=0.3"
    svc = make_service(*slots_flags(), store_url=slow)
    c = make_client(svc, rank_fp(0))
    restarts: list[str] = []
    c.on_restart = restarts.append
    h = c.submit("inflight", keys, CHUNK, make_pool(LAYOUT32, 512, 6 * CHUNK))
    time.sleep(0.5)
    svc.kill()
    res = h.wait(timeout=15)
    assert res is not None and res.hit_chunks < 6 and "dataplane_lost" in res.failures.values()
    t0 = time.monotonic()  # while the service is down, a fetch is a miss at once, never a hang
    res = c.fetch("down", keys[:2], CHUNK, None, timeout=15)
    assert res.hit_chunks == 0 and res.failures[0] == "dataplane_lost" and time.monotonic() - t0 < 3
    cpu0 = time.process_time()  # reconnecting to a dead endpoint does not spin
    time.sleep(1.0)
    assert time.process_time() - cpu0 < 0.3
    svc2 = make_service(*slots_flags())  # same endpoint, a new process
    wait_until(lambda: c.supervisor.registered and c.pid == svc2.proc.pid, 30, "the client to register again")
    target = make_pool(LAYOUT32, 512, 6 * CHUNK, seed=7)
    res = c.fetch("back", keys, CHUNK, target, timeout=30)
    assert res.hit_chunks == 6
    assert_exact(target, data, 6)
    assert restarts and restarts[0] == "exited"  # the connection's DISCONNECTED event, not a timeout


def test_quick_service_restart_is_noticed_at_once(env):
    """A service replaced faster than the heartbeat timeout: the dropped connection (or, at the latest,
    the new service's first Pong, which does not know the client) makes the client register again."""
    url, make_service, make_client = env
    data = random_kv(2, seed=6)
    keys, _ = put_chunks(url, codecs()["lossless"], data, rank_fp(0))
    svc = make_service(*slots_flags())
    c = make_client(svc, rank_fp(0), heartbeat_timeout_s=30.0)
    restarts: list[str] = []
    c.on_restart = restarts.append
    svc.kill()
    svc2 = make_service(*slots_flags())
    wait_until(lambda: c.pid == svc2.proc.pid and c.supervisor.registered, 30, "the client to register again")
    assert restarts in (["exited"], ["restarted"])
    target = make_pool(LAYOUT32, 512, 2 * CHUNK)
    assert c.fetch("again", keys, CHUNK, target, timeout=30).hit_chunks == 2
    assert_exact(target, data, 2)


def test_fair_queue_round_robin_across_clients():
    from sgl_remote_kv.dpu.tasks import FairQueue

    q = FairQueue()
    for i in range(4):
        q.append(b"A", f"a{i}")
    q.append(b"B", "b0")
    q.append(b"C", "c0")
    q.append(b"B", "b1")
    assert len(q) == 7
    assert [q.popleft() for _ in range(4)] == ["a0", "b0", "c0", "a1"]
    q.filter(b"A", lambda x: None if x == "a3" else x)  # e.g. a cancelled round
    assert q.pop_client(b"B") == ["b1"]
    assert [q.popleft() for _ in range(len(q))] == ["a2"] and not q


def test_two_ranks_on_a_killed_service_both_end_as_misses(env, tmp_path):
    url, make_service, make_client = env
    slow = f"faulty+file://{tmp_path}/store?latency_s=0.3"
    svc = make_service(*slots_flags(), store_url=slow)
    keys = {
        r: put_chunks(url, codecs()["lossless"], random_kv(6, seed=20 + r), rank_fp(r), prefix=b"k%d" % r)[0]
        for r in (0, 1)
    }
    # heartbeats would notice only after 30 s: the dropped connection is what ends the fetches
    clients = {r: make_client(svc, rank_fp(r), heartbeat_timeout_s=30.0) for r in (0, 1)}
    handles = {
        r: clients[r].submit(f"r{r}", keys[r], CHUNK, make_pool(LAYOUT32, 512, 6 * CHUNK)) for r in (0, 1)
    }
    time.sleep(0.5)
    svc.kill()
    t0 = time.monotonic()
    for r in (0, 1):
        res = handles[r].wait(timeout=15)
        assert res is not None and res.hit_chunks < 6 and "dataplane_lost" in res.failures.values()
    assert time.monotonic() - t0 < 3


def test_serving_flag_attaches_the_backend_to_the_service(env):
    """``--remote-kv-dpu-endpoint`` parses into the config and ``start_dpu_backend`` (the serving glue)
    attaches instead of spawning; a refused registration falls back (``None``) instead of failing."""
    import argparse

    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.fetch.dpu import start_dpu_backend

    url, make_service, _ = env
    svc = make_service(*slots_flags(), "--allow-fingerprint", rank_fp(0).digest().hex())
    parser = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--remote-kv",
            "dpu",
            "--remote-kv-store",
            url,
            "--remote-kv-chunk-size",
            str(CHUNK),
            "--remote-kv-dpu-endpoint",
            svc.endpoint,
        ]
    )
    ns.remote_kv_probe_store = False
    cfg = RemoteKVConfig.from_namespace(ns)
    assert cfg.dpu_endpoint == svc.endpoint and RemoteKVConfig.from_json(cfg.to_json()) == cfg
    for bad in ("redis://x:1", "ipc://"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--remote-kv-dpu-endpoint", bad])
    data = random_kv(2, seed=30)
    keys, _ = put_chunks(url, codecs()["lossless"], data, rank_fp(0))
    target = make_pool(LAYOUT32, 512, 2 * CHUNK)
    backend = start_dpu_backend(cfg, rank_fp(0), codecs()["lossless"], target.writer)
    assert backend is not None
    try:
        assert backend.client.pid == svc.proc.pid and backend.client._attached
        assert backend.client.fetch("glue", keys, CHUNK, target, timeout=30).hit_chunks == 2
        assert_exact(target, data, 2)
    finally:
        backend.close()
    assert start_dpu_backend(cfg, rank_fp(1), codecs()["lossless"], target.writer) is None  # not allowed


def test_a_reconnect_is_answered_only_after_the_old_jobs_are_over(env):
    """A new connection registering an active client's session (what a client does after missing
    heartbeats while the service lives) replaces the registration; its ``Registered`` comes only once
    the old registration's job is over, so no destination slot is reused under a still-running copy."""
    from dpu_helpers import register_raw

    url, make_service, make_client = env
    svc = make_service(*slots_flags(slots=1, chunks_per_slot=3), "--dma-delay-s", "0.3")
    keys, _ = put_chunks(url, codecs()["lossless"], random_kv(3, seed=40), rank_fp(0))
    # No heartbeats during the test: a Pong saying "not registered" would make the real client register
    # its session again, and the newest registration of a session is the one that waits (the raw
    # socket's would then never be answered: a race this test used to lose under load).
    c = make_client(svc, rank_fp(0), heartbeat_s=60.0, heartbeat_timeout_s=120.0)
    h = c.submit("old", keys, CHUNK, make_pool(LAYOUT32, 512, 3 * CHUNK))
    with raw_socket(svc.endpoint) as s:  # the service answers an unregistered connection's heartbeat too
        wait_until(
            lambda: json.loads(ask(s, P.Heartbeat(0, 0), P.Pong).stats_json)["submitted"] >= 1,
            10,
            "the job at the service",
        )
        time.sleep(0.2)  # its first slab is being copied (0.3 s per slab, 6 slabs)
        register_raw(s, c)  # same session, new connection: returns once Registered(ok) arrived
        pong = ask(s, P.Heartbeat(1, 0), P.Pong)
        st = json.loads(pong.stats_json)
        assert pong.registered and pong.jobs_active == 0 and st["register_deferred"] == 1
    res = h.wait(timeout=30)
    assert res.hit_chunks < 3 and set(res.failures.values()) <= {"cancelled", "dataplane_lost"}


def test_a_client_the_service_forgot_registers_again(env):
    """The service dropped the client's registration while the connection stays up (here: another
    connection took over its session; in production: the client was silent past the client timeout):
    the next Pong says so (``registered`` False) and the client registers again and is served."""
    from dpu_helpers import register_raw

    url, make_service, make_client = env
    keys, _ = put_chunks(url, codecs()["lossless"], random_kv(1, seed=60), rank_fp(0))
    svc = make_service(*slots_flags())
    c = make_client(svc, rank_fp(0), heartbeat_timeout_s=30.0)
    restarts: list[str] = []
    c.on_restart = restarts.append
    with raw_socket(svc.endpoint) as s:
        register_raw(s, c)
        wait_until(lambda: restarts == ["restarted"], 10, "the client to notice")
    wait_until(lambda: c.supervisor.registered, 10, "the client to register again")
    assert c.fetch("again", keys, CHUNK, None, timeout=30).hit_chunks == 1


# ---- a stopped service, and what it logs -------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_service_logs_its_start_and_attaches_at_info_and_leaves_nothing_when_stopped(tmp_path, sig):
    """Run as an operator runs it (no log flags): one INFO start line (version, pid, endpoint), one INFO
    line per attach and per detach, no WARNING -- also for a client that was waiting for the service and
    had sent its ``Register`` several times (each used to replace the last, one WARNING each). Stopped by
    ``sig``: exit 0, its socket files (endpoint, store proxy) and the client's region gone."""
    from sgl_remote_kv import __version__
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

    url = f"file://{tmp_path}/store"
    endpoint, proxy = f"ipc://{tmp_path}/dpu.sock", f"ipc://{tmp_path}/store.sock"
    cfg = DpuClientConfig(url, dest_slots=2, dest_slot_bytes=2 * CB, endpoint=endpoint, heartbeat_s=0.2)
    c = DpuClient(cfg, rank_fp(0), codecs()["lossless"])
    early = threading.Thread(target=c.start)  # resends its Register every second until answered
    early.start()
    log = tmp_path / "service.log"
    try:
        time.sleep(2.5)
        cmd = [sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", endpoint, "--store", url]
        with open(log, "wb") as out:
            svc = subprocess.Popen([*cmd, "--store-endpoint", proxy], stdout=out, stderr=out)
        early.join(60)
        assert c.supervisor.registered, log.read_text()
        region = c.dest.name
        assert c.fetch("x", [b"absent".ljust(32, b"\0")], CHUNK, None, timeout=30).failures[0] == "miss"
    finally:
        c.close()
    assert not Path("/dev/shm", region).exists()
    wait_until(lambda: b"detached (goodbye)" in log.read_bytes(), 5, "the goodbye")
    svc.send_signal(sig)
    assert svc.wait(timeout=30) == 0
    for sock in (endpoint, proxy):
        assert not Path(sock[len("ipc://") :]).exists(), sock
    lines = log.read_text().splitlines()
    assert not [ln for ln in lines if "WARNING" in ln or "ERROR" in ln], lines
    (start,) = [ln for ln in lines if "serving on" in ln]
    assert " INFO " in start and f"sgl-remote-kv {__version__}" in start, start
    assert f"pid {svc.pid} serving on {endpoint}" in start and f"store proxy on {proxy}" in start, start
    assert len([ln for ln in lines if " INFO " in ln and "registered" in ln]) == 1, lines
    assert len([ln for ln in lines if " INFO " in ln and "detached (goodbye)" in ln]) == 1, lines
