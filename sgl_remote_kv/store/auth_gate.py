"""What the store client does after the store refused its credentials (``guard.CallGuard`` keeps one).

Refused credentials (kind ``auth``: a wrong or missing password, an ACL user without permission) are a
configuration error, not an outage: never retried, never counted against a breaker (the guard's business).
The first refusal is logged once at ERROR (one line per process: the serving process's client asks the
store at start, ``generation.read``, so the refusal shows then; the launcher's start-up probe leaves the
report to it, ``preflight._probe``); its text says "configuration ERROR", so ``grep ERROR`` finds it also
in SGLang's log format, which prints no level. Then every call fails fast as ``auth`` without asking
the store (``allows()`` is false), except one probe call every ``retry_s``, so a password fixed on the
server's side heals without a restart (``accepted()`` logs it at INFO).

Threading: any thread may call any method (one lock).
"""

from __future__ import annotations

import logging
import threading
import time

from .base import Counters

log = logging.getLogger(__name__)

AUTH = "auth"  # base.StoreAuthError.kind


class AuthGate:
    """Fail-fast window after refused credentials (see module docstring); ``name`` tags the log lines."""

    def __init__(self, retry_s: float, name: str, counters: Counters) -> None:
        self.retry_s, self._name, self._counters = retry_s, name, counters
        self._lock = threading.Lock()
        self._until = 0.0  # monotonic time before which calls fail fast as ``auth`` (0: not refused)
        self._refused = False  # the last call that reached the store was refused authentication

    def allows(self) -> bool:
        """False while the store's refusal of our credentials is recent; after ``retry_s`` one caller
        (the probe) is let through and the window restarts."""
        with self._lock:
            if not self._until:
                return True
            now = time.monotonic()
            if now < self._until:
                return False
            self._until = now + self.retry_s  # this caller probes; the others wait
            return True

    def refused(self, exc: object) -> None:
        """A call reached the store and was refused authentication: count it, open the window."""
        self._counters.error(AUTH)
        with self._lock:
            first = not self._refused
            self._refused = True
            self._until = time.monotonic() + self.retry_s
        if first:
            log.error(
                "store %s refused authentication (%s): a configuration ERROR, not an outage, so it is not "
                "retried: every store call now fails at once (a miss or a dropped write, counted as "
                'store_errors_total{kind="auth"}) except one probe every %.0f s. Check the password '
                "(--remote-kv-store-password-file, SRKV_STORE_PASSWORD or the URL) and the ACL user.",
                self._name,
                exc,
                self.retry_s,
            )
        else:
            log.debug("store %s still refuses authentication: %s", self._name, exc)

    def accepted(self) -> None:
        """A call reached the store and succeeded: close the window."""
        if not self._refused:
            return
        with self._lock:
            was, self._refused, self._until = self._refused, False, 0.0
        if was:
            log.info("store %s accepts our credentials again", self._name)
