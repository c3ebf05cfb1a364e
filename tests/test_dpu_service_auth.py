"""The data-plane service's front door: registrations it refuses (with the reason the client is told)
and the tcp:// endpoint, which must be authenticated (CURVE keys derived from a shared secret; a wrong
key or a plain ZeroMQ peer gets nothing back). Real service processes, as in ``test_dpu_service.py``.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from dpu_helpers import CHUNK, codecs, make_pool, put_chunks
from dpu_service_helpers import (
    CB,
    LAYOUT32,
    ask,
    assert_exact,
    random_kv,
    rank_fp,
    raw_socket,
    register_msg,
    service_env,
    service_stats,
    slots_flags,
)

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.fetch.dpu_client.client import DpuClientConfig
from sgl_remote_kv.fetch.dpu_client.host_region import HostRegion
from sgl_remote_kv.types import ModelFingerprint


@pytest.fixture
def env(tmp_path):
    yield from service_env(tmp_path)


def test_bad_registrations_get_a_clear_refusal(env):
    url, make_service, make_client = env
    fp = rank_fp(0)
    svc = make_service(
        *slots_flags(),
        "--allow-fingerprint",
        fp.digest().hex(),
        "--allow-fingerprint",
        rank_fp(1).digest().hex(),
    )
    owner = make_client(svc, fp)
    mine = HostRegion(4 * CB, shm_names.region_name(), named=True)
    name = mine.name
    try:
        with raw_socket(svc.endpoint) as s:
            # submitting before registering
            dest = P.ChunkDest(b"k" * 32, CHUNK, 0, 0, CB // (2 * LAYOUT32.num_layers))
            sub = P.SubmitFetch(1, "r", "lossless", b"", owner._wire_fp, name, [dest])
            failed = ask(s, sub, P.ChunkFailed)
            assert failed.kind == "bad_request" and "not registered" in failed.detail
            cases = [
                (register_msg(fp, [name], digest=b"x" * 32), "fingerprint digest does not match"),
                (register_msg(fp, ["srkv-dpu-1-2-0badf00d"]), "does not exist"),
                (register_msg(fp, ["psm_somebody_else"]), "not a destination region name"),
                (register_msg(fp, [owner.dest.name.lstrip("/")]), "is registered by client"),
                (register_msg(fp, [name, name]), "named twice"),
            ]
            for msg, reason in cases:
                got = ask(s, msg)
                assert not got.ok and reason in got.detail, (reason, got.detail)
            assert ask(s, register_msg(fp, [name])).ok  # the same socket, a good registration
            # registered, but naming a region it did not register
            sub = P.SubmitFetch(2, "r", "lossless", b"", owner._wire_fp, owner.dest.name.lstrip("/"), [dest])
            failed = ask(s, sub, P.ChunkFailed)
            assert failed.kind == "bad_request" and "unknown destination" in failed.detail
    finally:
        mine.close()
    other = ModelFingerprint("OtherArch", LAYOUT32, "o" * 16)  # not on the service's allow list
    with pytest.raises(RuntimeError, match="foreign fingerprint"):
        make_client(svc, other)
    assert service_stats(owner)["register_refused"] == 6
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
    out = subprocess.run(
        [sys.executable, "-m", "sgl_remote_kv.dpu", "--endpoint", ep, "--store", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "must be authenticated" in out.stderr

    good, bad = _key(tmp_path / "good.key", "a"), _key(tmp_path / "bad.key", "b")
    svc = make_service(*slots_flags(), "--auth-key-file", good, endpoint=ep)
    data = random_kv(2, seed=8)
    keys, _ = put_chunks(url, codecs()["lossless"], data, rank_fp(0))
    c = make_client(svc, rank_fp(0), auth_key_file=good)
    target = make_pool(LAYOUT32, 512, 2 * CHUNK)
    assert c.fetch("auth", keys, CHUNK, target, timeout=30).hit_chunks == 2
    assert_exact(target, data, 2)
    with pytest.raises(RuntimeError, match="did not answer"):
        make_client(svc, rank_fp(1), auth_key_file=bad, start_timeout_s=3.0)
    with raw_socket(ep) as s:  # a plain (unauthenticated) ZeroMQ peer gets nothing back
        s.send(P.encode(register_msg(rank_fp(1), ["srkv-dpu-1-2-0badf00d"])))
        assert not s.poll(1500)
    # a peer that knows the service's public key but not the secret: its key is refused by ZAP
    from sgl_remote_kv.contract.auth import curve_keys
    from sgl_remote_kv.store.security import load_auth_key

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
    st = service_stats(c)
    assert st["clients"] == 1 and st["auth_refused"] >= 1
