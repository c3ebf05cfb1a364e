"""The store generation of this server's model, read at start and followed while serving.

A ``--remote-kv-flush tier`` flush on *any* server sharing the store writes a new random generation under
``keys.generation_key(fingerprint)``; every key namespace folds it in (``runtime.KeySpace``), so chunks
stored before it become unreachable. ``read`` gives the generation at start; ``GenerationWatch`` keeps a
running server in step: every ``interval_s`` of scheduler activity it asks the store on a worker thread,
and the scheduler thread applies a changed answer to the key space. Until then the server keeps using the
retired generation: its chunks are still exact KV of their prefixes, so that window costs freshness, never
correctness. With TP the ranks may switch one scheduling pass apart: their lookups then disagree and the
agreement turns the request into a (shorter) miss.

A store that does not answer leaves the generation as it is (an error is not "never flushed").

Threads: ``poll`` on the scheduler thread only; one read at a time on the watch's own worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable

from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.types import ModelFingerprint

logger = logging.getLogger(__name__)

POLL_S = 10.0  # how often a serving scheduler re-reads the store generation


def read(client, fingerprint: ModelFingerprint) -> bytes | None:
    """The store's generation of ``fingerprint``: ``b""`` when none was ever written (generation 0),
    None when the store did not answer (``client``: a ``StoreClient``; never raises)."""
    key = keys_mod.generation_key(fingerprint)
    found = client.lookup_prefix([key])
    if found.error is not None:
        return None
    if not found.found:
        return b""
    return client.get_many([key])[0]  # None: it went away or failed in between


class GenerationWatch:
    """Follows the store generation into ``keys`` (a ``runtime.KeySpace``); see module docstring."""

    def __init__(
        self,
        client,
        fingerprint: ModelFingerprint,
        keys,
        interval_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.fingerprint, self.keys = client, fingerprint, keys
        self.interval_s, self.clock = interval_s, clock
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="srkv-generation")
        self._pending: cf.Future | None = None
        self._last = clock()

    def poll(self) -> None:
        """Apply a finished read if it changed the generation; start the next read when one is due."""
        if self._pending is not None and self._pending.done():
            seen = self._pending.result()  # ``read`` never raises
            self._pending = None
            if seen is not None and seen != self.keys.generation:
                logger.info(
                    "remote tier: store generation changed (%s -> %s): chunks stored before are retired",
                    self.keys.generation.hex()[:8] or "0",
                    seen.hex()[:8] or "0",
                )
                self.keys.set_generation(seen)
        now = self.clock()
        if self._pending is None and now - self._last >= self.interval_s:
            self._last = now
            self._pending = self._pool.submit(read, self.client, self.fingerprint)

    def forget_pending(self) -> None:
        """This server just wrote the generation itself (a tier flush): a read started before that would
        bring the old one back."""
        self._pending = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
