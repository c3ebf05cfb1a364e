"""Fault-injecting ``KVStore`` wrapper for tests and soak runs.

Faults (all off by default, so ``FaultyStore(inner)`` behaves exactly like ``inner``):

- ``latency_s`` (+ uniform ``jitter_s``): sleep before every operation;
- ``error_rate``: an operation raises ``StoreUnavailable`` (``error_kind="unavailable"``) or
  ``StoreTimeout`` (``"timeout"``) instead of running;
- ``corrupt_rate``: a returned value has one byte flipped;
- ``drop_rate``: a put silently does not store a key; a get returns ``None`` for a present key;
- ``unavailable_fraction``: keys whose digest falls in that fraction of the key space always fail
  (partial availability, e.g. one shard of a cluster down). Chosen by key bytes, not by chance.
- ``down``: every operation raises ``StoreUnavailable`` (a full outage);
- ``piece_latency_s``: a streamed get (``stream_get``, offered only where the inner store has it) sleeps
  this long before every piece after the first (a slow link mid-value); the faults above apply to it as
  to a get of one key (before its first piece; a corrupt value has a byte flipped in one piece).

Randomness comes from ``random.Random(seed)`` under a lock: single-threaded runs are deterministic.
``set_faults`` swaps the configuration at runtime (e.g. take the store down, then bring it back).

URL: ``faulty+<inner url>`` with fault options in the query, e.g.
``faulty+file:///tmp/s?error_rate=0.1&seed=3`` (other query options go to the inner store).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .base import KVStore, StoreStats, StoreTimeout, StoreUnavailable, open_store, redact_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultConfig:
    latency_s: float = 0.0
    jitter_s: float = 0.0
    error_rate: float = 0.0
    error_kind: str = "unavailable"  # or "timeout"
    corrupt_rate: float = 0.0
    drop_rate: float = 0.0
    unavailable_fraction: float = 0.0
    down: bool = False
    piece_latency_s: float = 0.0
    link_gbps: float = 0.0  # 0: no emulated link
    seed: int = 0

    def __post_init__(self) -> None:
        if self.link_gbps < 0:
            raise ValueError("FaultConfig.link_gbps must be >= 0 (0: no emulated link)")
        for name in ("error_rate", "corrupt_rate", "drop_rate", "unavailable_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"FaultConfig.{name} must be in [0, 1]")
        if self.error_kind not in ("unavailable", "timeout"):
            raise ValueError(
                f"FaultConfig.error_kind must be 'unavailable' or 'timeout': {self.error_kind!r}"
            )


class FaultyStore:
    """Wraps a ``KVStore`` and injects faults per ``FaultConfig``. Thread-safe like its inner store."""

    def __init__(self, inner: KVStore, faults: FaultConfig | None = None, control: str | None = None) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._injected: dict[str, int] = {}
        self._base = faults or FaultConfig()
        self._control = control
        self._control_mtime: int | None = None
        self._wire_free = 0.0  # monotonic time at which the emulated link is idle
        self.set_faults(self._base)
        if hasattr(inner, "stream_get"):  # a capability: offered only where the inner store streams
            self.stream_get = self._stream_get

    def _count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._injected[kind] = self._injected.get(kind, 0) + n

    def set_faults(self, faults: FaultConfig) -> None:
        with self._lock:
            self.faults = faults
            self._rng = random.Random(faults.seed)

    def _chance(self, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < p

    def _reload_control(self) -> None:
        """Apply the control file's faults over the URL's when its mtime changed (see module docstring)."""
        try:
            mtime = os.stat(self._control).st_mtime_ns
        except OSError:
            mtime = None
        if mtime == self._control_mtime:
            return
        self._control_mtime = mtime
        try:
            override = json.loads(Path(self._control).read_text()) if mtime is not None else {}
            faults = dataclasses.replace(self._base, **override)
        except (OSError, ValueError, TypeError) as e:  # TypeError: an unknown field
            log.warning("fault control file %s not applied: %s", self._control, e)
            return
        self.set_faults(faults)

    def _wire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` have crossed the emulated link (after whatever crosses it already)."""
        gbps = self.faults.link_gbps
        if gbps <= 0 or nbytes <= 0:
            return
        with self._lock:
            start = max(time.monotonic(), self._wire_free)
            self._wire_free = done = start + nbytes * 8 / (gbps * 1e9)
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _before(self, keys: Sequence[bytes]) -> None:
        if self._control:
            self._reload_control()
        f = self.faults
        if f.latency_s or f.jitter_s:
            with self._lock:
                extra = self._rng.uniform(0.0, f.jitter_s) if f.jitter_s else 0.0
            time.sleep(f.latency_s + extra)
        if f.down:
            self._count("down")
            raise StoreUnavailable("injected outage")
        if self._chance(f.error_rate):
            self._count(f"error_{f.error_kind}")
            if f.error_kind == "timeout":
                raise StoreTimeout("injected timeout")
            raise StoreUnavailable("injected error")
        if f.unavailable_fraction and any(self.key_unavailable(k) for k in keys):
            self._count("partial_outage")
            raise StoreUnavailable("injected partial outage")

    def key_unavailable(self, key: bytes) -> bool:
        return int.from_bytes(key[:8], "little") / 2.0**64 < self.faults.unavailable_fraction

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        self._before(keys)
        return self.inner.count_prefix(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._before(keys)
        values = self.inner.get_many(keys)
        out: list[bytes | None] = []
        for v in values:
            if v is not None and self._chance(self.faults.drop_rate):
                self._count("drop_get")
                v = None
            elif v and self._chance(self.faults.corrupt_rate):
                with self._lock:
                    i = self._rng.randrange(len(v))
                buf = bytearray(v)
                buf[i] ^= 0xFF
                self._count("corrupt")
                v = bytes(buf)
            out.append(v)
        self._wire(sum(len(v) for v in out if v))
        return out

    def _stream_get(self, key: bytes, piece_bytes: int) -> Iterator[bytes]:
        self._before([key])
        if self._chance(self.faults.drop_rate):
            self._count("drop_get")
            return
        flip = self._chance(self.faults.corrupt_rate)
        for i, piece in enumerate(self.inner.stream_get(key, piece_bytes)):
            if i and self.faults.piece_latency_s:
                time.sleep(self.faults.piece_latency_s)
            self._wire(len(piece))
            if flip:
                flip, buf = False, bytearray(piece)
                buf[len(buf) // 2] ^= 0xFF
                self._count("corrupt")
                piece = bytes(buf)
            yield piece

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self._before([k for k, _ in items])
        kept = [(k, v) for k, v in items if not self._chance(self.faults.drop_rate)]
        if len(kept) < len(items):
            self._count("drop_put", len(items) - len(kept))
        if kept:
            self.inner.put_many(kept)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        self._before(keys)
        self.inner.delete_many(keys)

    def scan(self, batch: int = 512):
        return self.inner.scan(batch)

    def stats(self) -> StoreStats:
        """The inner store's stats; ``extra`` adds ``injected_<kind>`` counts of injected faults."""
        inner = self.inner.stats()
        with self._lock:
            injected = {f"injected_{k}": float(v) for k, v in self._injected.items()}
        return dataclasses.replace(
            inner, backend=f"faulty+{inner.backend}", extra={**inner.extra, **injected}
        )

    def close(self) -> None:
        self.inner.close()


def open_faulty(url: str) -> FaultyStore:
    """Factory for ``faulty+<inner url>``."""
    inner_url = url.split("+", 1)[1]
    parts = urlsplit(inner_url) if "://" in inner_url else None
    query = parts.query if parts else (inner_url.split("?", 1)[1] if "?" in inner_url else "")
    fields = {f.name: f.type for f in dataclasses.fields(FaultConfig)}
    fault_kw: dict[str, object] = {}
    rest = []
    control = None
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k == "control":
            control = v
        elif k not in fields:
            rest.append((k, v))
        elif k == "error_kind":
            fault_kw[k] = v
        elif k == "down":
            fault_kw[k] = v.lower() in ("1", "true", "yes")
        elif k == "seed":
            fault_kw[k] = int(v)
        else:
            try:
                fault_kw[k] = float(v)
            except ValueError:
                raise ValueError(f"store URL {redact_url(url)!r}: bad value for {k}: {v!r}") from None
    if parts:
        inner_url = urlunsplit(parts._replace(query=urlencode(rest)))
    else:
        inner_url = inner_url.split("?", 1)[0] + (f"?{urlencode(rest)}" if rest else "")
    return FaultyStore(open_store(inner_url), FaultConfig(**fault_kw), control=control)  # type: ignore[arg-type]
