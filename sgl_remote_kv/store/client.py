"""The fault-tolerant store client used by the serving path and the data plane.

``StoreClient`` wraps any ``KVStore`` and guarantees that **every failure is a miss**: no exception
ever reaches the caller (who then recomputes the KV). On top of the backend it adds:

- a timeout on every call: backend calls run on a small worker pool and the caller waits at most
  ``timeout_s`` plus the time the call's bytes take at ``min_mb_s`` (put: the bytes sent; get: keys
  times the running average blob size), so big batches on slow links are not cut off; a stuck call
  keeps its worker, and the breaker stops new work piling up behind it;
- bounded retries (``retries``, exponential backoff) for transient kinds (timeout, unavailable);
- refused credentials (kind ``auth``: a wrong or missing password, an ACL user without permission) are a
  configuration error, not an outage: never retried, never counted against a breaker; the first is logged
  once at ERROR, then every call fails fast as ``auth`` without asking the store, except one probe call
  every ``auth_retry_s`` (a password fixed on the server's side heals without a restart);
- a short negative cache: keys found absent in the last ``negative_ttl_s`` are answered as misses
  without asking the store (our own ``put_many`` clears them);
- two circuit breakers (``breaker.py``), one for reads (``count_prefix``, ``get_many``) and one for
  writes (``put_many``, ``delete_many``): after ``breaker_failures`` consecutive failed calls of its
  kind a breaker opens and those calls fail fast (a miss / a dropped write) for ``breaker_reset_s``;
  then one probe call is let through (half-open) and its success closes it again. Separate, so a
  store that only refuses writes (read-only, disk full) keeps serving lookups, and vice versa;
- integrity framing (``framing.py``: payload length, write time, tenant tag, CRC over key and all of
  it): a truncated, corrupt or misplaced blob (or a ``base.CorruptValue`` from the backend: a MAC that
  did not verify) is a miss (kind ``corrupt``, one per value) and is deleted best-effort, so a corrupt
  value is never served; ``report_corrupt`` counts a value the caller's codec found corrupt the same
  way. Corrupt values are logged by ``corruption.py`` (rate-limited, naming the key), not per call here.
- streamed gets (``stream_get``, ``streaming.py``) for backends that can read a value in pieces: same
  breaker, deadline, framing, negative cache and counters, the pieces handed out as they arrive;
- counters (hits, misses, bytes, latency per op, errors by kind, circuit state) via ``stats()``;
- an optional error listener ``on_error(op, kind, n)`` called for every failed call (after its
  retries), every call refused by an open breaker (kind ``breaker_open``) and every corrupt value
  (kind ``corrupt``), with ``op`` one of :data:`OPS` values (``lookup``, ``get``, ``put``, ...). The
  serving glue feeds it into ``sglang:remote_kv_store_errors_total`` (the listener must be cheap: it
  runs on the calling thread). ``lookup_prefix`` also tells the caller *why* a prefix query answered
  less than asked (``PrefixLookup.error``), so a failed lookup is not mistaken for a cold cache.

Threading: any thread may call any method concurrently (the scheduler thread calls ``count_prefix``,
data-plane workers call ``get_many``/``put_many``). Buffers: ``put_many`` copies values into framed
blobs before returning (the caller may reuse its buffers); ``get_many`` returns fresh ``bytes``
owned by the caller.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from . import corruption
from .base import CorruptValue, Counters, KVStore, StoreError, StoreStats, open_store, redact_url
from .breaker import CircuitBreaker, worst
from .framing import FrameError, check_frame, frame
from .keys import SHARED_TAG
from .streaming import StreamedGet, StreamOutcome, StreamPlan

log = logging.getLogger(__name__)
T = TypeVar("T")

_RETRYABLE = frozenset({"timeout", "unavailable"})
_AUTH = "auth"  # base.StoreAuthError.kind
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
class PrefixLookup:
    """Answer of ``StoreClient.lookup_prefix``: ``found`` leading keys exist; ``error`` is the failure
    kind (``unavailable``, ``timeout``, ``breaker_open``, ...) when the store did not answer, so
    ``found == 0`` means "unknown", not "absent". ``None`` when the store (or the negative cache)
    answered."""

    found: int
    error: str | None = None


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


class StoreClient:
    """Fault-tolerant front of a ``KVStore``; same interface, never raises (see module docstring)."""

    def __init__(
        self,
        store: KVStore | Callable[[], KVStore],
        config: ClientConfig | None = None,
        name: str = "store",
        on_error: ErrorListener | None = None,
    ) -> None:
        self.config = cfg = config or ClientConfig()
        self._store: KVStore | None = None
        self._factory: Callable[[], KVStore] | None = None
        if callable(store) and not hasattr(store, "get_many"):
            self._factory = store
        else:
            self._store = store  # type: ignore[assignment]
        self._counters = Counters(f"client:{name}")
        self._read_breaker = CircuitBreaker(
            cfg.breaker_failures,
            cfg.breaker_reset_s,
            "store read",
            lambda state: self._notify_breaker("read", state),
        )
        self._write_breaker = CircuitBreaker(
            cfg.breaker_failures,
            cfg.breaker_reset_s,
            "store write",
            lambda state: self._notify_breaker("write", state),
        )
        self._pool = cf.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="srkv-store")
        self._neg: OrderedDict[bytes, float] = OrderedDict()
        self._neg_lock = threading.Lock()
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._avg_blob = 0.0
        self._name = name
        self._auth_lock = threading.Lock()
        self._auth_until = 0.0  # monotonic time before which calls fail fast as ``auth`` (0: not refused)
        self._auth_refused = False  # the last call that reached the store was refused authentication
        self.on_error = on_error
        self.on_breaker: Callable[[str, str], None] | None = None  # (circuit read|write, state): a gauge

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

    def _notify(self, method: str, kind: str, n: int = 1) -> None:
        """Tell the error listener (metrics) about ``n`` failures of ``method``. Never raises."""
        listener = self.on_error
        if listener is None or n <= 0:
            return
        try:
            listener(OPS.get(method, method), kind, n)
        except Exception as e:  # the listener is the caller's code: count it, never fail a store call
            self._note_error("on_error", type(e).__name__, e)

    def _notify_breaker(self, circuit: str, state: str) -> None:
        """Tell the breaker listener (metrics) about a state change. Never raises."""
        listener = self.on_breaker
        if listener is None:
            return
        try:
            listener(circuit, state)
        except Exception as e:  # the listener is the caller's code: count it, never fail a store call
            self._note_error("on_breaker", type(e).__name__, e)

    def _deadline(self, nbytes: float) -> float:
        return self.config.timeout_s + nbytes / (self.config.min_mb_s * 1024 * 1024)

    def _note_sizes(self, sizes: Sequence[int]) -> None:
        for n in sizes:  # exponential moving average of blob size, used for get deadlines
            self._avg_blob += 0.2 * (n - self._avg_blob)

    def _call(self, op: str, fn: Callable[[KVStore], T], nbytes: float = 0.0) -> tuple[str | None, T | None]:
        """Run ``fn(backend)`` with timeout, retries and ``op``'s breaker.

        Returns ``(None, result)`` on success, ``(kind, None)`` on failure (already counted, logged
        once and reported to the error listener)."""
        breaker = self._write_breaker if op in _WRITES else self._read_breaker
        if not self._auth_allows():
            self._counters.error(_AUTH)
            self._notify(op, _AUTH)
            return _AUTH, None
        if not breaker.allow():
            self._counters.error("circuit_open")
            self._notify(op, "breaker_open")
            return "breaker_open", None
        cfg = self.config
        kind: str | None = None
        for attempt in range(cfg.retries + 1):
            kind, value = self._attempt(fn, self._deadline(nbytes))
            if kind is None:
                breaker.success()
                self._auth_accepted()
                return None, value
            if kind == _AUTH:  # a configuration error, not an outage: no retry, no breaker
                self._auth_refused_now(value)
                breaker.neutral()
                self._notify(op, kind)
                return kind, None
            self._note_error(op, kind, value)
            if kind == "invalid":  # caller misuse, not a store failure: leave the breaker alone
                breaker.neutral()
                self._notify(op, kind)
                return kind, None
            if kind not in _RETRYABLE or attempt == cfg.retries:
                break
            self._counters.add(retries=1)
            time.sleep(cfg.retry_backoff_s * (2**attempt))
        breaker.failure()
        self._notify(op, kind or "error")
        return kind or "error", None

    # -- refused credentials -------------------------------------------------------------------------
    def _auth_allows(self) -> bool:
        """False while the store's refusal of our credentials is recent; after ``auth_retry_s`` one caller
        (the probe) is let through and the window restarts."""
        with self._auth_lock:
            if not self._auth_until:
                return True
            now = time.monotonic()
            if now < self._auth_until:
                return False
            self._auth_until = now + self.config.auth_retry_s  # this caller probes; the others wait
            return True

    def _auth_refused_now(self, exc: object) -> None:
        self._counters.error(_AUTH)
        with self._auth_lock:
            first = not self._auth_refused
            self._auth_refused = True
            self._auth_until = time.monotonic() + self.config.auth_retry_s
        if first:
            log.error(
                "store %s refused authentication (%s): a configuration error, not an outage, so it is not "
                "retried: every store call now fails at once (a miss or a dropped write, counted as "
                'store_errors_total{kind="auth"}) except one probe every %.0f s. Check the password '
                "(--remote-kv-store-password-file, SRKV_STORE_PASSWORD or the URL) and the ACL user.",
                self._name,
                exc,
                self.config.auth_retry_s,
            )
        else:
            log.debug("store %s still refuses authentication: %s", self._name, exc)

    def _auth_accepted(self) -> None:
        if not self._auth_refused:
            return
        with self._auth_lock:
            was, self._auth_refused, self._auth_until = self._auth_refused, False, 0.0
        if was:
            log.info("store %s accepts our credentials again", self._name)

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
        except Exception as e:  # the "every failure is a miss" boundary: counted and logged by caller
            return _kind(e), e

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
        return self.lookup_prefix(keys).found

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        """``count_prefix`` plus why it may be short: ``error`` is set when the store did not answer."""
        keys = list(keys)
        now = time.monotonic()
        with self._neg_lock:
            limit = next((i for i, k in enumerate(keys) if self._neg_hit(k, now)), len(keys))
        if limit < len(keys):
            self._counters.add(negative_cache_hits=1)
        t0 = time.perf_counter()
        err, n = self._call("count_prefix", lambda s: s.count_prefix(keys[:limit])) if limit else (None, 0)
        self._counters.latency("count_prefix", time.perf_counter() - t0)
        n = int(n or 0) if err is None else 0
        if err is None and n < limit:
            self._neg_add([keys[n]])
        self._counters.add(hits=n, misses=int(n < len(keys)))
        return PrefixLookup(n, err)

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
            err, blobs = self._call("get_many", lambda s, sub=sub: s.get_many(sub), len(sub) * self._avg_blob)
            if err is None and blobs is not None:
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
            try:
                if isinstance(blob, CorruptValue):
                    raise FrameError(blob.reason)
                out[i] = check_frame(key, blob).payload
            except FrameError as e:
                corrupt.append(key)
                corruption.note(key, "store client", str(e))
        self._neg_add(absent)
        self._note_sizes([len(b) for b in blobs if b is not None])
        if corrupt:
            self._counters.error("corrupt", len(corrupt))
            self._notify("get_many", "corrupt", len(corrupt))
            self._call("delete_many", lambda s: s.delete_many(corrupt))

    def report_corrupt(self, key: bytes, where: str, why: str) -> None:
        """The caller found ``key``'s value corrupt past the store framing (the codec's header or section
        CRCs): count it as one ``corrupt`` get (counters, the error listener) and log it (rate-limited).
        Deleting it is the caller's business (the waiting queue's repair). Never raises."""
        self._counters.error("corrupt")
        self._notify("get_many", "corrupt")
        corruption.note(key, where, why)

    def stream_get(self, key: bytes, max_bytes: int, piece_bytes: int) -> StreamedGet | None:
        """``key``'s value as it arrives (``streaming.StreamedGet``), or ``None`` where this client cannot
        stream it: the backend has no ``stream_get`` (or is not open yet), the key was just found absent,
        or the read breaker refuses (``get_many`` then answers, with its own counting). ``max_bytes``:
        the longest acceptable payload."""
        store = self._store
        if store is None or not hasattr(store, "stream_get"):
            return None
        with self._neg_lock:
            if self._neg_hit(key, time.monotonic()):
                return None
        if not self._auth_allows():  # refused credentials: get_many answers (fast, counted)
            return None
        if not self._read_breaker.allow():
            return None
        cfg = self.config
        plan = StreamPlan(
            piece_bytes,
            max_bytes,
            cfg.timeout_s,
            cfg.min_mb_s * 1024 * 1024,
            self._avg_blob,
            cfg.retries,
            cfg.retry_backoff_s,
        )
        return StreamedGet(
            key, plan, lambda: store.stream_get(key, piece_bytes), self._pool.submit, _kind, self._stream_done
        )

    def _stream_done(self, s: StreamedGet, seconds: float) -> None:
        """Account a finished ``StreamedGet`` like the ``get_many`` of one key (the consumer's thread)."""
        self._counters.latency("get_many", seconds)
        if s.attempts > 1:
            self._counters.add(retries=s.attempts - 1)
        out = s.outcome
        if out is StreamOutcome.ABORTED:
            self._read_breaker.neutral()
            return
        if out is StreamOutcome.FAILED:
            if s.error == _AUTH:
                self._auth_refused_now(s.detail or "refused")
            else:
                self._note_error("get_many", s.error, StoreError(s.detail or s.error))
            if s.error in ("invalid", _AUTH):  # caller misuse / refused credentials: not an outage
                self._read_breaker.neutral()
            else:
                self._read_breaker.failure()
            self._notify("get_many", s.error)
            self._counters.add(misses=1)
            return
        self._read_breaker.success()
        self._auth_accepted()
        if out is StreamOutcome.OK:
            self._note_sizes([s.received])
            self._counters.add(hits=1, bytes_read=s.received)
            return
        self._counters.add(misses=1)
        if out is StreamOutcome.ABSENT:
            self._neg_add([s.key])
            return
        self._counters.error("corrupt")
        corruption.note(s.key, "store client, streamed", s.error)
        self._notify("get_many", "corrupt")
        self._call("delete_many", lambda st: st.delete_many([s.key]))

    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant_tag: bytes = SHARED_TAG) -> int:
        """Store items best-effort; returns how many were stored (failed batches are dropped).
        ``tenant_tag``: framed with every value (``keys.tenant_tag`` of the writer's request)."""
        items = list(items)
        self._neg_clear([k for k, _ in items])
        t0 = time.perf_counter()
        stored = nbytes = 0
        step = max(1, self.config.batch)
        for b in range(0, len(items), step):
            sub = items[b : b + step]
            framed = [(k, frame(k, v, tenant_tag)) for k, v in sub]
            size = sum(len(v) for _, v in framed)
            err, _ = self._call("put_many", lambda s, framed=framed: s.put_many(framed), size)
            self._note_sizes([len(v) for _, v in framed])
            if err is None:
                stored += len(sub)
                nbytes += sum(len(v) for _, v in sub)
        self._counters.latency("put_many", time.perf_counter() - t0)
        self._counters.add(keys_written=stored, bytes_written=nbytes)
        return stored

    def delete_many(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        err, _ = self._call("delete_many", lambda s: s.delete_many(keys))
        if err is None:
            self._counters.add(keys_deleted=len(keys))

    def stats(self) -> StoreStats:
        """Counters; ``circuit`` is the less healthy of the two breakers (see ``circuits()``)."""
        return self._counters.snapshot(circuit=worst(self._read_breaker.state, self._write_breaker.state))

    def circuits(self) -> dict[str, str]:
        """State of each breaker: ``{"read": ..., "write": ...}``."""
        return {"read": self._read_breaker.state, "write": self._write_breaker.state}

    def backend_stats(self) -> StoreStats | None:
        """The wrapped backend's own counters (``None`` if it is not open or fails)."""
        err, st = self._call("stats", lambda s: s.stats()) if self._store is not None else ("closed", None)
        return st if err is None else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception as e:  # closing is best-effort; a dead store must not raise here
                self._note_error("close", type(e).__name__, e)


def _kind(e: BaseException) -> str:
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


def open_client(
    url: str | None = None, config: ClientConfig | None = None, on_error: ErrorListener | None = None
) -> StoreClient:
    """A ``StoreClient`` for ``url``. Bad URLs raise ``ValueError``; an unreachable store does not
    (the client keeps trying to open it lazily, behind the breaker)."""
    name = redact_url(url) if url else "default"
    try:
        return StoreClient(open_store(url), config, name=name, on_error=on_error)
    except StoreError as e:
        log.warning("store %s not reachable yet (%s); will retry lazily", name, e)
        return StoreClient(lambda: open_store(url), config, name=name, on_error=on_error)
