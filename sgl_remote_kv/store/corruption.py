"""The log of corrupt store values: at most one line per ``interval_s`` per process, naming the key.

A corrupt value is always a miss (recomputed) and is counted once, as
``store_errors_total{op="get",kind="corrupt"}``, where it is detected:

- the store framing (length, CRC over key and payload) and the MAC (``security.AuthenticatedStore``) in
  ``client.StoreClient`` (whole and streamed gets): counted through the client's error listener;
- the codec's header and section CRCs (``codec.errors.CORRUPTION``) in the serving process's fetch backends
  (``StoreClient.report_corrupt``) and in the DPU data plane, which reports the chunk back as
  ``ChunkFailed(kind="corrupt", store_error="corrupt")``: the host counts that.

Each of those places calls ``note`` (the data plane in its own process, the host once more for what the
data plane reported, so both logs say it). A line names the chunk key's first 12 hex digits (Redis key
``srkv:<hex>``, embedded store file ``<hex>``; enough to find it, ``short_key``), where it was found and
why, and how many more corrupt values were seen since the previous line; the rest of an interval's
values are only counted. Threads: any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 30.0  # at most one line per this many seconds per process
KEY_HEX = 12  # hex digits of a chunk key in a log line


def short_key(key: bytes) -> str:
    """A chunk key as it may appear in a log line: its first ``KEY_HEX`` hex digits and an ellipsis."""
    return bytes(key).hex()[:KEY_HEX] + "..."


class CorruptionLog:
    """See module docstring. ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._suppressed = 0
        self.total = 0  # corrupt values noted by this process

    def note(self, key: str, where: str, why: str) -> bool:
        """One corrupt value (``key``: ``short_key``, or what the data plane said). True if it was logged."""
        now = self._clock()
        with self._lock:
            self.total += 1
            if self._last is not None and now - self._last < self.interval_s:
                self._suppressed += 1
                return False
            self._last, suppressed, self._suppressed = now, self._suppressed, 0
        more = f"; {suppressed} more corrupt value(s) since the last such line" if suppressed else ""
        log.warning(
            "remote KV: corrupt value for chunk key %s (%s: %s): a miss, recomputed%s", key, where, why, more
        )
        return True


LOG = CorruptionLog()
_DETAIL = "chunk key "


def detail(key: bytes, why: str) -> str:
    """How the data plane words a corrupt chunk in ``ChunkFailed.detail`` (``split_detail`` reads it back)."""
    return f"{_DETAIL}{short_key(key)}: {why}"


def split_detail(text: str) -> tuple[str, str]:
    """(key, why) of a ``detail`` text; ("?", text) for any other text."""
    if text.startswith(_DETAIL) and ": " in text:
        key, why = text[len(_DETAIL) :].split(": ", 1)
        return key, why
    return "?", text


def note(key: bytes | str, where: str, why: str) -> bool:
    """``LOG.note`` with a key given as bytes (shortened here) or already as text."""
    return LOG.note(key if isinstance(key, str) else short_key(key), where, why)
