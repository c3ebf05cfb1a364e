"""A store fit for production, against real redis-servers started here: ACL users and ``requirepass``,
TLS (``rediss://``; certificates made with ``openssl`` in the test), and eviction at the memory limit.

- An ACL user (``redis://user:password@``) and the default user's password both work; a wrong password
  is a store error (a miss for the tier), and no error message carries the password.
- ``rediss://`` with the CA that signed the server's certificate works, with and without a client
  certificate; a CA that did not sign it is ``StoreUnavailable``, TLS against the plaintext port a
  timeout (both store errors: misses for the tier).
- A store at ``maxmemory`` with ``allkeys-lru`` keeps taking writes (no error) and every value it returns
  is the whole value that was written (evicted ones are misses, never a truncated value).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.redis_server import RedisServer, free_port
from sgl_remote_kv.store.base import StoreError, StoreTimeout, StoreUnavailable, open_store
from sgl_remote_kv.store.client import ClientConfig, open_client

PASSWORD, DEFAULT_PASSWORD = "hunter2-acl", "s3cret-default"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 signed by it, a client certificate, and a stranger CA."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificates (Debian: openssl)")
    d.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{d}/{ca}.key",
            "-out",
            f"{d}/{ca}.crt",
            "-days",
            "2",
            "-subj",
            f"/CN=srkv-test-{ca}",
        )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{d}/{name}.key",
            "-out",
            f"{d}/{name}.csr",
            "-subj",
            f"/CN=srkv-test-{name}",
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{d}/{name}.csr",
            "-CA",
            f"{d}/ca.crt",
            "-CAkey",
            f"{d}/ca.key",
            "-CAcreateserial",
            "-out",
            f"{d}/{name}.crt",
            "-days",
            "2",
            "-extfile",
            f"{d}/san.ext",
        )
    return {
        n: str(d / n)
        for n in ("ca.crt", "other-ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    }


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis-secure")
    certs = _certs(d / "certs")
    tls_port = free_port()
    acl = d / "users.acl"  # the default user's password (what requirepass sets) and a restricted ACL user
    acl.write_text(
        f"user default on >{DEFAULT_PASSWORD} ~* &* +@all\nuser srkv on >{PASSWORD} ~srkv:* &* +@all\n"
    )
    extra = (
        "--aclfile",
        str(acl),
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        certs["server.crt"],
        "--tls-key-file",
        certs["server.key"],
        "--tls-ca-cert-file",
        certs["ca.crt"],
        "--tls-auth-clients",
        "optional",
    )
    rs = RedisServer(d / "data", free_port(), extra_args=extra).start()
    try:
        yield rs, tls_port, certs
    finally:
        rs.stop(kill=True)


def _round_trip(url: str, n: int = 3) -> None:
    client = open_client(url, ClientConfig(timeout_s=5.0, breaker_failures=100))
    try:
        items = [(hashlib.sha256(f"{url}{i}".encode()).digest(), bytes([i]) * (1000 + i)) for i in range(n)]
        assert client.put_many(items) == n
        assert client.get_many([k for k, _ in items]) == [v for _, v in items]
    finally:
        client.close()


def _store_error(url: str) -> StoreError:
    store = open_store(url)
    try:
        with pytest.raises(StoreError) as e:
            store.get_many([b"\x01" * 32])
        return e.value
    finally:
        store.close()


def test_acl_user_and_default_password(secure_redis):
    rs, _, _ = secure_redis
    _round_trip(f"redis://srkv:{PASSWORD}@127.0.0.1:{rs.port}/0")
    _round_trip(f"redis://:{DEFAULT_PASSWORD}@127.0.0.1:{rs.port}/0")


def test_wrong_password_is_a_store_error_without_the_password(secure_redis):
    rs, _, _ = secure_redis
    for url in (f"redis://srkv:wrong-pw-123@127.0.0.1:{rs.port}/0", f"redis://127.0.0.1:{rs.port}/0"):
        err = _store_error(url)
        assert "wrong-pw-123" not in str(err)
    client = open_client(f"redis://srkv:wrong-pw-123@127.0.0.1:{rs.port}/0", ClientConfig(timeout_s=2.0))
    try:
        assert client.get_many([b"\x02" * 32]) == [None]  # the tier sees a miss
        assert sum(client.stats().errors.values()) > 0
    finally:
        client.close()


def test_tls_with_the_signing_ca_with_and_without_a_client_certificate(secure_redis):
    rs, tls_port, c = secure_redis
    base = f"rediss://srkv:{PASSWORD}@127.0.0.1:{tls_port}/0?ca={c['ca.crt']}"
    _round_trip(base)
    _round_trip(f"{base}&cert={c['client.crt']}&key={c['client.key']}")


def test_tls_refuses_a_server_its_ca_did_not_sign_and_the_plaintext_port(secure_redis):
    rs, tls_port, c = secure_redis
    err = _store_error(f"rediss://srkv:{PASSWORD}@127.0.0.1:{tls_port}/0?ca={c['other-ca.crt']}")
    assert isinstance(err, StoreUnavailable) and PASSWORD not in str(err)
    err = _store_error(f"rediss://srkv:{PASSWORD}@127.0.0.1:{rs.port}/0?ca={c['ca.crt']}&timeout=1")
    # the plaintext server waits for a command, the client for a handshake: a timeout
    assert isinstance(err, (StoreUnavailable, StoreTimeout)) and PASSWORD not in str(err)


@pytest.mark.parametrize(
    ("query", "match"),
    [("ca=/nonexistent/ca.crt", "ca="), ("cert=/x.crt", "both cert= and key="), ("verify=maybe", "verify")],
)
def test_bad_tls_options_are_clear_errors(query, match):
    with pytest.raises(ValueError, match=match) as e:
        open_store(f"rediss://u:{PASSWORD}@127.0.0.1:6379/0?{query}")
    assert PASSWORD not in str(e.value)
    with pytest.raises(ValueError, match="unknown options"):
        open_store(f"redis://127.0.0.1:6379/0?{query}")  # TLS options only on rediss://


def test_full_store_evicts_and_never_returns_a_truncated_value(tmp_path):
    rs = RedisServer(
        tmp_path / "lru", free_port(), extra_args=("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    ).start()
    client = open_client(f"redis://127.0.0.1:{rs.port}/0", ClientConfig(timeout_s=5.0))
    try:
        items = [
            (hashlib.sha256(b"lru%d" % i).digest(), hashlib.sha256(b"v%d" % i).digest() * 2048)
            for i in range(200)
        ]
        stored = sum(client.put_many(items[i : i + 10]) for i in range(0, len(items), 10))
        assert stored == len(items) and not client.stats().errors  # full means evict, never an error
        got = client.get_many([k for k, _ in items])
        present = [i for i, v in enumerate(got) if v is not None]
        assert all(got[i] == items[i][1] for i in present)  # whole values only
        assert 0 < len(present) < len(items)  # some evicted, the newest kept
        assert len(items) - 1 in present
    finally:
        client.close()
        rs.stop(kill=True)
