"""Errors say what happened, once: corrupt values, refused credentials and secrets on command lines, against
real redis-servers (one with ``--requirepass``) and real data-plane processes.

- A value corrupted in Redis (the user's ``SETRANGE key 200 XXXX``, and a well-framed value whose codec
  CRCs fail) is a miss, counted exactly once as ``store_errors{op="get",kind="corrupt"}`` wherever it is
  found (the store client's frame check, the in-process codec, the data plane's codec on whole and
  streamed values), and logged -- by the data plane in its own log and by the host -- naming the key, at
  most one line per interval per process with the number of values not logged.
- A wrong or missing Redis password is kind ``auth``: not retried, no breaker (no flapping), the store
  asked once (the server's own error stats say so), one ERROR line without the password, fast misses
  after that, one probe per ``auth_retry_s`` that heals once the server accepts.
- The password comes from a file (``password_file=``, ``--remote-kv-store-password-file``) or
  ``SRKV_STORE_PASSWORD``; neither it nor the auth key reaches a data plane's command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import pytest
import redis
from dpu_helpers import CHUNK, FP, LAYOUT, codecs, make_pool, put_chunks, random_chunks

from benchmarks.redis_server import RedisServer, free_port
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.store import corruption
from sgl_remote_kv.store.base import url_options
from sgl_remote_kv.store.client import ClientConfig, open_client
from sgl_remote_kv.store.credentials import read_password_file, with_password_file
from sgl_remote_kv.store.framing import frame, unframe
from sgl_remote_kv.store.redis_store import redis_key
from sgl_remote_kv.store.security import auth_store_url
from tests.fixtures.dpu_clients import dp_spec

pytest_plugins = ["fixtures.redis_servers", "fixtures.dpu_clients"]

PASSWORD = "s3cret-pw-7f3a"
WRONG = "wrong-pw-123"
AUTH_SECRET = "a1" * 24  # the auth key file's hex text


@pytest.fixture
def fresh_corruption_log(monkeypatch) -> corruption.CorruptionLog:
    """A new process-wide corruption log (the module's is rate-limited across tests)."""
    log = corruption.CorruptionLog()
    monkeypatch.setattr(corruption, "LOG", log)
    return log


@pytest.fixture
def secure_redis(tmp_path, monkeypatch):
    """A redis-server with ``--requirepass``; ``SRKV_STORE_PASSWORD`` cleared for the test."""
    monkeypatch.delenv("SRKV_STORE_PASSWORD", raising=False)
    rs = RedisServer(tmp_path / "redis", free_port(), extra_args=("--requirepass", PASSWORD)).start()
    try:
        yield rs
    finally:
        rs.stop(kill=True)


def _secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _refusals(rs: RedisServer) -> int:
    """Authentication refusals the server answered (``INFO errorstats``: WRONGPASS, NOAUTH)."""
    admin = redis.Redis(port=rs.port, password=PASSWORD)
    try:
        stats = admin.info("errorstats")
    finally:
        admin.close()
    return sum(stats.get(f"errorstat_{e}", {}).get("count", 0) for e in ("WRONGPASS", "NOAUTH"))


def _dataplane_log(capfd) -> str:
    """What the spawned data planes logged so far (they log to the host's stderr, prefixed ``dpu[pid]``)."""
    return "\n".join(ln for ln in capfd.readouterr().err.splitlines() if " dpu[" in ln)


def _corrupt_lines(records, key: bytes) -> list[str]:
    return [
        r.getMessage()
        for r in records
        if "corrupt value for chunk key" in r.getMessage() and corruption.short_key(key) in r.getMessage()
    ]


# ---- corrupt values ---------------------------------------------------------------------------------


def test_the_corruption_log_is_rate_limited_and_counts_what_it_did_not_log(caplog):
    now = [100.0]
    log = corruption.CorruptionLog(interval_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sgl_remote_kv.store.corruption"):
        assert log.note("aaaa...", "store client", "frame checksum mismatch")
        now[0] += 10
        assert not log.note("bbbb...", "store client", "x") and not log.note("cccc...", "store client", "y")
        now[0] += 21
        assert log.note("dddd...", "data plane fetch stage", "header CRC mismatch")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and log.total == 4
    assert "aaaa..." in lines[0] and "more" not in lines[0]
    assert "dddd..." in lines[1] and "2 more corrupt value(s)" in lines[1]


def _corrupt(rdb: redis.Redis, key: bytes, how: str) -> None:
    """``setrange``: the user's ``SETRANGE key 200 XXXX``; ``reframed``: a payload byte flipped and the value
    framed again, so only the codec's CRCs can tell."""
    if how == "setrange":
        rdb.setrange(redis_key(key), 200, "XXXX")
        return
    payload = bytearray(unframe(key, rdb.get(redis_key(key))))
    payload[len(payload) // 2] ^= 0x10
    rdb.set(redis_key(key), frame(key, bytes(payload)))


@pytest.mark.parametrize("how", ["setrange", "reframed"])
@pytest.mark.parametrize("piece_kib", [1, 0], ids=["streamed", "whole"])
def test_data_plane_counts_a_corrupt_value_once_and_both_logs_name_it(
    redis_server, make_client, fresh_corruption_log, caplog, capfd, how, piece_kib
):
    codec = codecs()["lossless"]
    keys, _ = put_chunks(
        redis_server.url, codec, random_chunks(3, seed=21), prefix=f"c-{how}-{piece_kib}".encode()
    )
    rdb = redis.Redis(port=redis_server.port)
    _corrupt(rdb, keys[1], how)
    c = make_client(redis_server.url, codec, process=dp_spec(stream_piece_kib=piece_kib))
    errors: list[tuple[str, str, int]] = []
    c.on_store_error = lambda op, kind, n: errors.append((op, kind, n))
    with caplog.at_level(logging.WARNING, logger="sgl_remote_kv.store.corruption"):
        res = c.fetch("r", keys, CHUNK, make_pool(LAYOUT, 512, 3 * CHUNK), timeout=30)
    assert res.hit_chunks == 1 and res.failures[1] == "corrupt"
    assert errors == [("get", "corrupt", 1)]  # store_errors_total{op="get",kind="corrupt"} +1, once
    assert len(_corrupt_lines(caplog.records, keys[1])) == 1  # the host's log
    dp_log = _dataplane_log(capfd)  # (logged before the chunk was reported; the client removes it)
    assert dp_log.count("corrupt value for chunk key " + corruption.short_key(keys[1])) == 1, dp_log
    rdb.close()


@pytest.mark.parametrize("how", ["setrange", "reframed"])
def test_in_process_fetch_counts_a_corrupt_value_once_and_logs_it(
    redis_server, fresh_corruption_log, caplog, how
):
    codec = codecs()["lossless"]
    keys, _ = put_chunks(redis_server.url, codec, random_chunks(3, seed=22), prefix=f"inproc-{how}".encode())
    rdb = redis.Redis(port=redis_server.port)
    _corrupt(rdb, keys[1], how)
    errors: list[tuple[str, str, int]] = []
    client = open_client(redis_server.url, on_error=lambda op, kind, n: errors.append((op, kind, n)))
    be = InProcessFetchBackend(client, codec, FP, CHUNK)
    try:
        with caplog.at_level(logging.WARNING, logger="sgl_remote_kv.store.corruption"):
            h = be.submit("r", keys, 0)
            assert h.wait(30)
        assert h.ok_chunks == 1
        assert errors == [("get", "corrupt", 1)]
        assert len(_corrupt_lines(caplog.records, keys[1])) == 1
        assert client.stats().errors == {"corrupt": 1}
    finally:
        be.close()
        client.close()
        rdb.close()


def test_a_value_failing_its_mac_is_counted_corrupt_and_deleted(redis_server, tmp_path, fresh_corruption_log):
    key_file = _secret_file(tmp_path / "auth.key", AUTH_SECRET)
    url = auth_store_url(redis_server.url, str(key_file))
    keys, _ = put_chunks(url, codecs()["lossless"], random_chunks(2, seed=23), prefix=b"mac")
    rdb = redis.Redis(port=redis_server.port)
    rdb.set(redis_key(keys[1]), rdb.get(redis_key(keys[0])))  # a replay: chunk 0's sealed value under key 1
    errors: list[tuple[str, str, int]] = []
    client = open_client(url, on_error=lambda op, kind, n: errors.append((op, kind, n)))
    try:
        got = client.get_many(keys)
        assert got[0] is not None and got[1] is None
        assert errors == [("get", "corrupt", 1)] and fresh_corruption_log.total == 1
        assert rdb.exists(redis_key(keys[1])) == 0  # deleted: the recompute's write-back replaces it
    finally:
        client.close()
        rdb.close()


# ---- refused credentials ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["wrong", "missing"])
def test_refused_credentials_are_auth_not_retried_not_a_breaker_and_logged_once(
    secure_redis, tmp_path, caplog, how
):
    url = f"redis://127.0.0.1:{secure_redis.port}/0"
    if how == "wrong":
        url += f"?password_file={_secret_file(tmp_path / 'pw', WRONG)}"
    errors: list[tuple[str, str, int]] = []
    breaker: list[tuple[str, str]] = []
    cfg = ClientConfig(retries=2, breaker_failures=1, auth_retry_s=2.0)
    client = open_client(url, cfg, on_error=lambda op, kind, n: errors.append((op, kind, n)))
    client.on_breaker = lambda circuit, state: breaker.append((circuit, state))
    key = b"\x07" * 32
    before = _refusals(secure_redis)  # (the server's start-up check asked without a password)
    try:
        with caplog.at_level(logging.DEBUG, logger="sgl_remote_kv.store"):
            for _ in range(3):
                assert client.lookup_prefix([key]).error == "auth"
                assert client.get_many([key]) == [None]
                assert client.put_many([(key, b"v" * 100)]) == 0
                assert client.stream_get(key, 1 << 20, 1024) is None
        assert errors == [(op, "auth", 1) for _ in range(3) for op in ("lookup", "get", "put")]
        assert breaker == [] and client.circuits() == {"read": "closed", "write": "closed"}
        assert _refusals(secure_redis) - before == 1  # asked once: no retry, fast misses after
        refused = [r for r in caplog.records if "refused authentication" in r.getMessage()]
        assert len(refused) == 1 and refused[0].levelno == logging.ERROR
        assert WRONG not in caplog.text and PASSWORD not in caplog.text
        # fixed on the server's side: the next probe (after auth_retry_s) heals it without a restart
        admin = redis.Redis(port=secure_redis.port, password=PASSWORD)
        admin.config_set("requirepass", WRONG if how == "wrong" else "")
        admin.close()
        assert client.put_many([(key, b"v" * 100)]) == 0  # still inside the window: not asked
        time.sleep(2.1)
        with caplog.at_level(logging.INFO, logger="sgl_remote_kv.store"):
            assert client.put_many([(key, b"v" * 100)]) == 1
        assert client.get_many([key]) == [b"v" * 100]
        assert any("accepts our credentials again" in r.getMessage() for r in caplog.records)
    finally:
        client.close()


def test_refused_credentials_at_start_are_one_error_line_not_two(secure_redis, caplog):
    """A server's start with a wrong password: the launcher's start-up probe and the scheduler's store
    client (which reads the store generation at start) both meet the refusal. One line is logged for it:
    the store client's, a ``logging`` record at ERROR whose text says ERROR (SGLang's log format prints no
    level: ``[time TP0] message``, so ``grep ERROR`` must find it in the text); the probe neither calls
    the store unreachable nor repeats the error."""
    from sgl_remote_kv import preflight
    from sgl_remote_kv.store import generation

    url = f"redis://:{WRONG}@127.0.0.1:{secure_redis.port}/0"
    with caplog.at_level(logging.DEBUG, logger="sgl_remote_kv"):
        preflight.probe_store_async(url).join(10)  # the launcher
        client = open_client(url)  # the scheduler: build_runtime reads the generation, then serves
        try:
            assert generation.read(client, FP) is None
            for _ in range(3):
                assert client.lookup_prefix([b"\x09" * 32]).error == "auth"
        finally:
            client.close()
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    (line,) = loud
    assert line.levelno == logging.ERROR and line.name == "sgl_remote_kv.store.auth_gate", line
    assert "refused authentication" in line.getMessage()
    sglang_format = logging.Formatter("[%(asctime)s TP0] %(message)s")  # SGLang's configure_logger
    assert "ERROR" in sglang_format.format(line)
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert WRONG not in caplog.text


def test_the_password_comes_from_a_file_or_the_environment_and_never_twice(
    secure_redis, tmp_path, monkeypatch
):
    base = f"redis://127.0.0.1:{secure_redis.port}/0"
    pw_file = _secret_file(tmp_path / "pw", PASSWORD)
    key = b"\x08" * 32
    for url in (
        with_password_file(base, str(pw_file)),
        f"redis://:{PASSWORD}@127.0.0.1:{secure_redis.port}/0",
    ):
        client = open_client(url)
        assert client.put_many([(key, b"x")]) == 1 and client.get_many([key]) == [b"x"]
        client.close()
    monkeypatch.setenv("SRKV_STORE_PASSWORD", PASSWORD)
    client = open_client(base)
    assert client.get_many([key]) == [b"x"] and not client.stats().errors
    client.close()
    with pytest.raises(ValueError, match="give one of them") as e:
        open_client(f"redis://:{PASSWORD}@127.0.0.1:{secure_redis.port}/0?password_file={pw_file}")
    assert PASSWORD not in str(e.value)
    with pytest.raises(ValueError, match="Redis store URL"):
        with_password_file("file:///tmp/store", str(pw_file))
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "empty", tmp_path / "absent"):
        with pytest.raises(ValueError, match="store password file"):
            read_password_file(bad)


def test_the_password_file_flag_and_the_warning_for_a_password_in_the_url(tmp_path, caplog, capsys):
    pw_file = _secret_file(tmp_path / "pw", PASSWORD)
    parser = argparse.ArgumentParser(prog="srv")
    RemoteKVConfig.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--remote-kv",
            "dpu",
            "--remote-kv-store",
            "redis://h:1/0",
            "--remote-kv-store-password-file",
            str(pw_file),
        ]
    )
    ns.remote_kv_probe_store = False
    with caplog.at_level(logging.WARNING, logger="sgl_remote_kv.config"):
        cfg = RemoteKVConfig.from_namespace(ns)
    assert not caplog.records  # nothing on the command line to warn about
    assert RemoteKVConfig.from_json(cfg.to_json()) == cfg and PASSWORD not in cfg.to_json()
    resolved = cfg.resolved_store_url()
    assert resolved.startswith("redis://h:1/0?") and url_options(resolved) == {"password_file": str(pw_file)}
    ns = parser.parse_args(["--remote-kv", "dpu", "--remote-kv-store", f"redis://:{PASSWORD}@h:1/0"])
    ns.remote_kv_probe_store = False
    with caplog.at_level(logging.WARNING, logger="sgl_remote_kv.config"):
        RemoteKVConfig.from_namespace(ns)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "ps" in warned[0] and PASSWORD not in warned[0]
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--remote-kv-store-password-file", str(tmp_path / "absent")])
    assert e.value.code == 2 and "--remote-kv-store-password-file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Redis store URL"):
        RemoteKVConfig(mode="dpu", store_url="file:///s", store_password_file=str(pw_file))


def test_data_plane_reports_auth_once_and_no_secret_reaches_its_command_line(
    secure_redis, make_client, tmp_path, capfd
):
    codec = codecs()["lossless"]
    base = f"redis://127.0.0.1:{secure_redis.port}/0"
    key_file = _secret_file(tmp_path / "auth.key", AUTH_SECRET)
    good = auth_store_url(
        with_password_file(base, str(_secret_file(tmp_path / "pw", PASSWORD))), str(key_file)
    )
    keys, _ = put_chunks(good, codec, random_chunks(3, seed=24), prefix=b"dp-auth")
    c = make_client(good, codec)
    assert c.fetch("ok", keys, CHUNK, make_pool(LAYOUT, 512, 3 * CHUNK), timeout=30).hit_chunks == 3
    cmdline = Path(f"/proc/{c.pid}/cmdline").read_bytes()
    secret = bytes.fromhex(AUTH_SECRET)
    for s in (PASSWORD.encode(), AUTH_SECRET.encode(), secret):
        assert s not in cmdline
    assert b"sgl_remote_kv.dpu" in cmdline and b"--store\x00-\x00" in cmdline  # the URL goes on stdin
    assert PASSWORD.encode() not in Path(f"/proc/{c.pid}/environ").read_bytes()  # (a file, not env)

    wrong = auth_store_url(
        with_password_file(base, str(_secret_file(tmp_path / "wrong", WRONG))), str(key_file)
    )
    bad = make_client(wrong, codec)
    errors: list[tuple[str, str, int]] = []
    bad.on_store_error = lambda op, kind, n: errors.append((op, kind, n))
    before = _refusals(secure_redis)
    for rid in ("a", "b"):
        res = bad.fetch(rid, keys, CHUNK, make_pool(LAYOUT, 512, 3 * CHUNK), timeout=30)
        assert res.hit_chunks == 0 and res.failures[0] == "store_auth"
    assert errors and set(errors) == {("get", "auth", 1)}
    assert _refusals(secure_redis) - before == 1  # the data plane's client asked once
    assert bad.stats()["restarts"] == 0
    dp_log = _dataplane_log(capfd)
    assert dp_log.count("refused authentication") == 1 and WRONG not in dp_log, dp_log
    assert os.environ.get("SRKV_STORE_PASSWORD") is None
