"""The fault-tolerant store client used by the serving path and the data plane.

``StoreClient`` wraps any ``KVStore`` and guarantees that **every failure is a miss**: no exception
ever reaches the caller (who then recomputes the KV). On top of the backend it adds:

- a timeout on every call: backend calls run on a small worker pool and the caller waits at most
  ``timeout_s`` plus the time the call's bytes take at ``min_mb_s`` (put: the bytes sent; get: keys
  times the running average blob size), so big batches on slow links are not cut off; a stuck call
  keeps its worker, and the breaker stops new work piling up behind it;
- bounded retries (``retries``, exponential backoff) for transient kinds (timeout, unavailable);
- a short negative cache: keys found absent in the last ``negative_ttl_s`` are answered as misses
  without asking the store (our own ``put_many`` clears them);
- a circuit breaker: after ``breaker_failures`` consecutive failed calls it opens and every call fails
  fast (a miss) for ``breaker_reset_s``; then one probe call is let through (half-open) and its
  success closes the breaker again;
- integrity framing: values are stored as ``header || payload`` with the payload length and a CRC32
  over key and payload. A truncated, corrupt or misplaced blob is a miss (kind ``corrupt``) and is
  deleted best-effort, so a corrupt value is never served.
- counters (hits, misses, bytes, latency per op, errors by kind, circuit state) via ``stats()``.

Threading: any thread may call any method concurrently (the scheduler thread calls ``count_prefix``,
data-plane workers call ``get_many``/``put_many``). Buffers: ``put_many`` copies values into framed
blobs before returning (the caller may reuse its buffers); ``get_many`` returns fresh ``bytes``
owned by the caller.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .base import Counters, KVStore, StoreError, StoreStats, open_store

log = logging.getLogger(__name__)
T = TypeVar("T")

_MAGIC = b"SRKV"
_HEADER = struct.Struct("<4sBxxxQI")  # magic, version, pad, payload length, crc32(key || payload)
_VERSION = 1
_RETRYABLE = frozenset({"timeout", "unavailable"})


@dataclass(frozen=True)
class ClientConfig:
    timeout_s: float = 5.0  # fixed part of every call's deadline
    min_mb_s: float = 10.0  # slowest transfer rate tolerated; adds bytes / min_mb_s to the deadline
    retries: int = 1
    retry_backoff_s: float = 0.02
    negative_ttl_s: float = 1.0
    negative_max: int = 65536
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    batch: int = 8  # keys per backend call in get_many/put_many (each call has its own timeout)
    workers: int = 4


def frame(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """``header || payload`` (one copy of the payload)."""
    crc = zlib.crc32(payload, zlib.crc32(key))
    return _HEADER.pack(_MAGIC, _VERSION, len(payload), crc) + bytes(payload)


def unframe(key: bytes, blob: bytes) -> bytes | None:
    """The payload of a framed blob, or ``None`` if it is truncated, corrupt or not for ``key``."""
    if len(blob) < _HEADER.size:
        return None
    magic, version, length, crc = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION or length != len(blob) - _HEADER.size:
        return None
    payload = blob[_HEADER.size :]
    return payload if zlib.crc32(payload, zlib.crc32(key)) == crc else None


class CircuitBreaker:
    """closed -> (N consecutive failures) -> open -> (reset_s) -> half_open -> probe ok -> closed."""

    def __init__(self, failures: int, reset_s: float) -> None:
        self._threshold = max(1, failures)
        self._reset_s = reset_s
        self._lock = threading.Lock()
        self.state = "closed"
        self._failures = 0
        self._opened_at = 0.0

    def allow(self) -> bool:
        with self._lock:
            if self.state == "closed":
                return True
            if self.state == "open" and time.monotonic() - self._opened_at >= self._reset_s:
                self.state = "half_open"  # this caller is the probe
                return True
            return False

    def success(self) -> None:
        with self._lock:
            if self.state != "closed":
                log.info("store circuit breaker closed (store recovered)")
            self.state, self._failures = "closed", 0

    def neutral(self) -> None:
        """The call said nothing about store health; a half-open probe slot is handed back."""
        with self._lock:
            if self.state == "half_open":
                self.state = "open"  # opened_at is old, so the next call probes again

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self.state == "half_open" or (self.state == "closed" and self._failures >= self._threshold):
                if self.state == "closed":
                    log.warning("store circuit breaker open after %d failures", self._failures)
                self.state, self._opened_at = "open", time.monotonic()


class StoreClient:
    """Fault-tolerant front of a ``KVStore``; same interface, never raises (see module docstring)."""

    def __init__(
        self,
        store: KVStore | Callable[[], KVStore],
        config: ClientConfig | None = None,
        name: str = "store",
    ) -> None:
        self.config = cfg = config or ClientConfig()
        self._store: KVStore | None = None
        self._factory: Callable[[], KVStore] | None = None
        if callable(store) and not hasattr(store, "get_many"):
            self._factory = store
        else:
            self._store = store  # type: ignore[assignment]
        self._counters = Counters(f"client:{name}")
        self._breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)
        self._pool = cf.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="srkv-store")
        self._neg: OrderedDict[bytes, float] = OrderedDict()
        self._neg_lock = threading.Lock()
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._avg_blob = 0.0

    # -- plumbing --------------------------------------------------------------------------------
    def _backend(self) -> KVStore:
        if self._store is None:
            with self._open_lock:
                if self._store is None:
                    assert self._factory is not None
                    self._store = self._factory()
        return self._store

    def _note_error(self, op: str, kind: str, exc: BaseException | None) -> None:
        self._counters.error(kind)
        tag = f"{op}:{kind}"
        with self._log_lock:
            first = tag not in self._logged
            self._logged.add(tag)
        # Log each (op, kind) once at WARNING; repeats only at DEBUG (never one line per call).
        log.log(logging.WARNING if first else logging.DEBUG, "store %s failed (%s): %s", op, kind, exc)

    def _deadline(self, nbytes: float) -> float:
        return self.config.timeout_s + nbytes / (self.config.min_mb_s * 1024 * 1024)

    def _note_sizes(self, sizes: Sequence[int]) -> None:
        for n in sizes:  # exponential moving average of blob size, used for get deadlines
            self._avg_blob += 0.2 * (n - self._avg_blob)

    def _call(self, op: str, fn: Callable[[KVStore], T], nbytes: float = 0.0) -> tuple[bool, T | None]:
        """Run ``fn(backend)`` with timeout, retries and the breaker. Returns (ok, result)."""
        if not self._breaker.allow():
            self._counters.error("circuit_open")
            return False, None
        cfg = self.config
        for attempt in range(cfg.retries + 1):
            kind, exc = self._attempt(fn, self._deadline(nbytes))
            if kind is None:
                self._breaker.success()
                return True, exc  # type: ignore[return-value]  # exc holds the result on success
            self._note_error(op, kind, exc)
            if kind == "invalid":  # caller misuse, not a store failure: leave the breaker alone
                self._breaker.neutral()
                return False, None
            if kind not in _RETRYABLE or attempt == cfg.retries:
                break
            self._counters.add(retries=1)
            time.sleep(cfg.retry_backoff_s * (2**attempt))
        self._breaker.failure()
        return False, None

    def _attempt(self, fn: Callable[[KVStore], Any], timeout: float) -> tuple[str | None, Any]:
        try:
            fut = self._pool.submit(lambda: fn(self._backend()))
        except RuntimeError as e:  # pool shut down: client closed
            return "closed", e
        try:
            return None, fut.result(timeout=timeout)
        except cf.TimeoutError as e:
            fut.cancel()
            return "timeout", e
        except StoreError as e:
            return e.kind, e
        except Exception as e:  # the "every failure is a miss" boundary: counted and logged by caller
            if isinstance(e, TimeoutError):
                return "timeout", e
            if isinstance(e, ConnectionError):
                return "unavailable", e
            if isinstance(e, ValueError):
                return "invalid", e
            return type(e).__name__, e

    # -- negative cache --------------------------------------------------------------------------
    def _neg_hit(self, key: bytes, now: float) -> bool:
        exp = self._neg.get(key)
        if exp is None:
            return False
        if exp < now:
            del self._neg[key]
            return False
        return True

    def _neg_add(self, keys: Sequence[bytes]) -> None:
        if self.config.negative_ttl_s <= 0:
            return
        exp = time.monotonic() + self.config.negative_ttl_s
        with self._neg_lock:
            for k in keys:
                self._neg[k] = exp
                self._neg.move_to_end(k)
            while len(self._neg) > self.config.negative_max:
                self._neg.popitem(last=False)

    def _neg_clear(self, keys: Sequence[bytes]) -> None:
        with self._neg_lock:
            for k in keys:
                self._neg.pop(k, None)

    # -- KVStore interface -----------------------------------------------------------------------
    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys present; 0 on any failure. Stops early at a recently seen miss."""
        keys = list(keys)
        now = time.monotonic()
        with self._neg_lock:
            limit = next((i for i, k in enumerate(keys) if self._neg_hit(k, now)), len(keys))
        if limit < len(keys):
            self._counters.add(negative_cache_hits=1)
        t0 = time.perf_counter()
        ok, n = self._call("count_prefix", lambda s: s.count_prefix(keys[:limit])) if limit else (True, 0)
        self._counters.latency("count_prefix", time.perf_counter() - t0)
        n = int(n or 0) if ok else 0
        if ok and n < limit:
            self._neg_add([keys[n]])
        self._counters.add(hits=n, misses=int(n < len(keys)))
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Payloads in order; ``None`` for absent, failed or corrupt keys."""
        keys = list(keys)
        out: list[bytes | None] = [None] * len(keys)
        now = time.monotonic()
        with self._neg_lock:
            todo = [i for i, k in enumerate(keys) if not self._neg_hit(k, now)]
        if len(todo) < len(keys):
            self._counters.add(negative_cache_hits=len(keys) - len(todo))
        t0 = time.perf_counter()
        step = max(1, self.config.batch)
        for b in range(0, len(todo), step):
            idx = todo[b : b + step]
            sub = [keys[i] for i in idx]
            ok, blobs = self._call("get_many", lambda s, sub=sub: s.get_many(sub), len(sub) * self._avg_blob)
            if ok and blobs is not None:
                self._fill(sub, idx, blobs, out)
        self._counters.latency("get_many", time.perf_counter() - t0)
        hits = sum(v is not None for v in out)
        nbytes = sum(len(v) for v in out if v is not None)
        self._counters.add(hits=hits, misses=len(keys) - hits, bytes_read=nbytes)
        return out

    def _fill(self, sub: list[bytes], idx: list[int], blobs: list[bytes | None], out: list) -> None:
        absent, corrupt = [], []
        for i, key, blob in zip(idx, sub, blobs, strict=True):
            if blob is None:
                absent.append(key)
                continue
            payload = unframe(key, blob)
            if payload is None:
                corrupt.append(key)
            out[i] = payload
        self._neg_add(absent)
        self._note_sizes([len(b) for b in blobs if b is not None])
        if corrupt:
            self._note_error("get_many", "corrupt", StoreError(f"{len(corrupt)} corrupt blob(s)"))
            self._counters.error("corrupt", len(corrupt) - 1)
            self._call("delete_many", lambda s: s.delete_many(corrupt))

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store items best-effort; returns how many were stored (failed batches are dropped)."""
        items = list(items)
        self._neg_clear([k for k, _ in items])
        t0 = time.perf_counter()
        stored = nbytes = 0
        step = max(1, self.config.batch)
        for b in range(0, len(items), step):
            sub = items[b : b + step]
            framed = [(k, frame(k, v)) for k, v in sub]
            size = sum(len(v) for _, v in framed)
            ok, _ = self._call("put_many", lambda s, framed=framed: s.put_many(framed), size)
            self._note_sizes([len(v) for _, v in framed])
            if ok:
                stored += len(sub)
                nbytes += sum(len(v) for _, v in sub)
        self._counters.latency("put_many", time.perf_counter() - t0)
        self._counters.add(keys_written=stored, bytes_written=nbytes)
        return stored

    def delete_many(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        ok, _ = self._call("delete_many", lambda s: s.delete_many(keys))
        if ok:
            self._counters.add(keys_deleted=len(keys))

    def stats(self) -> StoreStats:
        return self._counters.snapshot(circuit=self._breaker.state)

    def backend_stats(self) -> StoreStats | None:
        """The wrapped backend's own counters (``None`` if it is not open or fails)."""
        ok, st = self._call("stats", lambda s: s.stats()) if self._store is not None else (False, None)
        return st if ok else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception as e:  # closing is best-effort; a dead store must not raise here
                self._note_error("close", type(e).__name__, e)


def open_client(url: str | None = None, config: ClientConfig | None = None) -> StoreClient:
    """A ``StoreClient`` for ``url``. Bad URLs raise ``ValueError``; an unreachable store does not
    (the client keeps trying to open it lazily, behind the breaker)."""
    try:
        return StoreClient(open_store(url), config, name=url or "default")
    except StoreError as e:
        log.warning("store %s not reachable yet (%s); will retry lazily", url, e)
        return StoreClient(lambda: open_store(url), config, name=url or "default")
