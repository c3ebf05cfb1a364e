"""How the store client runs one backend call: its failure policy (``client.StoreClient`` keeps one guard).

``CallGuard.call(method, fn, nbytes)`` runs ``fn(backend)`` and answers ``(None, result)`` or
``(kind, None)``; it never raises. Around every call it adds:

- a lazily opened backend: ``open_client`` hands a factory when the store is not reachable yet, and the
  first call that gets through opens it;
- a timeout on every call: backend calls run on a small worker pool and the caller waits at most
  ``timeout_s`` plus the time the call's bytes take at ``min_mb_s`` (the client passes for a put the
  bytes sent, for a get keys times the running average blob size), so big batches on slow links are not
  cut off; a stuck call keeps its worker, and the breaker stops new work piling up behind it;
- bounded retries (``retries``, exponential backoff) for transient kinds (timeout, unavailable);
- refused credentials (kind ``auth``, ``auth_gate.py``) are a configuration error, not an outage: never
  retried, never counted against a breaker; calls fail fast as ``auth`` except one probe every
  ``auth_retry_s``;
- two circuit breakers (``breaker.py``), one for reads (``count_prefix``, ``get_many``) and one for
  writes (``put_many``, ``delete_many``): after ``breaker_failures`` consecutive failed calls of its
  kind a breaker opens and those calls fail fast (a miss / a dropped write) for ``breaker_reset_s``;
  then one probe call is let through (half-open) and its success closes it again. Separate, so a
  store that only refuses writes (read-only, disk full) keeps serving lookups, and vice versa; a
  caller's misuse (kind ``invalid``) leaves them alone;
- error counting (``Counters.error``, shared with the client) and logging: each (op, kind) once at
  WARNING, repeats only at DEBUG (never one line per call);
- an optional error listener ``on_error(op, kind, n)`` called for every failed call (after its
  retries), every call refused by an open breaker (kind ``breaker_open``) and every corrupt value the
  client reports (kind ``corrupt``), with ``op`` one of :data:`OPS` values (``lookup``, ``get``,
  ``put``, ...), and a breaker listener ``on_breaker(circuit, state)`` (``read``/``write``) for every
  breaker state change. The serving glue feeds them into ``sglang:remote_kv_store_errors_total`` and
  the breaker gauge; they must be cheap (they run on the calling thread), and one that raises is
  counted, never fails a store call.

Threading: any thread may call any method concurrently.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .auth_gate import AUTH, AuthGate
from .base import Counters, KVStore, StoreError
from .breaker import CircuitBreaker

log = logging.getLogger(__name__)
T = TypeVar("T")

_RETRYABLE = frozenset({"timeout", "unavailable"})
# backend method -> the op label of its errors; _WRITES use the write breaker, the rest the read one
OPS = {
    "count_prefix": "lookup",
    "get_many": "get",
    "put_many": "put",
    "delete_many": "delete",
    "stats": "stats",
}
_WRITES = frozenset({"put_many", "delete_many"})
ErrorListener = Callable[[str, str, int], None]


@dataclass(frozen=True)
class ClientConfig:
    timeout_s: float = 5.0  # fixed part of every call's deadline
    # Slowest transfer rate tolerated (adds bytes / min_mb_s to the deadline): a hang guard only, as
    # slow as the queue's (2 Mbit/s); whether a slow fetch still pays is the policy's call.
    min_mb_s: float = 0.25
    retries: int = 1
    retry_backoff_s: float = 0.02
    negative_ttl_s: float = 1.0
    negative_max: int = 65536
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    auth_retry_s: float = 60.0  # after refused credentials: calls fail fast, one probe per this long
    batch: int = 8  # keys per backend call in get_many/put_many (each call has its own timeout)
    workers: int = 4


class CallGuard:
    """Timeout, retries, breakers and error reporting of the calls to one backend (see module docstring).

    ``store``: the backend, or a factory that opens it (called on first use, under a lock)."""

    def __init__(
        self,
        store: KVStore | Callable[[], KVStore],
        config: ClientConfig,
        counters: Counters,
        name: str,
        on_error: ErrorListener | None = None,
    ) -> None:
        self.config = cfg = config
        self.store: KVStore | None = None  # the backend once open
        self._factory: Callable[[], KVStore] | None = None
        if callable(store) and not hasattr(store, "get_many"):
            self._factory = store
        else:
            self.store = store  # type: ignore[assignment]
        self._counters = counters
        self.read = CircuitBreaker(
            cfg.breaker_failures,
            cfg.breaker_reset_s,
            "store read",
            lambda state: self._notify_breaker("read", state),
        )
        self.write = CircuitBreaker(
            cfg.breaker_failures,
            cfg.breaker_reset_s,
            "store write",
            lambda state: self._notify_breaker("write", state),
        )
        self.auth = AuthGate(cfg.auth_retry_s, name, counters)
        self._pool = cf.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="srkv-store")
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self.on_error = on_error
        self.on_breaker: Callable[[str, str], None] | None = None  # (circuit read|write, state): a gauge

    def backend(self) -> KVStore:
        """The backend, opened now if it is not yet (raises what opening raises)."""
        if self.store is None:
            with self._open_lock:
                if self.store is None:
                    assert self._factory is not None
                    self.store = self._factory()
        return self.store

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """Run ``fn(*args)`` on the worker pool (``RuntimeError`` once closed)."""
        return self._pool.submit(fn, *args)

    def note_error(self, op: str, kind: str, exc: BaseException | None) -> None:
        """Count a failure of ``op`` and log it (each (op, kind) once at WARNING, then at DEBUG)."""
        self._counters.error(kind)
        tag = f"{op}:{kind}"
        with self._log_lock:
            first = tag not in self._logged
            self._logged.add(tag)
        log.log(logging.WARNING if first else logging.DEBUG, "store %s failed (%s): %s", op, kind, exc)

    def notify(self, method: str, kind: str, n: int = 1) -> None:
        """Tell the error listener (metrics) about ``n`` failures of ``method``. Never raises."""
        listener = self.on_error
        if listener is None or n <= 0:
            return
        try:
            listener(OPS.get(method, method), kind, n)
        except Exception as e:  # the listener is the caller's code: count it, never fail a store call
            self.note_error("on_error", type(e).__name__, e)

    def _notify_breaker(self, circuit: str, state: str) -> None:
        """Tell the breaker listener (metrics) about a state change. Never raises."""
        listener = self.on_breaker
        if listener is None:
            return
        try:
            listener(circuit, state)
        except Exception as e:  # the listener is the caller's code: count it, never fail a store call
            self.note_error("on_breaker", type(e).__name__, e)

    def deadline(self, nbytes: float) -> float:
        """Seconds a call moving ``nbytes`` may take: ``timeout_s`` + ``nbytes`` at ``min_mb_s``."""
        return self.config.timeout_s + nbytes / (self.config.min_mb_s * 1024 * 1024)

    def call(self, op: str, fn: Callable[[KVStore], T], nbytes: float = 0.0) -> tuple[str | None, T | None]:
        """Run ``fn(backend)`` with timeout, retries and ``op``'s breaker (``op``: the backend method).

        Returns ``(None, result)`` on success, ``(kind, None)`` on failure (already counted, logged
        once and reported to the error listener)."""
        breaker = self.write if op in _WRITES else self.read
        if not self.auth.allows():
            self._counters.error(AUTH)
            self.notify(op, AUTH)
            return AUTH, None
        if not breaker.allow():
            self._counters.error("circuit_open")
            self.notify(op, "breaker_open")
            return "breaker_open", None
        cfg = self.config
        kind: str | None = None
        for attempt in range(cfg.retries + 1):
            kind, value = self._attempt(fn, self.deadline(nbytes))
            if kind is None:
                breaker.success()
                self.auth.accepted()
                return None, value
            if kind == AUTH:  # a configuration error, not an outage: no retry, no breaker
                self.auth.refused(value)
                breaker.neutral()
                self.notify(op, kind)
                return kind, None
            self.note_error(op, kind, value)
            if kind == "invalid":  # caller misuse, not a store failure: leave the breaker alone
                breaker.neutral()
                self.notify(op, kind)
                return kind, None
            if kind not in _RETRYABLE or attempt == cfg.retries:
                break
            self._counters.add(retries=1)
            time.sleep(cfg.retry_backoff_s * (2**attempt))
        breaker.failure()
        self.notify(op, kind or "error")
        return kind or "error", None

    def _attempt(self, fn: Callable[[KVStore], Any], timeout: float) -> tuple[str | None, Any]:
        try:
            fut = self._pool.submit(lambda: fn(self.backend()))
        except RuntimeError as e:  # pool shut down: client closed
            return "closed", e
        try:
            return None, fut.result(timeout=timeout)
        except cf.TimeoutError as e:
            fut.cancel()
            return "timeout", e
        except Exception as e:  # the "every failure is a miss" boundary: counted and logged by caller
            return error_kind(e), e

    def close(self) -> None:
        """Stop the worker pool (later calls fail as ``closed``) and close the backend if open. Never raises."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            try:
                self.store.close()
            except Exception as e:  # closing is best-effort; a dead store must not raise here
                self.note_error("close", type(e).__name__, e)


def error_kind(e: BaseException) -> str:
    """The error kind of a failed backend call (``StoreError.kind``, or from the exception's type)."""
    if isinstance(e, StoreError):
        return e.kind
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, ConnectionError):
        return "unavailable"
    if isinstance(e, ValueError):
        return "invalid"
    if isinstance(e, OSError):  # e.g. a read-only or full embedded store: "io:EROFS"
        return f"io:{errno.errorcode.get(e.errno or 0, 'error')}"
    return type(e).__name__
