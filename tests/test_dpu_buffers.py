"""Round planning and pre-allocated staging buffers."""

from __future__ import annotations

import os

import numpy as np
import pytest
from sgl_remote_kv.dpu.buffers import DestRegion, StagingBuffers

from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.contract.sizing import chunk_bytes, plan_rounds
from sgl_remote_kv.fetch.dpu_client.host_region import HostRegion
from sgl_remote_kv.types import KVLayout

LAY = KVLayout(30, 3, 64, "bfloat16")


def test_chunk_bytes_matches_layout():
    assert chunk_bytes(LAY, 256) == 256 * LAY.bytes_per_token()


def test_plan_rounds_splits_large_requests():
    slot = 3 * chunk_bytes(LAY, 256)
    rounds = plan_rounds([256] * 7, LAY, slot, 1.0)
    assert [len(r) for r in rounds] == [3, 3, 1]
    assert [c.index for r in rounds for c in r] == list(range(7))
    for r in rounds:  # regions inside a round are disjoint and inside the slot
        ends = [c.src_off + chunk_bytes(LAY, c.tokens) for c in r]
        assert all(
            a.src_off + chunk_bytes(LAY, a.tokens) <= b.src_off for a, b in zip(r, r[1:], strict=False)
        )
        assert max(ends) <= slot
        assert r[-1].infl_off + 30 * r[-1].infl_layer <= slot


def test_plan_rounds_half_inflate_region_and_too_big_chunk():
    slot = 2 * chunk_bytes(LAY, 256)
    rounds = plan_rounds([256, 256, 128], LAY, slot, 0.5)
    assert [len(r) for r in rounds] == [2, 1]
    assert rounds[0][1].infl_off == 30 * rounds[0][0].infl_layer
    with pytest.raises(ValueError):
        plan_rounds([1024], LAY, slot, 1.0)


def test_staging_views_are_disjoint_and_allocated_once():
    buf = StagingBuffers(2, chunk_bytes(LAY, 64) * 2, 1.0)
    r0, r1 = plan_rounds([64, 64], LAY, buf.slot_bytes, 1.0)[0]
    k0, v0 = buf.src_chunk(0, r0, LAY, np.dtype(np.uint16))
    k1, _ = buf.src_chunk(1, r1, LAY, np.dtype(np.uint16))
    k0[:] = 1
    v0[:] = 2
    k1[:] = 3
    assert k0.shape == (30, 64, 3, 64) and np.all(k0 == 1) and np.all(v0 == 2)
    assert np.shares_memory(k0, buf.dma_src) and not np.shares_memory(k0, k1)
    assert buf.infl_layer(0, r0, 1).size == r0.infl_layer
    assert buf.total_bytes == 2 * buf.slot_bytes * 2


def test_host_regions_anonymous_and_named():
    """A spawned data plane maps the host's anonymous region by the descriptor it inherits (nothing in
    /dev/shm, ever); a service maps a named one by name, which ``close`` removes."""
    name = shm_names.region_name()
    anon = HostRegion(4096, name, named=False)
    try:
        assert not anon.named and not os.path.exists(f"/dev/shm/{name}")
        a = DestRegion.inherited(name, anon.fd)
        a.array[:4] = [1, 2, 3, 4]
        assert list(anon.array[:4]) == [1, 2, 3, 4] and a.size == 4096 and not a.exists()
        assert a.try_close() and anon.array[3] == 4  # the attacher's close never frees the host's memory
    finally:
        anon.close()
    anon.close()  # idempotent
    named = HostRegion(4096, shm_names.region_name(), named=True)
    try:
        b = DestRegion.attach(named.name)
        b.array[0] = 7
        assert named.array[0] == 7 and b.exists()
        b.close()
    finally:
        named.close()
    assert not os.path.exists(named.path)
    with pytest.raises(FileNotFoundError):
        DestRegion.attach(named.name)


def test_slab_queue_orders_rounds_and_a_layerwise_request_layer_major():
    """The order of every stage after fetch (``slab_key``): rounds in admission order, lowest layer group
    first within a round, then chunk order; a layer-wise request (jobs with a blob area) at the place of
    its first round, layer group by layer group across *all* its jobs (its forward pass needs layer l of
    every chunk: a request cut into two jobs must not finish one job before the other's first layer; a
    real server test caught that); ``None`` (stop a worker) after all work."""
    from types import SimpleNamespace

    from sgl_remote_kv.dpu.tasks import SlabQueue

    def job(first_round: int, layerwise: bool = False, lead=None):
        return SimpleNamespace(first_round=first_round, blob_cap=1 << 20 if layerwise else 0, lead=lead)

    def slab(j, rnd: int, chunk: int, lo: int):
        return (SimpleNamespace(job=j, round_id=rnd, region=SimpleNamespace(index=chunk)), lo, lo + 6)

    def drain(arrivals):
        q = SlabQueue()
        for item in arrivals:
            q.put(item)
        return [
            (s[0].round_id, s[1], s[0].region.index) if s is not None else None
            for s in [q.get() for _ in arrivals]
        ]

    # one plain job of rounds 0 and 1 (round by round), queued out of order
    a = job(0)
    plain = [
        slab(a, 1, 0, 0),
        slab(a, 1, 0, 6),
        None,
        slab(a, 0, 1, 6),
        slab(a, 0, 0, 6),
        slab(a, 0, 0, 0),
        slab(a, 1, 1, 0),
    ]
    assert drain(plain) == [(0, 0, 0), (0, 6, 0), (0, 6, 1), (1, 0, 0), (1, 0, 1), (1, 6, 0), None]
    # a layer-wise request of two jobs (rounds 2 and 4; another client's plain round 3 was admitted
    # between them), queued job by job: layer-major across both jobs, all at round 2's place
    b1 = job(2, layerwise=True)
    b2, c = job(4, layerwise=True, lead=b1), job(3)
    lw = [
        slab(b1, 2, 0, 0),
        slab(b1, 2, 1, 0),
        slab(b1, 2, 0, 6),
        slab(b1, 2, 1, 6),
        slab(c, 3, 0, 0),
        slab(b2, 4, 0, 0),
        slab(b2, 4, 0, 6),
        slab(a, 1, 0, 12),
    ]
    assert drain(lw) == [
        (1, 12, 0),
        (2, 0, 0),
        (2, 0, 1),
        (4, 0, 0),
        (2, 6, 0),
        (2, 6, 1),
        (4, 6, 0),
        (3, 0, 0),
    ]
