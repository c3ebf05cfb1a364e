"""Standalone Redis backend (redis-py + hiredis), pipelined.

URL: ``redis://[[user]:password@]host:port/db?timeout=2&prefix=srkv:&ttl=0&batch=32``; ``rediss://`` is the
same over TLS, with ``ca=PATH`` (the CA bundle that signed the server's certificate; default: the system's),
``cert=PATH&key=PATH`` (a client certificate, for servers that require one) and ``verify=none`` (skip
server verification: never in production). ``user`` is a Redis 6 ACL user (``AUTH user password``); without
it the password is the ``default`` user's (``requirepass``). The password is best kept off the URL (which is
on a command line): ``password_file=PATH`` or ``SRKV_STORE_PASSWORD`` (``credentials.py``). It never appears
in logs or errors (``base.redact_url``). Refused credentials are ``StoreAuthError`` (kind ``auth``).

Keys are printable: the prefix then the digest in hex, ``srkv:<64 hex digits>`` (``redis_key``), so
``redis-cli --scan --pattern 'srkv:*'`` pipelines work (raw digests contained newlines). Capacity and
eviction are the server's business: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
(or set ``ttl`` seconds here).

Publish after full write: each value is written by a single ``SET`` (pipelined, non-transactional).
Redis executes commands one at a time, and a command is executed only after its whole request,
including the bulk value, has been read from the socket; a request cut off by a broken connection is
discarded. So a key holds either nothing, its previous value, or the complete new value, never a
prefix of it. If a pipeline fails halfway, the SETs that ran are complete values (valid KV) and the
others never ran; nothing partial remains, so no cleanup is needed. The same holds per shard in
Redis Cluster, and replicas receive whole commands.

Thread-safety: redis-py clients use a connection pool; one ``RedisStore`` may be shared by threads.
Buffers: values passed to ``put_many`` are read (copied to the socket) during the call only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import credentials, resp_reader
from .base import (
    KEY_BYTES,
    Counters,
    StoreAuthError,
    StoreError,
    StoreStats,
    StoreTimeout,
    StoreUnavailable,
    check_keys,
    parse_host_ports,
    redact_url,
    url_options,
)

DEFAULT_PREFIX = b"srkv:"
COMMON_OPTIONS = {"timeout", "prefix", "ttl", "batch", credentials.PASSWORD_FILE_OPTION}
TLS_OPTIONS = {"ca", "cert", "key", "verify"}


def redis_key(key: bytes, prefix: bytes = DEFAULT_PREFIX) -> bytes:
    """The Redis key of a chunk key: ``prefix`` + hex digest (printable, one line, scan-friendly)."""
    return prefix + key.hex().encode()


_READ_SIZE = 1 << 20
# Refused credentials: wrong/missing password, unknown ACL user, a user without permission for our keys.
_AUTH_ERRORS = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError,
    redis.exceptions.NoPermissionError,
)
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM")


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Map redis-py exceptions to ``StoreError`` kinds (timeout / unavailable / auth / error)."""
    try:
        yield
    except redis.exceptions.TimeoutError as e:
        raise StoreTimeout(str(e)) from e
    except _AUTH_ERRORS as e:  # (before ConnectionError: redis-py's AuthenticationError is one)
        raise StoreAuthError(f"{type(e).__name__}: {e}") from e
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.ClusterError,
        redis.exceptions.RedisClusterException,  # not a RedisError: "cannot be connected", ...
        OSError,
    ) as e:
        raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
    except redis.exceptions.ResponseError as e:
        if "CLUSTERDOWN" in str(e) or "LOADING" in str(e) or "TRYAGAIN" in str(e):
            raise StoreUnavailable(str(e)) from e
        if str(e).startswith(_AUTH_REPLIES):  # an error reply read by ``resp_reader``
            raise StoreAuthError(str(e)) from e
        raise StoreError(f"{type(e).__name__}: {e}") from e
    except redis.exceptions.RedisError as e:
        raise StoreError(f"{type(e).__name__}: {e}") from e


class RedisKV:
    """Pipelined get/put/exists/delete over any redis-py client (standalone or cluster)."""

    def __init__(self, client: Any, backend: str, prefix: bytes, ttl_s: int, batch: int) -> None:
        self._r = client
        self._prefix = prefix
        self._ttl = ttl_s or None
        self._batch = max(1, batch)
        self._counters = Counters(backend)

    def _k(self, key: bytes) -> bytes:
        return redis_key(key, self._prefix)

    def _batches(self, seq: Sequence[Any]) -> Iterator[Sequence[Any]]:
        for i in range(0, len(seq), self._batch):
            yield seq[i : i + self._batch]

    def _run(self, op: str, chunk: Sequence[Any]) -> list[Any]:
        pipe = self._r.pipeline(transaction=False)
        for item in chunk:
            if op == "get":
                pipe.get(self._k(item))
            elif op == "exists":
                pipe.exists(self._k(item))
            elif op == "set":
                pipe.set(self._k(item[0]), item[1], ex=self._ttl)
            else:
                pipe.delete(self._k(item))
        with translate_errors():
            return pipe.execute()

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        n = 0
        with self._counters.timed("count_prefix"):
            for chunk in self._batches(keys):
                for found in self._run("exists", chunk):
                    if not found:
                        self._counters.add(hits=n, misses=1)
                        return n
                    n += 1
        self._counters.add(hits=n)
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        out: list[bytes | None] = []
        with self._counters.timed("get_many"):
            for chunk in self._batches(keys):
                out.extend(self._get_batch(chunk))
        hits = sum(v is not None for v in out)
        self._counters.add(
            hits=hits, misses=len(out) - hits, bytes_read=sum(len(v) for v in out if v is not None)
        )
        return out

    def _get_batch(self, chunk: Sequence[bytes]) -> list[bytes | None]:
        return self._run("get", chunk)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """One ``SET`` per key, pipelined in batches; see the module docstring for atomicity."""
        check_keys([k for k, _ in items])
        with self._counters.timed("put_many"):
            for chunk in self._batches(items):
                self._run("set", chunk)
        self._counters.add(bytes_written=sum(len(v) for _, v in items), keys_written=len(items))

    def delete_many(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        n = 0
        for chunk in self._batches(keys):
            n += sum(int(x) for x in self._run("delete", chunk))
        self._counters.add(keys_deleted=n)

    def scan(self, batch: int = 512) -> Iterator[list[bytes]]:
        """Every chunk key under this store's prefix, in batches (``SCAN``, on every primary of a cluster;
        admin walks, not the serving path). Keys written meanwhile may or may not appear."""
        out: list[bytes] = []
        n = len(self._prefix)
        with translate_errors():
            for rkey in self._r.scan_iter(match=self._prefix + b"*", count=batch):
                hexkey = rkey[n:]
                if len(hexkey) != 2 * KEY_BYTES:
                    continue
                try:
                    out.append(bytes.fromhex(hexkey.decode("ascii")))
                except (ValueError, UnicodeDecodeError):
                    continue  # not one of ours
                if len(out) >= batch:
                    yield out
                    out = []
        if out:
            yield out

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._r.close()


class RedisStore(RedisKV):
    """Standalone Redis ``KVStore``."""

    def __init__(
        self,
        host: str,
        port: int,
        db: int = 0,
        timeout_s: float = 2.0,
        prefix: bytes = DEFAULT_PREFIX,
        ttl_s: int = 0,
        batch: int = 32,
        auth: dict[str, Any] | None = None,
    ) -> None:
        client = redis.Redis(host=host, port=port, db=db, **(auth or {}), **connection_kwargs(timeout_s))
        super().__init__(client, "redis", prefix, ttl_s, batch)
        self.address = (host, port)

    def _get_batch(self, chunk: Sequence[bytes]) -> list[bytes | None]:
        """The ``GET``s of a batch, pipelined on one connection (values as bytes-like objects)."""
        rp = _Replies(self._r.connection_pool)
        clean = False
        try:
            with translate_errors():
                rp.send([("GET", self._k(k)) for k in chunk])
                out = [rp.bulk() for _ in chunk]
            clean = True
            return out
        finally:
            rp.close(clean)

    def stream_get(self, key: bytes, piece_bytes: int) -> Iterator[bytes]:
        """The value of ``key`` in pieces of at most ``piece_bytes``, in order; nothing if absent.

        One pooled connection: ``STRLEN`` and the first ``GETRANGE``, then every other ``GETRANGE`` in one
        write (pipelined, so the link stays busy while the pieces are consumed). Each piece is its own
        command: a value rewritten or evicted between them comes out changed or short, which the store
        framing's length and CRC catch (``framing.FrameReader``). A generator closed early, or a failed
        read, disconnects the connection (replies may still be in flight) before it goes back to the pool.
        Raises ``StoreError`` kinds like every call here; runs on the caller's thread."""
        check_keys([key])
        if piece_bytes < 1:
            raise ValueError("piece_bytes must be >= 1")
        rk = self._k(key)
        rp = _Replies(self._r.connection_pool)
        clean = False
        try:
            with translate_errors():
                rp.send([("STRLEN", rk), ("GETRANGE", rk, 0, piece_bytes - 1)])
                total = rp.integer()
                first = rp.bulk()
                rest = [
                    ("GETRANGE", rk, o, min(o + piece_bytes, total) - 1)
                    for o in range(piece_bytes, total, piece_bytes)
                ]
                if rest:
                    rp.send(rest)
            self._counters.add(hits=int(total > 0), misses=int(total == 0), bytes_read=total)
            if first:
                yield first
            for _ in rest:
                with translate_errors():
                    piece = rp.bulk()
                if piece:
                    yield piece
            clean = True
        finally:
            rp.close(clean)


class _Replies:
    """Commands sent on one pooled connection of a standalone server and their replies read back in order:
    by ``resp_reader`` on a plain TCP connection (a wake-up per value or 128 KiB piece, not per TCP
    segment), else by redis-py's parser. ``close(clean)`` gives the connection back, disconnected first
    unless every reply was read (``clean``) and the reader's socket setting was restored. Raises redis-py's
    exceptions (callers wrap ``translate_errors``)."""

    def __init__(self, pool) -> None:
        self._pool = pool
        with translate_errors():
            self.conn = pool.get_connection()
        self._raw = resp_reader.RespReader(self.conn) if resp_reader.usable(self.conn) else None

    def send(self, commands: list[tuple]) -> None:
        self.conn.send_packed_command(self.conn.pack_commands(commands))

    def integer(self) -> int:
        return self._raw.integer() if self._raw else int(self.conn.read_response())

    def bulk(self):
        return self._raw.bulk() if self._raw else self.conn.read_response()

    def close(self, clean: bool) -> None:
        if self._raw is not None and not self._raw.close():
            clean = False
        if not clean:
            self.conn.disconnect()
        self._pool.release(self.conn)


def connection_kwargs(timeout_s: float) -> dict[str, Any]:
    """Socket settings shared by both Redis backends' clients."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "socket_read_size": _READ_SIZE,
        "retry": Retry(NoBackoff(), 0),  # StoreClient owns retries
        "protocol": 2,  # RESP2 (redis-py 8 defaults to RESP3): what ``resp_reader`` parses; no push messages
    }


def split_url(url: str, usage: str) -> tuple[SplitResult, dict[str, str]]:
    """``(parts, options)`` of a Redis store URL; ``ValueError`` on unknown options or a missing host."""
    parts = urlsplit(url)
    opts = url_options(url)
    tls = parts.scheme.lower().startswith("rediss")
    unknown = set(opts) - COMMON_OPTIONS - (TLS_OPTIONS if tls else set())
    if unknown:
        raise ValueError(f"store URL {redact_url(url)!r}: unknown options {sorted(unknown)}")
    if not parts.netloc:
        raise ValueError(f"store URL {redact_url(url)!r}: missing host ({usage})")
    return parts, opts


def common_kwargs(url: str, opts: dict[str, str]) -> dict[str, Any]:
    """Parse the options shared by both Redis backends (``auth``: redis-py's credential and TLS keywords)."""
    try:
        kw: dict[str, Any] = {
            "timeout_s": float(opts.get("timeout", 2.0)),
            "prefix": opts.get("prefix", DEFAULT_PREFIX.decode()).encode(),
            "ttl_s": int(opts.get("ttl", 0)),
            "batch": int(opts.get("batch", 32)),
        }
    except ValueError as e:
        raise ValueError(f"store URL {redact_url(url)!r}: bad option ({e})") from None
    kw["auth"] = auth_kwargs(url, opts)
    return kw


def auth_kwargs(url: str, opts: dict[str, str]) -> dict[str, Any]:
    """Credentials (ACL user, password) and TLS settings of a Redis URL as redis-py keywords."""
    parts = urlsplit(url)
    out: dict[str, Any] = {}
    if parts.username:
        out["username"] = unquote(parts.username)
    try:
        password = credentials.store_password(url, opts)
    except ValueError as e:
        raise ValueError(f"store URL {redact_url(url)!r}: {e}") from None
    if password:
        out["password"] = password
    if not parts.scheme.lower().startswith("rediss"):
        return out
    verify = opts.get("verify", "required")
    if verify not in ("required", "none"):
        raise ValueError(
            f"store URL {redact_url(url)!r}: verify must be 'required' or 'none', got {verify!r}"
        )
    if ("cert" in opts) != ("key" in opts):
        raise ValueError(f"store URL {redact_url(url)!r}: a client certificate needs both cert= and key=")
    for name in ("ca", "cert", "key"):
        if name in opts and not Path(opts[name]).is_file():
            raise ValueError(f"store URL {redact_url(url)!r}: {name}={opts[name]!r} is not a readable file")
    out.update(ssl=True, ssl_cert_reqs=verify, ssl_check_hostname=verify == "required")
    if "ca" in opts:
        out["ssl_ca_certs"] = opts["ca"]
    if "cert" in opts:
        out.update(ssl_certfile=opts["cert"], ssl_keyfile=opts["key"])
    return out


def open_redis(url: str) -> RedisStore:
    """Factory for ``redis://host:port/db`` and ``rediss://`` (TLS)."""
    parts, opts = split_url(url, "redis://host:port/db")
    if "," in parts.netloc:
        raise ValueError(f"store URL {redact_url(url)!r}: expected redis://host:port/db (one host)")
    ((host, port),) = parse_host_ports(parts.netloc, url)
    db_s = parts.path.strip("/") or "0"
    if not db_s.isdigit():
        raise ValueError(f"store URL {redact_url(url)!r}: bad database number {db_s!r}")
    return RedisStore(host, port, int(db_s), **common_kwargs(url, opts))
