"""Circuit breaker of the store client (``client.StoreClient`` keeps one for reads, one for writes).

closed -> (``failures`` consecutive failed calls) -> open: every call fails fast -> (``reset_s``) ->
half_open: one probe call is let through; its success closes the breaker, its failure re-opens it.

Threading: any thread may call any method (one lock). State changes are logged once each (INFO on
close, WARNING on open), never per call.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

_RANK = {"closed": 0, "half_open": 1, "open": 2}


def worst(*states: str) -> str:
    """The least healthy of several breaker states (``open`` > ``half_open`` > ``closed``)."""
    return max(states, key=lambda s: _RANK.get(s, 0), default="closed")


class CircuitBreaker:
    """See module docstring. ``name`` tags the log lines (e.g. ``store read``)."""

    def __init__(self, failures: int, reset_s: float, name: str = "store") -> None:
        self._threshold = max(1, failures)
        self._reset_s = reset_s
        self._name = name
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
                log.info("%s circuit breaker closed (store recovered)", self._name)
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
                    log.warning("%s circuit breaker open after %d failures", self._name, self._failures)
                self.state, self._opened_at = "open", time.monotonic()
