"""The ``KVStore`` interface, its typed stats record, and the URL -> backend registry.

A store maps 32-byte chunk keys (see ``keys.py``) to opaque blobs (encoded KV chunks). Every
operation is batch-first: the serving path asks "how many leading chunks of this prompt exist"
(``count_prefix``) and the data plane moves many chunks per call (``get_many`` / ``put_many``).

Publish after full write: every backend makes a value visible only once it is completely written,
so a reader never sees a partial or failed blob (see each backend's ``put_many`` docstring).

Every backend here also lists its keys (``scan(batch)``: batches of keys, for ``sgl-remote-kv-admin``,
never on the serving path); it is not part of the ``KVStore`` protocol the serving path relies on.

Backends raise on failure (``StoreError`` subclasses, or ``ValueError`` for misuse). They are *not*
meant to be called directly from the serving path: wrap them in ``client.StoreClient``, which adds
timeouts, retries, a negative cache and a circuit breaker, and turns every failure into a miss.

URL schemes (resolved lazily, so using the embedded store never imports redis):

- ``file:///abs/path`` or a plain filesystem path: embedded directory store (``local.py``)
- ``redis://host:port/db``: standalone Redis (``redis_store.py``)
- ``redis+cluster://host:port[,host:port...]``: Redis Cluster (``redis_cluster.py``)
- ``faulty+<inner url>``: fault-injecting wrapper around any of the above (``faulty.py``)
- ``auth+<inner url>?auth_key_file=PATH``: MAC-authenticated values (``sgl_remote_kv/store/security.py``)
- ``dpu+ipc:///path`` / ``dpu+tcp://host:port``: the store of a data-plane service that runs a store proxy
  (``--store-endpoint``), for hosts that cannot reach the store themselves (``via_dpu.py``)

Query parameters (``?timeout=2&prefix=srkv:``) are passed to the backend as options.
"""

from __future__ import annotations

import importlib
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlsplit

from .. import env

KEY_BYTES = 32


class StoreError(Exception):
    """Base class of backend failures. ``kind`` names the failure for counters."""

    kind = "error"


class StoreUnavailable(StoreError):
    """The store cannot be reached (connection refused/reset, cluster down, injected outage)."""

    kind = "unavailable"


class StoreTimeout(StoreError):
    """An operation did not complete in time."""

    kind = "timeout"


class StoreAuthError(StoreError):
    """The store refused our credentials (wrong or missing password, unknown ACL user, or a user without
    permission for our keys). A configuration error, not an outage: ``client.StoreClient`` does not retry
    it nor count it against its breakers (see its module docstring)."""

    kind = "auth"


class CorruptValue(bytes):
    """What a backend returns for a value it read but found corrupt (``security.AuthenticatedStore``: a MAC
    that did not verify): empty bytes, never a valid frame, carrying ``reason``. ``client.StoreClient``
    counts it as ``corrupt`` and deletes it like a value failing the store framing."""

    reason: str

    def __new__(cls, reason: str) -> CorruptValue:
        out = super().__new__(cls, b"")
        out.reason = reason
        return out


@dataclass(frozen=True)
class LatencyStats:
    """Wall-clock latency of one operation type (seconds)."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's (or client's) counters. Immutable; take a new one to refresh.

    ``hits``/``misses`` count keys asked by ``get_many`` and ``count_prefix`` (a prefix query of n
    keys answering k counts k hits and, if k < n, one miss). ``errors`` maps failure kind
    (``timeout``, ``unavailable``, ``corrupt``, ``circuit_open``, ...) to a count. ``latency`` maps
    operation name to ``LatencyStats``. ``extra`` holds backend-specific gauges (bytes on disk, ...).
    """

    backend: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    keys_written: int = 0
    keys_deleted: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    latency: Mapping[str, LatencyStats] = field(default_factory=dict)
    circuit: str = "closed"
    extra: Mapping[str, float] = field(default_factory=dict)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


@runtime_checkable
class KVStore(Protocol):
    """A remote KV tier backend. Keys are 32-byte digests, values are opaque bytes.

    Threading: backends are safe to call from several threads at once (the scheduler thread asks
    ``count_prefix``; data-plane worker threads call ``get_many``/``put_many``). Buffers: values passed
    to ``put_many`` are only read during the call (the caller keeps ownership and may reuse them
    afterwards); ``get_many`` returns fresh ``bytes`` owned by the caller.
    """

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that exist (stops at the first absent key)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values for ``keys`` in order; ``None`` for absent keys."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store (key, value) pairs; each value becomes visible only when completely written."""
        ...

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove keys (absent keys are ignored)."""
        ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise ``ValueError`` unless every key is a 32-byte ``bytes`` digest."""
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ValueError(f"store keys must be {KEY_BYTES}-byte digests, got {k!r:.80}")


class Counters:
    """Thread-safe counters shared by backends and the client; ``snapshot()`` gives a ``StoreStats``."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._n: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._lat: dict[str, LatencyStats] = {}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._n[name] = self._n.get(name, 0) + d

    def error(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + n

    def latency(self, op: str, seconds: float) -> None:
        with self._lock:
            old = self._lat.get(op, LatencyStats())
            self._lat[op] = LatencyStats(old.count + 1, old.total_s + seconds, max(old.max_s, seconds))

    def timed(self, op: str) -> _Timer:
        return _Timer(self, op)

    def snapshot(self, circuit: str = "closed", extra: Mapping[str, float] | None = None) -> StoreStats:
        with self._lock:
            n = dict(self._n)
            fixed = {"hits", "misses", "bytes_read", "bytes_written", "keys_written", "keys_deleted"}
            more = {k: float(v) for k, v in n.items() if k not in fixed}
            more.update(extra or {})
            return StoreStats(
                backend=self.backend,
                hits=n.get("hits", 0),
                misses=n.get("misses", 0),
                bytes_read=n.get("bytes_read", 0),
                bytes_written=n.get("bytes_written", 0),
                keys_written=n.get("keys_written", 0),
                keys_deleted=n.get("keys_deleted", 0),
                errors=dict(self._errors),
                latency=dict(self._lat),
                circuit=circuit,
                extra=more,
            )


class _Timer:
    def __init__(self, counters: Counters, op: str) -> None:
        self._c, self._op = counters, op

    def __enter__(self) -> _Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._c.latency(self._op, time.perf_counter() - self._t0)


# scheme -> "module:factory"; factories take (url, options) and return a KVStore.
_REGISTRY: dict[str, str] = {
    "file": "sgl_remote_kv.store.local:open_local",
    "redis": "sgl_remote_kv.store.redis_store:open_redis",
    "redis+cluster": "sgl_remote_kv.store.redis_cluster:open_redis_cluster",
    "rediss": "sgl_remote_kv.store.redis_store:open_redis",
    "rediss+cluster": "sgl_remote_kv.store.redis_cluster:open_redis_cluster",
    "faulty": "sgl_remote_kv.store.faulty:open_faulty",
    "auth": "sgl_remote_kv.store.security:open_auth_store",
    "dpu+ipc": "sgl_remote_kv.store.via_dpu:open_via_dpu",
    "dpu+tcp": "sgl_remote_kv.store.via_dpu:open_via_dpu",
}


def default_store_url() -> str:
    """The embedded store under the cache dir; the default of ``--remote-kv-store``."""
    return (env.cache_dir() / "store").resolve().as_uri()


_USERINFO_SECRET = re.compile(r"(://[^/@?#]*?:)[^/@?#]*@")


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo replaced by ``***``: the only form of a store URL that
    may appear in a log line, an error message or a metric."""
    return _USERINFO_SECRET.sub(r"\1***@", url)


def url_options(url: str) -> dict[str, str]:
    """The query parameters of ``url`` as a dict (last value wins)."""
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def parse_host_ports(netloc: str, url: str, default_port: int = 6379) -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"`` -> [(h1, p1), ...]; ``ValueError`` on missing host or bad port."""
    if "@" in netloc:
        netloc = netloc.rsplit("@", 1)[1]
    out = []
    for part in netloc.split(","):
        host, sep, port_s = part.strip().rpartition(":") if ":" in part else (part.strip(), "", "")
        host = host.strip("[]")
        if not host:
            raise ValueError(f"store URL {redact_url(url)!r}: missing host")
        if not sep:
            out.append((host, default_port))
            continue
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ValueError(f"store URL {redact_url(url)!r}: bad port {port_s!r}")
        out.append((host, int(port_s)))
    return out


def _scheme_of(url: str) -> str:
    if "://" not in url:
        return "file"  # a plain path
    scheme = url.split("://", 1)[0].lower()
    if scheme.startswith("auth+"):
        return "auth"
    if scheme.startswith("faulty+"):
        return "faulty"
    return scheme


def open_store(url: str | None = None) -> KVStore:
    """Open the backend named by ``url`` (``None``/empty: ``default_store_url()``).

    Raises ``ValueError`` with one clear message for an unknown scheme, a missing host or a bad port.
    """
    url = (url or "").strip() or default_store_url()
    scheme = _scheme_of(url)
    target = _REGISTRY.get(scheme)
    if target is None:
        known = ", ".join(sorted(f"{s}://" for s in _REGISTRY))
        raise ValueError(
            f"store URL {redact_url(url)!r}: unknown scheme {scheme!r} (known: {known}, or a plain path)"
        )
    module_name, func_name = target.split(":")
    factory: Callable[[str], KVStore] = getattr(importlib.import_module(module_name), func_name)
    return factory(url)
