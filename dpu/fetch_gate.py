"""How many fetch workers may be in the store at once, chosen from what the link gives.

Two fetches on a bandwidth-bound link share it: both chunks land at the end and both decodes follow the
last byte, while one at a time lets the first chunk decode as the second arrives. On a latency-bound
store (small chunks, slow round trips) concurrency is what keeps the link busy. ``FetchGate`` measures
which case holds and admits either one fetch or all ``workers``:

* every fetch that returned bytes is a sample of the *aggregate* rate: its bytes / its duration x the
  mean number of fetches in flight during it (fetches in flight share the link alike);
* one EWMA of that rate for fetches that ran alone (mean in flight <= 1.25) and one for fetches that
  shared (>= 1.75);
* the limit is ``workers`` unless both exist and sharing gives less than ``gain`` x the rate alone
  (concurrency buys nothing: a bandwidth-bound link), then 1;
* exploration: the first ``probe_len`` fetches run with ``workers``, the next ``probe_len`` alone, and
  after that every ``probe_every``-th admission starts ``probe_len`` fetches under the other limit, so a
  change of link (or of load) is seen.

``adaptive=False`` always admits ``workers`` (``--fetch-concurrency fixed``).

Admission is first come, first served (a ticket per ``slot`` call): a worker that finished a fetch and
takes the next chunk never overtakes one already waiting, so chunks enter the store in the fetch queue's
order (a layer-wise consumer needs the lower chunks first; a pool write of layer l needs every chunk).

Threads: called by the fetch workers (``slot``) and any thread (``snapshot``); one condition variable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ALONE, SHARED = 1.25, 1.75  # mean fetches in flight of a sample that ran alone / shared


@dataclass
class Fetch:
    """What one admitted fetch got: the worker sets ``nbytes`` (0: a miss or a failure, no sample)."""

    nbytes: int = 0


class FetchGate:
    def __init__(
        self,
        workers: int,
        adaptive: bool = True,
        gain: float = 1.2,
        alpha: float = 0.25,
        probe_every: int = 24,
        probe_len: int = 4,
    ) -> None:
        if workers < 1 or probe_len < 1 or probe_every <= probe_len or not 0 < alpha <= 1:
            raise ValueError("bad fetch gate parameters")
        self.workers, self.adaptive = workers, adaptive and workers > 1
        self.gain, self.alpha, self.probe_every, self.probe_len = gain, alpha, probe_every, probe_len
        self.limit = workers  # the chosen limit (probes aside)
        self.rate: dict[str, float | None] = {"alone": None, "shared": None}  # aggregate bytes/s, EWMA
        self._cv = threading.Condition()
        self._in_flight = 0
        self._area = 0.0  # integral of fetches in flight over time
        self._t = time.perf_counter()
        self._admitted = 0
        self._probe_left = 0
        self._probe_limit = workers
        self._tickets = 0  # slot() calls so far
        self._serving = 0  # the ticket admitted next

    def _limit_now(self) -> int:
        return self._probe_limit if self._probe_left > 0 else self.limit

    def _tick(self, now: float) -> None:
        self._area += self._in_flight * (now - self._t)
        self._t = now

    def _admit(self) -> None:
        self._admitted += 1
        if self._probe_left > 0:
            self._probe_left -= 1
            return
        n = self._admitted
        if n == self.probe_len + 1:  # the initial exploration: alone right after the first fetches
            self._probe_limit, self._probe_left = 1, self.probe_len - 1
        elif n > 2 * self.probe_len and n % self.probe_every == 0:
            self._probe_limit = 1 if self.limit == self.workers else self.workers
            self._probe_left = self.probe_len - 1

    @contextmanager
    def slot(self) -> Iterator[Fetch]:
        """Hold one of the admitted places for one store fetch (blocks while the limit is reached)."""
        if not self.adaptive:
            yield Fetch()
            return
        with self._cv:
            ticket = self._tickets
            self._tickets += 1
            while ticket != self._serving or self._in_flight >= self._limit_now():
                self._cv.wait()
            self._serving += 1
            self._cv.notify_all()  # the next ticket may fit too
            self._admit()
            start = time.perf_counter()
            self._tick(start)
            self._in_flight += 1
            area0 = self._area
        rec = Fetch()
        try:
            yield rec
        finally:
            with self._cv:
                now = time.perf_counter()
                self._tick(now)
                self._in_flight -= 1
                if rec.nbytes > 0 and now > start:
                    self._sample((self._area - area0) / (now - start), rec.nbytes / (now - start))
                self._cv.notify_all()

    def _sample(self, mean_in_flight: float, rate: float) -> None:
        kind = "alone" if mean_in_flight <= ALONE else "shared" if mean_in_flight >= SHARED else None
        if kind is None:
            return
        agg, old = rate * mean_in_flight, self.rate[kind]
        self.rate[kind] = agg if old is None else old + self.alpha * (agg - old)
        alone, shared = self.rate["alone"], self.rate["shared"]
        if alone is not None and shared is not None:
            self.limit = self.workers if shared >= self.gain * alone else 1

    def snapshot(self) -> dict:
        with self._cv:
            return {
                "limit": self.limit,  # the chosen one, probes aside (``workers`` when not adaptive)
                "probing": self._probe_left > 0,
                "alone_mb_s": round((self.rate["alone"] or 0) / 1e6, 2),
                "shared_mb_s": round((self.rate["shared"] or 0) / 1e6, 2),
            }
