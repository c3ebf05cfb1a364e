"""The data plane as a long-lived service (``python -m sgl_remote_kv.dpu --endpoint ...``) shared by many
host clients (``DpuClient`` with ``endpoint``): registration, isolation, fairness across clients,
clients that die, a service that dies and comes back, and the authenticated tcp:// endpoint.

Every service here is a real process on the embedded file store; every client a real ``DpuClient``
(two clients stand in for two TP ranks: different fingerprints, different destination regions).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from dpu_helpers import CHUNK, codecs, make_pool, pool_tokens, put_chunks
from sgl_remote_kv.dpu import protocol as P
from sgl_remote_kv.dpu.buffers import DestRegion, chunk_bytes

from sgl_remote_kv.control import shm_names
from sgl_remote_kv.control.dpu_client import DpuClient, DpuClientConfig
from sgl_remote_kv.types import KVLayout, ModelFingerprint

LAYOUT32 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32")
CB = chunk_bytes(LAYOUT32, CHUNK)


def _fp(rank: int, size: int = 2) -> ModelFingerprint:
    return ModelFingerprint("TestArch", LAYOUT32, "w" * 16, rank, size)


def _chunks(n: int, seed: int):
    rng = np.random.default_rng(seed)
    shape = (LAYOUT32.num_layers, CHUNK, LAYOUT32.num_kv_heads, LAYOUT32.head_dim)
    return [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)) for _ in range(n)]


class Service:
    """One ``python -m sgl_remote_kv.dpu`` service process (killed and reaped on ``stop``)."""

    def __init__(self, endpoint: str, store_url: str, log: Path, *flags: str) -> None:
        self.endpoint, self.store_url, self.log, self.flags = endpoint, store_url, log, flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> Service:
        cmd = [sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", self.endpoint, "--store", self.store_url]
        cmd += ["--fetch-workers", "1", "--layer-group", "2", "--log-level", "INFO", *self.flags]
        started = self.log.read_bytes().count(b"serving on") if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + 30  # serving: clients registering now are answered at once
        while self.log.read_bytes().count(b"serving on") == started and self.proc.poll() is None:
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


@pytest.fixture
def env(tmp_path):
    """(store url, make_service, make_client): everything made is stopped/closed at the end."""
    url = f"file://{tmp_path}/store"
    services: list[Service] = []
    clients: list[DpuClient] = []

    def make_service(*flags: str, endpoint: str | None = None, store_url: str | None = None) -> Service:
        ep = endpoint or f"ipc://{tmp_path}/dpu.sock"
        svc = Service(ep, store_url or url, tmp_path / "service.log", *flags).start()
        services.append(svc)
        return svc

    def make_client(svc: Service, fp: ModelFingerprint, dest_chunks: int = 3, **kw) -> DpuClient:
        kw.setdefault("heartbeat_s", 0.2)
        kw.setdefault("heartbeat_timeout_s", 1.5)
        kw.setdefault("start_timeout_s", 30.0)
        cfg = DpuClientConfig(url, dest_slots=2, dest_slot_bytes=dest_chunks * CB, endpoint=svc.endpoint, **kw)
        c = DpuClient(cfg, fp, codecs()["lossless"])
        clients.append(c)
        c.start()
        return c

    yield url, make_service, make_client
    for c in clients:
        c.close()
    for s in services:
        s.kill()


def _slots_flags(slots: int = 2, chunks_per_slot: int = 2) -> list[str]:
    return ["--slots", str(slots), "--slot-bytes", str(chunks_per_slot * CB)]


def _assert_exact(target, chunks, n: int) -> None:
    for i in range(n):
        pk, pv = pool_tokens(target, LAYOUT32, i * CHUNK, (i + 1) * CHUNK)
        k, v = chunks[i]
        assert np.array_equal(pk, k) and np.array_equal(pv, v), f"chunk {i} is not token-identical"


def _stats(c: DpuClient, timeout: float = 5.0) -> dict:
    """The service's stats from ``c``'s next Pong."""
    seen = c.last_pong
    deadline = time.monotonic() + timeout
    while c.last_pong is seen and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(c.stats()["dataplane"])


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- sharing ---------------------------------------------------------------------------------------


def test_two_clients_share_one_service_token_identical(env):
    """Two ranks (different fingerprints and regions) on one service: float32 + lossless KV arrives
    token-identical in each rank's pool, concurrently; one service process serves both."""
    url, make_service, make_client = env
    svc = make_service(*_slots_flags())
    data = {r: _chunks(5, seed=10 + r) for r in (0, 1)}
    keys = {r: put_chunks(url, codecs()["lossless"], data[r], _fp(r), prefix=b"r%d" % r)[0] for r in (0, 1)}
    c0, c1 = make_client(svc, _fp(0)), make_client(svc, _fp(1))
    assert c0.pid == c1.pid == svc.proc.pid  # both attached to the one service, none spawned
    assert c0.dest.name != c1.dest.name
    targets = {r: make_pool(LAYOUT32, 512, 5 * CHUNK, seed=r) for r in (0, 1)}
    h0 = c0.submit("a", keys[0], CHUNK, targets[0])
    h1 = c1.submit("b", keys[1], CHUNK, targets[1])
    r0, r1 = h0.wait(timeout=30), h1.wait(timeout=30)
    assert (r0.hit_chunks, r1.hit_chunks) == (5, 5) and not r0.failures and not r1.failures
    _assert_exact(targets[0], data[0], 5)
    _assert_exact(targets[1], data[1], 5)
    st = _stats(c0)
    assert st["clients"] == 2 and st["registered"] == 2 and st["rejected"] == 0
    # a rank asking for the other rank's chunks gets foreign chunks (fingerprint), never its KV
    res = c0.fetch("x", keys[1][:1], CHUNK, make_pool(LAYOUT32, 512, CHUNK), timeout=30)
    assert res.hit_chunks == 0 and res.failures[0] == "foreign"


def test_a_big_job_does_not_starve_another_clients_small_one(env):
    """One staging slot of one chunk, a slow copy stage: client A's 8-chunk job is 8 data-plane rounds.
    Client B's 1-chunk job, submitted after A's, is admitted round-robin and finishes while A's is
    still running (FIFO admission would finish it after all 8)."""
    url, make_service, make_client = env
    svc = make_service(*_slots_flags(slots=1, chunks_per_slot=1), "--dma-delay-s", "0.1")
    a_data, b_data = _chunks(8, seed=1), _chunks(1, seed=2)
    a_keys, _ = put_chunks(url, codecs()["lossless"], a_data, _fp(0), prefix=b"a")
    b_keys, _ = put_chunks(url, codecs()["lossless"], b_data, _fp(1), prefix=b"b")
    a, b = make_client(svc, _fp(0), dest_chunks=8), make_client(svc, _fp(1))
    ta, tb = make_pool(LAYOUT32, 512, 8 * CHUNK, seed=1), make_pool(LAYOUT32, 512, CHUNK, seed=2)
    ha = a.submit("big", a_keys, CHUNK, ta)
    _until(lambda: _stats(a)["submitted"] >= 1, 10, "A's job at the service")
    hb = b.submit("small", b_keys, CHUNK, tb)
    rb = hb.wait(timeout=30)
    a_done_when_b_done = ha.wait(timeout=0) is not None
    ra = ha.wait(timeout=60)
    assert rb.hit_chunks == 1 and ra.hit_chunks == 8
    assert not a_done_when_b_done, "B's one-round job waited for all of A's rounds"
    _assert_exact(ta, a_data, 8)
    _assert_exact(tb, b_data, 1)


# ---- clients that leave or die ---------------------------------------------------------------------


def test_goodbye_releases_the_client_at_once(env):
    url, make_service, make_client = env
    svc = make_service(*_slots_flags())
    c0, c1 = make_client(svc, _fp(0)), make_client(svc, _fp(1))
    assert _stats(c1)["clients"] == 2
    region = c0.dest.name.lstrip("/")
    maps = Path(f"/proc/{svc.proc.pid}/maps")
    assert region in maps.read_text()
    c0.close()  # Goodbye; the client unlinks its own region
    st = _stats(c1)
    assert st["clients"] == 1 and st["clients_dropped"] == 1
    _until(lambda: region not in maps.read_text(), 3, "the service to unmap the region")


_DYING_CLIENT = """
import sys, time
sys.path.insert(0, {tests!r})
from dpu_helpers import CHUNK, codecs
from test_dpu_service import CB, _fp
from sgl_remote_kv.control.dpu_client import DpuClient, DpuClientConfig
cfg = DpuClientConfig({url!r}, dest_slot_bytes=8 * CB, endpoint={ep!r}, heartbeat_s=0.2)
c = DpuClient(cfg, _fp(0), codecs()["lossless"])
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
    svc = make_service(*_slots_flags(), "--client-timeout", "1", store_url=slow)
    keys, _ = put_chunks(url, codecs()["lossless"], _chunks(8, seed=3), _fp(0), prefix=b"d")
    other = make_client(svc, _fp(1))
    script = _DYING_CLIENT.format(
        tests=str(Path(__file__).parent), url=url, ep=svc.endpoint, keys=[k.hex() for k in keys]
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        region = host.stdout.readline().strip()
        assert region and Path("/dev/shm", region).exists()
        _until(lambda: _stats(other)["submitted"] >= 1, 10, "the doomed job at the service")
        assert _stats(other)["clients"] == 2
        host.kill()
        host.wait()
        _until(lambda: _stats(other)["clients_dropped"] >= 1, 5, "the dead client to be dropped")
        _until(lambda: other.last_pong.jobs_active == 0, 3, "its job to be cancelled")
        _until(lambda: not Path("/dev/shm", region).exists(), 3, "its region to be unlinked")
        maps = Path(f"/proc/{svc.proc.pid}/maps")
        _until(lambda: region not in maps.read_text(), 3, "the service to unmap its region")
        assert _stats(other)["clients"] == 1
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{region}")
    mine, _ = put_chunks(url, codecs()["lossless"], _chunks(1, seed=4), _fp(1), prefix=b"o")
    assert other.fetch("alive", mine, CHUNK, None, timeout=30).hit_chunks == 1


# ---- the service dies and comes back ---------------------------------------------------------------


def test_service_killed_then_restarted_misses_then_reconnects(env, tmp_path):
    url, make_service, make_client = env
    data = _chunks(6, seed=5)
    keys, _ = put_chunks(url, codecs()["lossless"], data, _fp(0))
    slow = f"faulty+file://{tmp_path}/store?latency_s=0.3"
    svc = make_service(*_slots_flags(), store_url=slow)
    c = make_client(svc, _fp(0))
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
    svc2 = make_service(*_slots_flags())  # same endpoint, a new process
    _until(lambda: c._registered and c.pid == svc2.proc.pid, 30, "the client to register again")
    target = make_pool(LAYOUT32, 512, 6 * CHUNK, seed=7)
    res = c.fetch("back", keys, CHUNK, target, timeout=30)
    assert res.hit_chunks == 6
    _assert_exact(target, data, 6)
    assert restarts and restarts[0] == "exited"  # the connection's DISCONNECTED event, not a timeout


def test_quick_service_restart_is_noticed_at_once(env):
    """A service replaced faster than the heartbeat timeout: the dropped connection (or, at the latest,
    the new service's first Pong, which does not know the client) makes the client register again."""
    url, make_service, make_client = env
    data = _chunks(2, seed=6)
    keys, _ = put_chunks(url, codecs()["lossless"], data, _fp(0))
    svc = make_service(*_slots_flags())
    c = make_client(svc, _fp(0), heartbeat_timeout_s=30.0)
    restarts: list[str] = []
    c.on_restart = restarts.append
    svc.kill()
    svc2 = make_service(*_slots_flags())
    _until(lambda: c.pid == svc2.proc.pid and c._registered, 30, "the client to register again")
    assert restarts in (["exited"], ["restarted"])
    target = make_pool(LAYOUT32, 512, 2 * CHUNK)
    assert c.fetch("again", keys, CHUNK, target, timeout=30).hit_chunks == 2
    _assert_exact(target, data, 2)


# ---- bad registrations -----------------------------------------------------------------------------


@contextlib.contextmanager
def _raw(endpoint: str):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        yield s
    finally:
        s.close()
        ctx.term()


def _ask(s, msg, want=P.Registered, timeout: float = 20.0):
    s.send(P.encode(msg))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.poll(200):
            got = P.decode(s.recv())
            if isinstance(got, want):
                return got
    raise AssertionError(f"no {want.__name__}")


def _register_msg(fp: ModelFingerprint, regions: list[str], digest: bytes | None = None) -> P.Register:
    lay = fp.layout
    wire = P.Fingerprint(
        fp.architecture, P.Layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype),
        fp.weights_id, fp.tp_rank, fp.tp_size, digest or fp.digest(),
    )  # fmt: skip
    codec = codecs()["lossless"]
    return P.Register(os.urandom(16), "raw", wire, codec.name, codec.params_bytes(), regions)


def test_bad_registrations_get_a_clear_refusal(env):
    url, make_service, make_client = env
    fp = _fp(0)
    svc = make_service(*_slots_flags(), "--allow-fingerprint", fp.digest().hex(), "--allow-fingerprint",
                       _fp(1).digest().hex())  # fmt: skip
    owner = make_client(svc, fp)
    mine = DestRegion.create(4 * CB, shm_names.region_name())
    name = mine.name.lstrip("/")
    try:
        with _raw(svc.endpoint) as s:
            # submitting before registering
            dest = P.ChunkDest(b"k" * 32, CHUNK, 0, 0, CB // (2 * LAYOUT32.num_layers))
            sub = P.SubmitFetch(1, "r", "lossless", b"", owner._wire_fp, name, [dest])
            failed = _ask(s, sub, P.ChunkFailed)
            assert failed.kind == "bad_request" and "not registered" in failed.detail
            cases = [
                (_register_msg(fp, [name], digest=b"x" * 32), "fingerprint digest does not match"),
                (_register_msg(fp, ["srkv-dpu-1-2-0badf00d"]), "does not exist"),
                (_register_msg(fp, ["psm_somebody_else"]), "not a destination region name"),
                (_register_msg(fp, [owner.dest.name.lstrip("/")]), "is registered by client"),
                (_register_msg(fp, [name, name]), "named twice"),
            ]
            for msg, reason in cases:
                got = _ask(s, msg)
                assert not got.ok and reason in got.detail, (reason, got.detail)
            assert _ask(s, _register_msg(fp, [name])).ok  # the same socket, a good registration
            # registered, but naming a region it did not register
            sub = P.SubmitFetch(2, "r", "lossless", b"", owner._wire_fp, owner.dest.name.lstrip("/"), [dest])
            failed = _ask(s, sub, P.ChunkFailed)
            assert failed.kind == "bad_request" and "unknown destination" in failed.detail
    finally:
        mine.close()
    other = ModelFingerprint("OtherArch", LAYOUT32, "o" * 16)  # not on the service's allow list
    with pytest.raises(RuntimeError, match="foreign fingerprint"):
        make_client(svc, other)
    assert _stats(owner)["register_refused"] == 6
    assert owner.fetch("still", [b"absent".ljust(32, b"\0")], CHUNK, None, timeout=30).failures[0] == "miss"


# ---- authentication --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _key(path: Path, fill: str) -> str:
    path.write_text(fill * 64)
    path.chmod(0o600)
    return str(path)


def test_tcp_endpoint_needs_auth_and_refuses_a_wrong_key(env, tmp_path):
    from sgl_remote_kv.dpu.__main__ import build_parser, config_from_args

    from sgl_remote_kv.config import RemoteKVConfig

    url, make_service, make_client = env
    ep = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(SystemExit, match="must be authenticated"):
        config_from_args(build_parser().parse_args(["--endpoint", ep, "--store", url]))
    with pytest.raises(ValueError, match="auth key"):
        DpuClientConfig(url, endpoint=ep)
    with pytest.raises(ValueError, match="needs --remote-kv-auth-key-file"):
        RemoteKVConfig(mode="dpu", dpu_endpoint=ep)
    out = subprocess.run([sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", ep, "--store", url],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "must be authenticated" in out.stderr

    good, bad = _key(tmp_path / "good.key", "a"), _key(tmp_path / "bad.key", "b")
    svc = make_service(*_slots_flags(), "--auth-key-file", good, endpoint=ep)
    data = _chunks(2, seed=8)
    keys, _ = put_chunks(url, codecs()["lossless"], data, _fp(0))
    c = make_client(svc, _fp(0), auth_key_file=good)
    target = make_pool(LAYOUT32, 512, 2 * CHUNK)
    assert c.fetch("auth", keys, CHUNK, target, timeout=30).hit_chunks == 2
    _assert_exact(target, data, 2)
    with pytest.raises(RuntimeError, match="did not answer"):
        make_client(svc, _fp(1), auth_key_file=bad, start_timeout_s=3.0)
    with _raw(ep) as s:  # a plain (unauthenticated) ZeroMQ peer gets nothing back
        s.send(P.encode(_register_msg(_fp(1), ["srkv-dpu-1-2-0badf00d"])))
        assert not s.poll(1500)
    # a peer that knows the service's public key but not the secret: its key is refused by ZAP
    from sgl_remote_kv.dpu.auth import curve_keys

    from sgl_remote_kv.security import load_auth_key

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = curve_keys(load_auth_key(good)).server_public
    s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    s.connect(ep)
    try:
        with contextlib.suppress(zmq.Again):  # no connection: nothing is queued either
            s.send(P.encode(P.Heartbeat(1, 0)), zmq.NOBLOCK)
        assert not s.poll(1500)
    finally:
        s.close()
        ctx.term()
    st = _stats(c)
    assert st["clients"] == 1 and st["auth_refused"] >= 1


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
    svc = make_service(*_slots_flags(), store_url=slow)
    keys = {r: put_chunks(url, codecs()["lossless"], _chunks(6, seed=20 + r), _fp(r), prefix=b"k%d" % r)[0]
            for r in (0, 1)}  # fmt: skip
    # heartbeats would notice only after 30 s: the dropped connection is what ends the fetches
    clients = {r: make_client(svc, _fp(r), heartbeat_timeout_s=30.0) for r in (0, 1)}
    handles = {r: clients[r].submit(f"r{r}", keys[r], CHUNK, make_pool(LAYOUT32, 512, 6 * CHUNK)) for r in (0, 1)}
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
    from sgl_remote_kv.sglang_glue.fetch_dpu import start_dpu_backend

    url, make_service, _ = env
    svc = make_service(*_slots_flags(), "--allow-fingerprint", _fp(0).digest().hex())
    parser = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(parser)
    ns = parser.parse_args(["--remote-kv", "dpu", "--remote-kv-store", url, "--remote-kv-chunk-size", str(CHUNK),
                            "--remote-kv-dpu-endpoint", svc.endpoint])  # fmt: skip
    ns.remote_kv_probe_store = False
    cfg = RemoteKVConfig.from_namespace(ns)
    assert cfg.dpu_endpoint == svc.endpoint and RemoteKVConfig.from_json(cfg.to_json()) == cfg
    for bad in ("redis://x:1", "ipc://"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--remote-kv-dpu-endpoint", bad])
    data = _chunks(2, seed=30)
    keys, _ = put_chunks(url, codecs()["lossless"], data, _fp(0))
    target = make_pool(LAYOUT32, 512, 2 * CHUNK)
    backend = start_dpu_backend(cfg, _fp(0), codecs()["lossless"], target.writer)
    assert backend is not None
    try:
        assert backend.client.pid == svc.proc.pid and backend.client._attached
        assert backend.client.fetch("glue", keys, CHUNK, target, timeout=30).hit_chunks == 2
        _assert_exact(target, data, 2)
    finally:
        backend.close()
    assert start_dpu_backend(cfg, _fp(1), codecs()["lossless"], target.writer) is None  # not allowed


def test_a_reconnect_is_answered_only_after_the_old_jobs_are_over(env):
    """A new connection registering an active client's session (what a client does after missing
    heartbeats while the service lives) replaces the registration; its ``Registered`` comes only once
    the old registration's job is over, so no destination slot is reused under a still-running copy."""
    from dpu_helpers import register_raw

    url, make_service, make_client = env
    svc = make_service(*_slots_flags(slots=1, chunks_per_slot=3), "--dma-delay-s", "0.3")
    keys, _ = put_chunks(url, codecs()["lossless"], _chunks(3, seed=40), _fp(0))
    # No heartbeats during the test: a Pong saying "not registered" would make the real client register
    # its session again, and the newest registration of a session is the one that waits (the raw
    # socket's would then never be answered: a race this test used to lose under load).
    c = make_client(svc, _fp(0), heartbeat_s=60.0, heartbeat_timeout_s=120.0)
    h = c.submit("old", keys, CHUNK, make_pool(LAYOUT32, 512, 3 * CHUNK))
    with _raw(svc.endpoint) as s:  # the service answers an unregistered connection's heartbeat too
        _until(lambda: json.loads(_ask(s, P.Heartbeat(0, 0), P.Pong).stats_json)["submitted"] >= 1, 10,
               "the job at the service")  # fmt: skip
        time.sleep(0.2)  # its first slab is being copied (0.3 s per slab, 6 slabs)
        register_raw(s, c)  # same session, new connection: returns once Registered(ok) arrived
        pong = _ask(s, P.Heartbeat(1, 0), P.Pong)
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
    keys, _ = put_chunks(url, codecs()["lossless"], _chunks(1, seed=60), _fp(0))
    svc = make_service(*_slots_flags())
    c = make_client(svc, _fp(0), heartbeat_timeout_s=30.0)
    restarts: list[str] = []
    c.on_restart = restarts.append
    with _raw(svc.endpoint) as s:
        register_raw(s, c)
        _until(lambda: restarts == ["restarted"], 10, "the client to notice")
    _until(lambda: c._registered, 10, "the client to register again")
    assert c.fetch("again", keys, CHUNK, None, timeout=30).hit_chunks == 1
