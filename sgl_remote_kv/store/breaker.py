"""Circuit breaker of the store client (``guard.CallGuard`` keeps one for reads, one for writes).

closed -> (``failures`` consecutive failed calls) -> open: every call fails fast -> (``reset_s``) ->
half_open: one probe call is let through; its success closes the breaker, its failure re-opens it.

Threading: any thread may call any method (one lock). State changes are logged once each (INFO on
close, WARNING on open), never per call, and reported to ``on_change(state)`` (outside the lock; the
metrics' breaker gauge).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_RANK = {"closed": 0, "half_open": 1, "open": 2}  # also the breaker gauge's values


def rank(state: str) -> int:
    return _RANK.get(state, 0)


def worst(*states: str) -> str:
    """The least healthy of several breaker states (``open`` > ``half_open`` > ``closed``)."""
    return max(states, key=lambda s: _RANK.get(s, 0), default="closed")


class CircuitBreaker:
    """See module docstring. ``name`` tags the log lines (e.g. ``store read``)."""

    def __init__(
        self,
        failures: int,
        reset_s: float,
        name: str = "store",
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._threshold = max(1, failures)
        self._reset_s = reset_s
        self._name = name
        self._lock = threading.Lock()
        self.state = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self.on_change = on_change

    def _changed(self, before: str) -> None:
        """Report a state change (called without the lock held)."""
        state = self.state
        if state != before and self.on_change is not None:
            self.on_change(state)

    def allow(self) -> bool:
        with self._lock:
            before = self.state
            if self.state == "closed":
                return True
            ok = self.state == "open" and time.monotonic() - self._opened_at >= self._reset_s
            if ok:
                self.state = "half_open"  # this caller is the probe
        self._changed(before)
        return ok

    def success(self) -> None:
        with self._lock:
            before = self.state
            if self.state != "closed":
                log.info("%s circuit breaker closed (store recovered)", self._name)
            self.state, self._failures = "closed", 0
        self._changed(before)

    def neutral(self) -> None:
        """The call said nothing about store health; a half-open probe slot is handed back."""
        with self._lock:
            before = self.state
            if self.state == "half_open":
                self.state = "open"  # opened_at is old, so the next call probes again
        self._changed(before)

    def failure(self) -> None:
        with self._lock:
            before = self.state
            self._failures += 1
            if self.state == "half_open" or (self.state == "closed" and self._failures >= self._threshold):
                if self.state == "closed":
                    log.warning("%s circuit breaker open after %d failures", self._name, self._failures)
                self.state, self._opened_at = "open", time.monotonic()
        self._changed(before)
