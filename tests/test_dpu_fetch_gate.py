"""``dpu.fetch_gate.FetchGate``: one fetch at a time on a bandwidth-bound link, all workers on a
latency-bound store, decided from what the fetches measured. The link here is an emulation (fair
sharing of a fixed rate, a fixed round trip per fetch); the real shaped link is ``bench_dpu_floor``'s."""

from __future__ import annotations

import threading
import time

import pytest
from sgl_remote_kv.dpu.fetch_gate import FetchGate


class Link:
    """``rate`` bytes/s shared fairly by the transfers in progress, after ``rtt`` seconds each."""

    def __init__(self, rate: float, rtt: float) -> None:
        self.rate, self.rtt = rate, rtt
        self._lock = threading.Lock()
        self._active = 0

    def transfer(self, nbytes: int) -> None:
        time.sleep(self.rtt)
        with self._lock:
            self._active += 1
        left = float(nbytes)
        try:
            while left > 0:
                dt = 0.002
                time.sleep(dt)
                with self._lock:
                    left -= self.rate * dt / self._active
        finally:
            with self._lock:
                self._active -= 1


def _run(
    gate: FetchGate, link: Link, nbytes: int, fetches: int, workers: int = 2
) -> list[tuple[float, float]]:
    """``fetches`` fetches through ``workers`` threads; returns each one's (start, end) inside the gate."""
    todo = list(range(fetches))
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            with gate.slot() as admitted:
                t0 = time.perf_counter()
                link.transfer(nbytes)
                admitted.nbytes = nbytes
                t1 = time.perf_counter()
            with lock:
                spans.append((t0, t1))

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return spans


def _overlapping(spans: list[tuple[float, float]]) -> int:
    spans = sorted(spans)
    return sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1] - 0.001)


def test_a_bandwidth_bound_link_gets_one_fetch_at_a_time():
    gate = FetchGate(2, probe_every=40, probe_len=4)
    _run(gate, Link(rate=50e6, rtt=0.0005), 1_000_000, fetches=12)  # 20 ms per chunk alone
    assert gate.limit == 1 and gate.snapshot()["limit"] == 1, gate.snapshot()
    alone, shared = gate.rate["alone"], gate.rate["shared"]
    assert shared < 1.2 * alone  # sharing the link added nothing
    spans = _run(gate, Link(rate=50e6, rtt=0.0005), 1_000_000, fetches=10)  # admissions 13..22: no probe
    assert _overlapping(spans) == 0


def test_a_latency_bound_store_keeps_every_worker():
    gate = FetchGate(2, probe_every=40, probe_len=4)
    _run(gate, Link(rate=500e6, rtt=0.02), 10_000, fetches=12)  # 20 ms round trip, tiny values
    assert gate.limit == 2, gate.snapshot()
    assert gate.rate["shared"] > 1.5 * gate.rate["alone"]
    spans = _run(gate, Link(rate=500e6, rtt=0.02), 10_000, fetches=10)
    assert _overlapping(spans) >= 5


def test_probes_follow_a_change_of_the_link():
    gate = FetchGate(2, probe_every=8, probe_len=3)
    _run(gate, Link(rate=500e6, rtt=0.02), 10_000, fetches=10)
    assert gate.limit == 2
    _run(gate, Link(rate=50e6, rtt=0.0005), 1_000_000, fetches=45)  # the same gate, now bandwidth-bound
    assert gate.limit == 1, gate.snapshot()


def test_fixed_concurrency_admits_every_worker_and_misses_are_no_samples():
    gate = FetchGate(2, adaptive=False)
    spans = _run(gate, Link(rate=50e6, rtt=0.0005), 1_000_000, fetches=8)
    assert _overlapping(spans) >= 3 and gate.snapshot()["limit"] == 2
    adaptive = FetchGate(2)
    with adaptive.slot():  # nbytes left 0: a miss
        pass
    assert adaptive.rate == {"alone": None, "shared": None}
    with pytest.raises(ValueError):
        FetchGate(0)


def test_admission_is_first_come_first_served():
    """A worker that comes back for the next fetch never overtakes one already waiting at the gate."""
    gate = FetchGate(2, probe_len=1, probe_every=1000)
    gate.limit = 1  # as chosen on a bandwidth-bound link (no fetch here reports bytes: no sample moves it)
    order: list[str] = []
    first = gate.slot()
    first.__enter__()
    waiting = threading.Thread(target=lambda: _enter(gate, "waiting", order))
    waiting.start()
    time.sleep(0.05)  # "waiting" now blocks at the gate
    # the first holder leaves and comes straight back, as a fetch worker taking its next chunk does
    first.__exit__(None, None, None)
    _enter(gate, "returning", order)
    waiting.join(5)
    assert order == ["waiting", "returning"]


def _enter(gate: FetchGate, name: str, order: list[str]) -> None:
    with gate.slot():
        order.append(name)
        time.sleep(0.01)
