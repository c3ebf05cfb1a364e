"""The store client's short negative cache: keys found absent in the last ``ttl_s`` seconds.

``client.StoreClient`` answers such keys as misses without asking the store, and clears a key when it
writes it (``put_many``). At most ``max_keys`` keys are held (the oldest dropped first); ``ttl_s <= 0``
holds none. Expired entries are dropped when looked at.

Threading: any thread may call any method (one lock).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence


class NegativeCache:
    """Recently absent keys (see module docstring)."""

    def __init__(self, ttl_s: float, max_keys: int) -> None:
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self._exp: OrderedDict[bytes, float] = OrderedDict()  # key -> monotonic expiry
        self._lock = threading.Lock()

    def _hit(self, key: bytes, now: float) -> bool:  # holding the lock
        exp = self._exp.get(key)
        if exp is None:
            return False
        if exp < now:
            del self._exp[key]
            return False
        return True

    def hit(self, key: bytes) -> bool:
        """``key`` was recently found absent."""
        with self._lock:
            return self._hit(key, time.monotonic())

    def first_hit(self, keys: Sequence[bytes]) -> int:
        """Index of the first recently absent key of ``keys`` (``len(keys)`` if none): a prefix query
        need not ask past it."""
        now = time.monotonic()
        with self._lock:
            return next((i for i, k in enumerate(keys) if self._hit(k, now)), len(keys))

    def unknown(self, keys: Sequence[bytes]) -> list[int]:
        """Indices of the keys of ``keys`` that were not recently found absent (the store must be asked)."""
        now = time.monotonic()
        with self._lock:
            return [i for i, k in enumerate(keys) if not self._hit(k, now)]

    def add(self, keys: Sequence[bytes]) -> None:
        """Remember ``keys`` as absent for ``ttl_s``."""
        if self.ttl_s <= 0:
            return
        exp = time.monotonic() + self.ttl_s
        with self._lock:
            for k in keys:
                self._exp[k] = exp
                self._exp.move_to_end(k)
            while len(self._exp) > self.max_keys:
                self._exp.popitem(last=False)

    def clear(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` (they were just written)."""
        with self._lock:
            for k in keys:
                self._exp.pop(k, None)
