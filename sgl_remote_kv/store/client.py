"""The fault-tolerant store client used by the serving path and the data plane.

``StoreClient`` wraps any ``KVStore`` and guarantees that **every failure is a miss**: no exception
ever reaches the caller (who then recomputes the KV). On top of the backend it adds:

- the failure policy of every backend call (``guard.py``): a deadline that grows with the call's bytes,
  bounded retries for transient kinds, a fail-fast window after refused credentials (``auth_gate.py``),
  a read and a write circuit breaker, errors counted and logged once per (op, kind), and the error and
  breaker listeners ``on_error(op, kind, n)`` / ``on_breaker(circuit, state)`` (see ``guard.py`` for
  what each does and when the listeners are called);
- batching: ``get_many``/``put_many`` call the backend ``batch`` keys at a time, each call with its own
  deadline (put: the bytes sent; get: keys times the running average blob size);
- a short negative cache (``negative_cache.py``): keys found absent in the last ``negative_ttl_s`` are
  answered as misses without asking the store (our own ``put_many`` clears them);
- integrity framing (``framing.py``: payload length, write time, tenant tag, CRC over key and all of
  it): a truncated, corrupt or misplaced blob (or a ``base.CorruptValue`` from the backend: a MAC that
  did not verify) is a miss (kind ``corrupt``, one per value) and is deleted best-effort, so a corrupt
  value is never served; ``report_corrupt`` counts a value the caller's codec found corrupt the same
  way. Corrupt values are logged by ``corruption.py`` (rate-limited, naming the key), not per call here.
- streamed gets (``stream_get``, ``streaming.py``) for backends that can read a value in pieces: same
  breaker, deadline, framing, negative cache and counters, the pieces handed out as they arrive;
- counters (hits, misses, bytes, latency per op, errors by kind, circuit state) via ``stats()``;
- ``lookup_prefix`` also tells the caller *why* a prefix query answered less than asked
  (``PrefixLookup.error``), so a failed lookup is not mistaken for a cold cache.

Threading: any thread may call any method concurrently (the scheduler thread calls ``count_prefix``,
data-plane workers call ``get_many``/``put_many``). Buffers: ``put_many`` copies values into framed
blobs before returning (the caller may reuse its buffers); ``get_many`` returns fresh ``bytes``
owned by the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import corruption
from .auth_gate import AUTH
from .base import CorruptValue, Counters, KVStore, StoreError, StoreStats, open_store, redact_url
from .breaker import worst
from .framing import FrameError, check_frame, frame
from .guard import CallGuard, ClientConfig, ErrorListener, error_kind
from .keys import SHARED_TAG
from .negative_cache import NegativeCache
from .streaming import StreamedGet, StreamOutcome, StreamPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixLookup:
    """Answer of ``StoreClient.lookup_prefix``: ``found`` leading keys exist; ``error`` is the failure
    kind (``unavailable``, ``timeout``, ``breaker_open``, ...) when the store did not answer, so
    ``found == 0`` means "unknown", not "absent". ``None`` when the store (or the negative cache)
    answered."""

    found: int
    error: str | None = None


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
        self._counters = Counters(f"client:{name}")
        self._guard = CallGuard(store, cfg, self._counters, name, on_error)
        self._neg = NegativeCache(cfg.negative_ttl_s, cfg.negative_max)
        self._avg_blob = 0.0

    @property
    def on_error(self) -> ErrorListener | None:
        """Error listener ``(op, kind, n)`` (``guard.py``); settable."""
        return self._guard.on_error

    @on_error.setter
    def on_error(self, listener: ErrorListener | None) -> None:
        self._guard.on_error = listener

    @property
    def on_breaker(self) -> Callable[[str, str], None] | None:
        """Breaker listener ``(circuit read|write, state)`` (a gauge, ``guard.py``); settable."""
        return self._guard.on_breaker

    @on_breaker.setter
    def on_breaker(self, listener: Callable[[str, str], None] | None) -> None:
        self._guard.on_breaker = listener

    def _note_sizes(self, sizes: Sequence[int]) -> None:
        for n in sizes:  # exponential moving average of blob size, used for get deadlines
            self._avg_blob += 0.2 * (n - self._avg_blob)

    # -- KVStore interface -----------------------------------------------------------------------
    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys present; 0 on any failure. Stops early at a recently seen miss."""
        return self.lookup_prefix(keys).found

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixLookup:
        """``count_prefix`` plus why it may be short: ``error`` is set when the store did not answer."""
        keys = list(keys)
        limit = self._neg.first_hit(keys)
        if limit < len(keys):
            self._counters.add(negative_cache_hits=1)
        t0 = time.perf_counter()
        err, n = (
            self._guard.call("count_prefix", lambda s: s.count_prefix(keys[:limit])) if limit else (None, 0)
        )
        self._counters.latency("count_prefix", time.perf_counter() - t0)
        n = int(n or 0) if err is None else 0
        if err is None and n < limit:
            self._neg.add([keys[n]])
        self._counters.add(hits=n, misses=int(n < len(keys)))
        return PrefixLookup(n, err)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Payloads in order; ``None`` for absent, failed or corrupt keys."""
        keys = list(keys)
        out: list[bytes | None] = [None] * len(keys)
        todo = self._neg.unknown(keys)
        if len(todo) < len(keys):
            self._counters.add(negative_cache_hits=len(keys) - len(todo))
        t0 = time.perf_counter()
        step = max(1, self.config.batch)
        for b in range(0, len(todo), step):
            idx = todo[b : b + step]
            sub = [keys[i] for i in idx]
            err, blobs = self._guard.call(
                "get_many", lambda s, sub=sub: s.get_many(sub), len(sub) * self._avg_blob
            )
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
        self._neg.add(absent)
        self._note_sizes([len(b) for b in blobs if b is not None])
        if corrupt:
            self._counters.error("corrupt", len(corrupt))
            self._guard.notify("get_many", "corrupt", len(corrupt))
            self._guard.call("delete_many", lambda s: s.delete_many(corrupt))

    def report_corrupt(self, key: bytes, where: str, why: str) -> None:
        """The caller found ``key``'s value corrupt past the store framing (the codec's header or section
        CRCs): count it as one ``corrupt`` get (counters, the error listener) and log it (rate-limited).
        Deleting it is the caller's business (the waiting queue's repair). Never raises."""
        self._counters.error("corrupt")
        self._guard.notify("get_many", "corrupt")
        corruption.note(key, where, why)

    def stream_get(self, key: bytes, max_bytes: int, piece_bytes: int) -> StreamedGet | None:
        """``key``'s value as it arrives (``streaming.StreamedGet``), or ``None`` where this client cannot
        stream it: the backend has no ``stream_get`` (or is not open yet), the key was just found absent,
        or the read breaker refuses (``get_many`` then answers, with its own counting). ``max_bytes``:
        the longest acceptable payload."""
        store = self._guard.store
        if store is None or not hasattr(store, "stream_get"):
            return None
        if self._neg.hit(key):
            return None
        if not self._guard.auth.allows():  # refused credentials: get_many answers (fast, counted)
            return None
        if not self._guard.read.allow():
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
            key,
            plan,
            lambda: store.stream_get(key, piece_bytes),
            self._guard.submit,
            error_kind,
            self._stream_done,
        )

    def _stream_done(self, s: StreamedGet, seconds: float) -> None:
        """Account a finished ``StreamedGet`` like the ``get_many`` of one key (the consumer's thread)."""
        self._counters.latency("get_many", seconds)
        if s.attempts > 1:
            self._counters.add(retries=s.attempts - 1)
        out = s.outcome
        if out is StreamOutcome.ABORTED:
            self._guard.read.neutral()
            return
        if out is StreamOutcome.FAILED:
            if s.error == AUTH:
                self._guard.auth.refused(s.detail or "refused")
            else:
                self._guard.note_error("get_many", s.error, StoreError(s.detail or s.error))
            if s.error in ("invalid", AUTH):  # caller misuse / refused credentials: not an outage
                self._guard.read.neutral()
            else:
                self._guard.read.failure()
            self._guard.notify("get_many", s.error)
            self._counters.add(misses=1)
            return
        self._guard.read.success()
        self._guard.auth.accepted()
        if out is StreamOutcome.OK:
            self._note_sizes([s.received])
            self._counters.add(hits=1, bytes_read=s.received)
            return
        self._counters.add(misses=1)
        if out is StreamOutcome.ABSENT:
            self._neg.add([s.key])
            return
        self._counters.error("corrupt")
        corruption.note(s.key, "store client, streamed", s.error)
        self._guard.notify("get_many", "corrupt")
        self._guard.call("delete_many", lambda st: st.delete_many([s.key]))

    def put_many(self, items: Sequence[tuple[bytes, bytes]], tenant_tag: bytes = SHARED_TAG) -> int:
        """Store items best-effort; returns how many were stored (failed batches are dropped).
        ``tenant_tag``: framed with every value (``keys.tenant_tag`` of the writer's request)."""
        items = list(items)
        self._neg.clear([k for k, _ in items])
        t0 = time.perf_counter()
        stored = nbytes = 0
        step = max(1, self.config.batch)
        for b in range(0, len(items), step):
            sub = items[b : b + step]
            framed = [(k, frame(k, v, tenant_tag)) for k, v in sub]
            size = sum(len(v) for _, v in framed)
            err, _ = self._guard.call("put_many", lambda s, framed=framed: s.put_many(framed), size)
            self._note_sizes([len(v) for _, v in framed])
            if err is None:
                stored += len(sub)
                nbytes += sum(len(v) for _, v in sub)
        self._counters.latency("put_many", time.perf_counter() - t0)
        self._counters.add(keys_written=stored, bytes_written=nbytes)
        return stored

    def delete_many(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        err, _ = self._guard.call("delete_many", lambda s: s.delete_many(keys))
        if err is None:
            self._counters.add(keys_deleted=len(keys))

    def stats(self) -> StoreStats:
        """Counters; ``circuit`` is the less healthy of the two breakers (see ``circuits()``)."""
        return self._counters.snapshot(circuit=worst(self._guard.read.state, self._guard.write.state))

    def circuits(self) -> dict[str, str]:
        """State of each breaker: ``{"read": ..., "write": ...}``."""
        return {"read": self._guard.read.state, "write": self._guard.write.state}

    def close(self) -> None:
        self._guard.close()


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
