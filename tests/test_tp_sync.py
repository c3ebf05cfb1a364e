"""TP rank agreement (sgl_remote_kv/admission/agreement.py) over a real gloo process group.

Each test spawns 2 or 3 real processes that join a torch.distributed gloo group (file:// rendezvous)
and run the same scenario, each rank with its own local observations; the agreed verdicts of every
rank come back to the test, which checks that they are identical and follow the MIN semantics.
No SGLang involved; the server end to end is tests/test_tp_server.py.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

from sgl_remote_kv.admission.agreement import MISS, NEUTRAL, PENDING, Agreement, choice_of, ready, row
from sgl_remote_kv.types import PathName


def _scenario_pending(rank: int, ag: Agreement) -> list:
    """Three passes: rank 1 is still pending in pass 0, then ready; ready counts differ per rank."""
    out = []
    for step in range(3):
        code = PENDING if rank == 1 and step == 0 else ready(5 - rank)  # 5, 4, (3)
        v = ag.agree([("rid-a:fetch", row(code))])[0]
        out.append((v.pending, v.miss, v.n))
    return out


def _scenario_miss(rank: int, ag: Agreement) -> list:
    """A timeout/failure on the last rank only, while the others are pending or ready."""
    last = rank == ag.size - 1
    entries = [
        ("a:fetch", row(MISS if last else PENDING)),  # others still waiting
        ("b:fetch", row(MISS if last else ready(7))),  # others finished
        ("c:lookup", row(ready(1), choice=0 if rank == 0 else NEUTRAL, counts={"dpu": 3})),
    ]
    return [(v.pending, v.miss, v.n, v.path) for v in ag.agree(entries)]


def _scenario_choice(rank: int, ag: Agreement) -> list:
    """Rank 0's policy choice wins; per-path counts are the MIN over ranks; early needs every rank."""
    choice = choice_of(PathName.INPROC) if rank == 0 else NEUTRAL
    counts = {"inproc": 6 - rank, "dpu": 9}
    entries = [
        ("x:lookup", row(ready(1), choice=choice, counts=counts)),
        ("y:fetch", row(PENDING, early=1)),  # verified (not finished) on every rank
        ("z:fetch", row(PENDING, early=int(rank != 1))),  # rank 1 not verified yet
    ]
    x, y, z = ag.agree(entries)
    return [x.path, x.count("inproc"), x.count("dpu"), x.count("nvdec"), y.early, z.early, z.pending]


def _scenario_collectives(rank: int, ag: Agreement) -> list:
    """One collective per pass whatever the number of entries; none for an empty pass."""
    seen = [ag.collectives]
    ag.agree([(f"r{i}:lookup", row(PENDING)) for i in range(50)])
    seen.append(ag.collectives)
    ag.agree([])
    seen.append(ag.collectives)
    ag.agree([("one:fetch", row(ready(2)))])
    seen.append(ag.collectives)
    return seen


def _scenario_divergence(rank: int, ag: Agreement) -> list:
    """Ranks that disagree on the parked set are detected (digest), not silently mixed."""
    ag.agree([("same:lookup", row(PENDING))])
    ag.agree([(f"rank{rank}:lookup", row(PENDING))])
    return [ag.divergences]


SCENARIOS = {
    f.__name__: f
    for f in (
        _scenario_pending,
        _scenario_miss,
        _scenario_choice,
        _scenario_collectives,
        _scenario_divergence,
    )
}


def _worker(rank: int, size: int, init_file: str, name: str, results) -> None:
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=size
        )
        group = torch.distributed.new_group(backend="gloo")  # like SGLang's TP CPU group
        ag = Agreement(group, torch.distributed.get_rank(group=group), size)
        results.put((rank, SCENARIOS[name](rank, ag)))
        torch.distributed.destroy_process_group()
    except BaseException:  # process boundary: report, the test fails on it
        results.put((rank, "ERROR " + traceback.format_exc()))


def _run(name: str, size: int, tmp_path) -> list:
    ctx = mp.get_context("fork")  # fresh interpreters (spawn) work too, ~4x slower here
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, size, str(tmp_path / "rdzv"), name, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    errors = [v for v in got.values() if isinstance(v, str)]
    assert not errors, errors
    return [got[r] for r in range(size)]


@pytest.mark.parametrize("size", [2, 3])
def test_pending_on_one_rank_keeps_all_waiting_then_min_ready(size, tmp_path):
    per_rank = _run("_scenario_pending", size, tmp_path)
    assert all(r == per_rank[0] for r in per_rank)  # identical decisions on every rank
    low = 5 - (size - 1)
    assert per_rank[0] == [(True, False, 0), (False, False, low), (False, False, low)]


@pytest.mark.parametrize("size", [2, 3])
def test_a_miss_on_one_rank_is_a_miss_on_all(size, tmp_path):
    per_rank = _run("_scenario_miss", size, tmp_path)
    assert all(r == per_rank[0] for r in per_rank)
    a, b, c = per_rank[0]
    assert a[:2] == (False, True)  # not held back by the ranks still pending
    assert b[:3] == (False, True, 0)  # the ranks that finished do not install
    assert c == (False, False, 1, None)  # lookup answered everywhere, but rank 0 chose recompute


@pytest.mark.parametrize("size", [2, 3])
def test_rank0_choice_min_counts_and_early_admission(size, tmp_path):
    per_rank = _run("_scenario_choice", size, tmp_path)
    assert all(r == per_rank[0] for r in per_rank)
    assert per_rank[0] == ["inproc", 6 - (size - 1), 9, 0, True, False, True]


@pytest.mark.parametrize("size", [2, 3])
def test_one_collective_per_pass_and_none_when_idle(size, tmp_path):
    for seen in _run("_scenario_collectives", size, tmp_path):
        assert seen == [0, 1, 1, 2]


def test_parked_set_divergence_is_detected(tmp_path):
    assert _run("_scenario_divergence", 2, tmp_path) == [[1], [1]]


def test_tp1_is_the_identity_without_any_collective():
    assert not torch.distributed.is_initialized()  # a collective here would raise
    ag = Agreement()
    v = ag.agree([("a:fetch", row(ready(4))), ("b:lookup", row(MISS))])
    assert (v[0].n, v[1].miss, ag.collectives, ag.active) == (4, True, 0, False)


# -- the admission queue's one poll loop, one queue per rank ------------------------------------------


def _scenario_queue(rank: int, ag: Agreement) -> list:
    """Lookups that finish at different passes, a timeout and a store error on one rank each, and a
    zombie fetch whose backend stops at a different pass on every rank; the pass at which each request
    leaves the queue and the zombie is reaped must be the same on every rank."""
    import concurrent.futures as cf

    from sgl_remote_kv.admission import ParkedRequest, Phase
    from sgl_remote_kv.fetch.base import FetchHandle
    from sgl_remote_kv.types import KVLayout, ModelFingerprint
    from tests.admission_fakes import C, make_queue, req

    fp = ModelFingerprint("LlamaForCausalLM", KVLayout(2, 1, 8, "float32"), "w", rank, ag.size)
    w = make_queue(agreement=ag, margin=0.0, fp=fp)  # margin 0: rank 0's policy chooses recompute
    q = w.q
    futures = {rid: cf.Future() for rid in ("late", "timeout", "fault")}
    for i, (rid, f) in enumerate(futures.items()):  # the same parked order on every rank
        assert q.park(req(rid, 3 * C + 1, base=1000 * i))
        q.parked[rid].lookup.cancel()
        q.parked[rid].lookup = f  # answered when this scenario says so
    z = ParkedRequest(req("z", 1), "z", {}, 0, 0.0, 0.0, phase=Phase.ZOMBIE, handle=FetchHandle("z", 1, 0, C))
    q.zombies.append(z)  # a dropped fetch whose backend still runs
    futures["late"].set_result({PathName.DPU: 3}) if rank != 1 else None  # rank 1 answers at pass 2
    futures["timeout"].set_result({PathName.DPU: 3}) if rank != ag.size - 1 else None  # never answers
    if rank == 0:
        futures["fault"].set_exception(OSError("store unreachable"))
    else:
        futures["fault"].set_result({PathName.DPU: 3})
    out, released_at = [], {}
    for step in range(5):
        if step == 2 and rank == 1:
            futures["late"].set_result({PathName.DPU: 3})
        if step == 1 and rank == ag.size - 1:  # this rank's clock passes the lookup deadline
            q.parked["timeout"].since -= 10 * q.s.lookup_timeout_s
        if step == rank:
            z.handle._finish()  # this rank's backend stops writing the dropped fetch's slots
        q.poll()
        for rid in w.host.released:
            released_at.setdefault(rid, step)
        out.append((sorted(q.parked), len(q.zombies), ag.collectives))
    return [released_at, out, w.c.metrics.snapshot().get("lookups|result=timeout", 0)]


SCENARIOS["_scenario_queue"] = _scenario_queue


@pytest.mark.parametrize("size", [2, 3])
def test_queue_passes_agree_on_every_rank(size, tmp_path):
    per_rank = _run("_scenario_queue", size, tmp_path)
    released, passes, _ = per_rank[0]
    assert all(r[:2] == [released, passes] for r in per_rank)  # same pass for every decision
    # the error on rank 0 releases "fault" at once; the timeout on the last rank releases "timeout"
    # at pass 1 although the others have an answer; "late" waits for rank 1's lookup (pass 2)
    assert released == {"fault": 0, "timeout": 1, "late": 2}
    assert [z for _, z, _ in passes] == [1] * (size - 1) + [0] * (6 - size)  # reaped when all stopped
    assert [c for _, _, c in passes] == [1, 2, 3, 3, 3]  # one per pass while anything is queued; none after
    assert [r[2] for r in per_rank][-1] == 1  # the rank whose clock expired counted a timeout


def _scenario_fetch_fails_on_one_rank(rank: int, ag: Agreement) -> list:
    """A fetch that fails at once on rank 0 (its data plane died: done, nothing fetched) while the other
    ranks' fetches still run and end at different passes. Found by the soak (TP 3): rank 0 released the
    request without a zombie, the others kept one for the reserved slots, and from the next pass on rank
    0 skipped the collective the others were waiting in (a hang)."""
    from sgl_remote_kv.types import KVLayout, ModelFingerprint
    from tests.admission_fakes import C, make_queue, req

    fp = ModelFingerprint("LlamaForCausalLM", KVLayout(2, 1, 8, "float32"), "w", rank, ag.size)
    w = make_queue(agreement=ag, margin=1e9, fp=fp)
    r = req("f", 3 * C + 1)
    w.stored(r, 3)
    assert w.q.park(r)
    w.q.parked["f"].lookup.result(timeout=10)
    out, released_at = [], None
    for step in range(6):
        if "f" in w.be.handles:
            if rank == 0 and step == 2:
                w.be.finish("f", ok_chunks=0)  # rank 0: dead at once
            elif rank > 0 and step == 2 + rank:
                w.be.finish("f")  # the others end later, each at its own pass
        w.q.poll()
        if released_at is None and "f" in w.host.released:
            released_at = step
        out.append((sorted(w.q.parked), len(w.q.zombies), ag.collectives))
    return [released_at, out, len(w.tree.free_slots), w.tree.locks]


SCENARIOS["_scenario_fetch_fails_on_one_rank"] = _scenario_fetch_fails_on_one_rank


@pytest.mark.parametrize("size", [2, 3])
def test_a_fetch_failing_on_one_rank_keeps_every_rank_in_step(size, tmp_path):
    per_rank = _run("_scenario_fetch_fails_on_one_rank", size, tmp_path)
    released, passes = per_rank[0][:2]
    assert all(r[:2] == [released, passes] for r in per_rank), per_rank  # same passes, same collectives
    assert released == 2  # the miss on rank 0 releases the request everywhere in the same pass
    zombies = [z for _, z, _ in passes]
    assert zombies[2] == 1 and zombies[-1] == 0  # every rank keeps the slots until all backends stopped
    assert {(r[2], r[3]) for r in per_rank} == {
        (per_rank[0][2], 0)
    }  # then every rank freed them, no lock held
