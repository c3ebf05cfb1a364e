"""The admission state machine (``sgl_remote_kv.admission``) without SGLang: a small tree/allocator,
a host queue and fetch backends whose handles finish when the test says so, a real store lookup path
(``KeySpace`` keys), the real policy and metrics, and a fake clock.

What must hold: a remote hit is installed and released with its rows owned by the tree (the double of
the server's staging); a fetch reserves its rows before it starts and backs off (never fails) while the
tree cannot give them; only the oldest waiting request reserves (FIFO); no request waits for rows longer
than ``slot_wait_s``; a burst larger than the rows ends with every request released and every row back.
"""

from __future__ import annotations

import pytest

from sgl_remote_kv.admission import AdmissionSettings, Phase
from sgl_remote_kv.admission import queue as queue_mod
from sgl_remote_kv.policy.estimator import Decision
from tests.admission_fakes import MB, C, Clock, make_queue, req


@pytest.fixture()
def world(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(queue_mod, "time", clock)

    def make(**kw):
        w = make_queue(**kw)
        w.clock = clock
        return w

    return make


def _park(w, r) -> None:
    assert w.q.park(r)
    w.q.parked[r.rid].lookup.result(timeout=10)  # the store count ran on its worker


def _failures(w, kind: str) -> float:
    return w.c.metrics.snapshot().get(f"failures|kind={kind}", 0)


def test_remote_hit_is_reserved_fetched_installed_and_released(world):
    w = world()
    r = req("a", 5 * C + 3)
    w.stored(r, 5)
    _park(w, r)
    w.q.poll()  # lookup hit -> RESERVE -> rows reserved -> FETCH in the same pass
    p = w.q.parked["a"]
    assert p.phase is Phase.FETCH and len(p.rows) == 5 * C and w.tree.cap - len(w.tree.free_slots) == 5 * C
    assert w.q.held_rows() == 5 * C
    w.be.finish("a")
    w.q.poll()
    assert w.host.released == ["a"] and w.host.hits["a"] == (0, 5 * C)
    assert sorted(w.tree.owned) == sorted(w.be.handles["a"].rows.tolist())  # tree-owned, none leaked
    assert len(w.q.held) == 1 and w.tree.locks == 1  # the new node is locked until admission
    w.host.waiting_reqs.clear()  # the engine admitted it
    w.q.poll()
    assert not w.q.held and w.tree.locks == 0 and not w.q.busy()


def test_local_prefix_and_short_prompts_are_not_parked(world):
    w = world()
    assert not w.q.park(req("short", C))  # no full chunk before the last prompt token
    r = req("cached", 3 * C + 1)
    w.tree.local["cached"] = 3 * C
    assert not w.q.park(r)  # everything usable is local


def test_partial_fetch_installs_the_leading_chunks_and_frees_the_rest(world):
    w = world()
    r = req("a", 4 * C + 1)
    w.stored(r, 4)
    _park(w, r)
    w.q.poll()
    w.be.finish("a", ok_chunks=2)
    w.q.poll()
    assert w.host.hits["a"] == (0, 2 * C) and len(w.tree.owned) == 2 * C
    assert len(w.tree.free_slots) == w.tree.cap - 2 * C  # the unused half went back
    assert _failures(w, "store_miss") >= 1


def test_no_slots_backs_off_then_fetches_when_slots_return(world):
    w = world(capacity=8 * C, fraction=1.0)
    hog = w.tree.alloc(6 * C)  # the engine's running requests hold most of the pool
    r = req("a", 4 * C + 1)
    w.stored(r, 4)
    before = _failures(w, "no_staging_rows")
    _park(w, r)
    for _ in range(3):
        w.clock.t += 1.0
        w.q.poll()
    assert w.q.parked["a"].phase is Phase.RESERVE and not w.host.released  # waiting, not failed
    w.tree.free(hog)
    w.clock.t += 1.0
    w.q.poll()
    assert w.q.parked["a"].phase is Phase.FETCH
    assert w.c.metrics.snapshot()["slot_waits"] >= 1 and _failures(w, "no_staging_rows") == before
    w.be.finish("a")
    w.q.poll()
    assert w.host.hits["a"] == (0, 4 * C)


def test_fifo_the_oldest_reserves_first_and_no_wait_exceeds_the_bound(world):
    w = world(capacity=8 * C, fraction=1.0, slot_wait_s=5.0)
    hog = w.tree.alloc(5 * C)
    big, small = req("big", 6 * C + 1, base=0), req("small", 2 * C + 1, base=10_000)
    w.stored(big, 6)
    w.stored(small, 2)
    _park(w, big)
    _park(w, small)
    w.q.poll()
    # 3 * C slots are free: enough for "small", not for "big"; "small" must not overtake "big"
    assert w.q.parked["big"].phase is Phase.RESERVE and w.q.parked["small"].phase is Phase.RESERVE
    assert len(w.tree.free_slots) == 3 * C
    w.clock.t += 4.0
    w.q.poll()
    assert set(w.q.parked) == {"big", "small"} and not w.host.released
    before = _failures(w, "no_staging_rows")
    w.clock.t += 1.5  # past slot_wait_s for both: both recompute (the bound holds for every waiter)
    w.q.poll()
    assert w.host.released == ["big", "small"] and _failures(w, "no_staging_rows") - before == 2
    w.tree.free(hog)
    assert len(w.tree.free_slots) == w.tree.cap and w.tree.locks == 0


def test_a_head_that_gets_its_slots_lets_the_next_one_try_in_the_same_pass(world):
    w = world(capacity=16 * C, fraction=1.0)
    a, b = req("a", 3 * C + 1, base=0), req("b", 3 * C + 1, base=10_000)
    w.stored(a, 3)
    w.stored(b, 3)
    _park(w, a)
    _park(w, b)
    w.q.poll()
    assert w.q.parked["a"].phase is Phase.FETCH and w.q.parked["b"].phase is Phase.FETCH


def test_fetch_larger_than_the_queue_share_is_trimmed_to_its_leading_chunks(world):
    w = world(capacity=8 * C, fraction=0.5)  # the queue may hold 4 chunks' worth of slots
    r = req("a", 10 * C + 1)
    w.stored(r, 10)
    _park(w, r)
    w.q.poll()
    p = w.q.parked["a"]
    assert p.phase is Phase.FETCH and p.fetch_tokens == [C] * 4 and len(p.rows) == 4 * C
    w.be.finish("a")
    w.q.poll()
    assert w.host.hits["a"] == (0, 4 * C)  # the other 6 chunks are recomputed


def test_burst_larger_than_the_pool_every_request_ends_and_every_slot_returns(world):
    """40 remote hits of 4 chunks (160 chunks) against a pool of 24 chunks, the queue allowed half:
    fetches start as slots free up, FIFO; the engine admits released requests at once and finishes them
    after a while; no request waits for slots past the bound; at the end every slot is back."""
    w = world(capacity=24 * C, fraction=0.5, slot_wait_s=5.0)
    reqs = [req(f"r{i:02d}", 4 * C + 1, base=1000 * i) for i in range(40)]
    for r in reqs:
        w.stored(r, 4)
        _park(w, r)
    started: dict[str, float] = {}
    reserving: dict[str, float] = {}  # rid -> when it was first seen waiting for slots
    waits: list[float] = []
    for _ in range(400):
        w.q.poll()
        for rid, t0 in list(reserving.items()):
            p = w.q.parked.get(rid)
            if p is None or p.phase is not Phase.RESERVE:
                waits.append(w.clock.t - t0)
                del reserving[rid]
        for rid, p in w.q.parked.items():
            if p.phase is Phase.RESERVE:
                reserving.setdefault(rid, p.since)
            if p.phase is Phase.FETCH and rid not in started:
                started[rid] = w.clock.t
        for rid, h in list(w.be.handles.items()):  # fetches take 0.3 s
            if not h.done() and w.clock.t - started.get(rid, w.clock.t) >= 0.3:
                w.be.finish(rid)
        w.host.waiting_reqs.clear()  # the engine admits what was released ...
        if len(w.tree.owned) > 8 * C:
            w.tree.give_back()  # ... and its finished requests' KV gets evicted
        w.clock.t += 0.1
        if not w.q.busy():
            break
    assert not w.q.busy() and sorted(w.host.released) == sorted(r.rid for r in reqs)
    hits = len(w.host.hits)
    assert hits >= 20, hits  # most of the burst was served from the store despite the small pool
    assert _failures(w, "no_staging_rows") + hits >= 40  # the rest recomputed after a bounded wait
    assert waits and max(waits) <= 5.0 + 0.1 + 1e-9, max(waits)  # slot_wait_s, observed at 0.1 s ticks
    w.q.poll()
    w.tree.give_back()
    assert len(w.tree.free_slots) == w.tree.cap and w.tree.locks == 0 and not w.q.held


def test_a_losing_fetch_is_abandoned_and_recomputed(world):
    w = world()
    pol = w.c.policy
    for n in (250, 500, 1000):
        pol.observe_prefill(n, n / 250.0)
    r = req("r1", 4 * C + 1)
    w.stored(r, 4)
    _park(w, r)
    w.q.poll()
    p = w.q.parked["r1"]
    assert p.phase is Phase.FETCH
    p.decision = Decision("dpu", 0.5, 8.0, 0.1)
    pol.fetch_ended("r1")
    pol.fetch_started("r1", p.decision, 10 * MB, now=w.clock.t)
    before = _failures(w, "abandoned")
    w.clock.t += 11.0
    w.q.poll()
    assert "r1" in w.q.parked and not w.host.released  # 11 s < 1.5 x 8 s
    w.clock.t += 1.5
    w.q.poll()
    assert w.host.released == ["r1"] and w.be.handles["r1"].cancelled
    assert _failures(w, "abandoned") - before == 1
    assert w.q.zombies and w.q.zombies[0].phase is Phase.ZOMBIE  # slots wait for the backend to stop
    w.be.finish("r1")
    w.q.poll()
    assert not w.q.zombies and len(w.tree.free_slots) == w.tree.cap and w.tree.locks == 0


def test_in_flight_dedup_follows_then_reparks_as_a_local_hit(world):
    w = world()
    lead, same = req("lead", 4 * C + 1), req("same", 4 * C + 1)
    w.stored(lead, 4)
    _park(w, lead)
    _park(w, same)
    w.q.poll()
    assert w.q.parked["same"].phase is Phase.FOLLOW and w.q.parked["same"].leader == "lead"
    w.q.poll()
    assert "same" in w.q.parked  # the leader is still fetching
    w.be.finish("lead")
    w.tree.local["same"] = 4 * C  # the leader's install is the follower's local prefix too
    w.q.poll()  # the leader installs; the follower re-parks at the next pass
    w.q.poll()
    assert w.host.released == ["lead", "same"] and "same" not in w.be.handles


def test_abort_hands_the_request_to_the_engine_and_frees_its_slots_once_the_backend_stops(world):
    w = world()
    r = req("x", 3 * C + 1)
    w.stored(r, 3)
    _park(w, r)
    w.q.poll()
    w.q.abort("x", abort_all=False)
    assert not w.q.parked and [q.rid for q in w.host.waiting_reqs] == ["x"] and w.q.zombies
    w.be.finish("x")
    w.q.poll()
    assert not w.q.zombies and len(w.tree.free_slots) == w.tree.cap and w.tree.locks == 0


def test_a_backend_that_refuses_the_job_is_a_miss(world):
    w = world()

    def refuse(*a):
        raise RuntimeError("data plane gone")

    w.be.submit = refuse
    r = req("a", 3 * C + 1)
    w.stored(r, 3)
    _park(w, r)
    w.q.poll()
    assert w.host.released == ["a"] and len(w.tree.free_slots) == w.tree.cap and w.tree.locks == 0


def test_settings_are_validated():
    with pytest.raises(ValueError, match="chunk_size"):
        AdmissionSettings(chunk_size=0)
    with pytest.raises(ValueError, match="max_pool_fraction"):
        AdmissionSettings(chunk_size=16, max_pool_fraction=0.0)
