"""The DPU path into a *device* KV pool, run on CPU against the strict CUDA double (``strict_device.py``):
a real data-plane process, a real embedded store, the real ``DpuClient`` + ``RoundBook`` + the device
``KVWriter`` code. What CUDA would enforce is enforced: the destination region is host memory, so KV must
reach the pool through an explicit H2D copy and a device-side scatter, and nothing reads a layer before
its completion event.

- a fetch into the strict pool is a bit-exact hit, one write per host round, the region registered once;
- a write that fails (the device faults) or never completes (the device hangs) fails the round's chunks
  with kind ``write``: the fetch reports no hit for them, and no reader is let through unfenced;
- output ``codes`` (a device pool's default): the data plane only inflates, the writer dequantizes on the
  device, exactly; codes the host cannot parse, or a device fault, fail the round (``write``).

The old code (``control/scatter.py``: ``pool[layer][slots] = host_src[layer]`` on the receiver thread,
the layer marked scattered *before* the write, the exception swallowed by the receiver's boundary)
reported every chunk as a hit here with zeros in the pool: ``test_strict_double_refuses_the_old_dpu_scatter``
in ``test_kv_writer.py`` shows the double refusing that write.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dpu_helpers import (
    CHUNK,
    FP,
    LAYOUT,
    codecs,
    dataplane_stage_items,
    make_pool,
    pool_tokens,
    put_chunks,
    random_chunks,
)
from strict_device import StrictDevice, StrictKVPool

from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

CB = chunk_bytes(LAYOUT, CHUNK)


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


@pytest.fixture
def client(tmp_path, request):
    """``request.param``: ``(eager_writes, output)`` (default ``(True, "auto")``: codes into a device pool)."""
    codec = codecs()["quant"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(5, seed=21))
    spec = DataPlaneSettings(
        workers=(1, 1, 1, 1), layer_group=2, slots=2, slot_bytes=2 * CB, store_timeout_s=2.0
    )
    eager, output = getattr(request, "param", (True, "auto"))
    cfg = DpuClientConfig(
        url, dest_slots=2, dest_slot_bytes=2 * CB, process=spec, eager_writes=eager, output=output
    )
    c = DpuClient(cfg, FP, codec)
    c.start()
    yield c, keys, blobs
    c.close()


@pytest.mark.parametrize("client", [(True, "kv"), (False, "kv")], indirect=True, ids=["eager", "per_round"])
def test_fetch_into_a_strict_device_pool_is_exact(client, dev):
    c, keys, blobs = client
    target = make_pool(LAYOUT, 512, 5 * CHUNK, ops=dev)
    res = c.fetch("strict", keys, CHUNK, target, timeout=60)
    assert res.hit_chunks == 5 and not res.failures
    w = target.writer
    if c.cfg.eager_writes:  # one write per run of ready layers: at least one per round, at most one per layer
        assert 3 <= w.stats["writes"] <= 3 * LAYOUT.num_layers
    else:
        assert w.stats["writes"] == 3  # 5 chunks in host rounds of 2: one write (one launch) per round
    assert w.stats["zero_copy"] == w.stats["writes"] and len(dev.pinned) == 1  # the region, pinned once
    for i in range(5):
        k, v = decode(blobs[i], FP)
        pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
        assert np.array_equal(k, pk) and np.array_equal(v, pv), f"chunk {i} differs"
    c.close()
    assert dev.pinned == []  # unregistered before the region is unmapped


@pytest.mark.parametrize(
    "client", [(True, "auto"), (False, "auto")], indirect=True, ids=["eager", "per_round"]
)
def test_codes_into_a_strict_device_pool_are_dequantized_on_the_device(client, dev):
    """A device pool's default: the data plane writes codes, the pool's writer dequantizes them on the
    device (one device dequant per layer write, nothing decoded to KV on the data plane)."""
    c, keys, blobs = client
    target = make_pool(LAYOUT, 512, 5 * CHUNK, ops=dev)
    res = c.fetch("strict-codes", keys, CHUNK, target, timeout=60)
    assert res.hit_chunks == 5 and not res.failures
    w = target.writer
    assert (
        w.stats["device_dequant"] == w.stats["writes"] >= LAYOUT.num_layers
    )  # one write per layer and round
    assert dataplane_stage_items(c)["dequant"] == 0  # the data plane only inflated
    for i in range(5):
        k, v = decode(blobs[i], FP)
        pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
        assert np.array_equal(k, pk) and np.array_equal(v, pv), (
            f"chunk {i} differs"
        )  # same dequant as the CPU's


def test_codes_that_do_not_parse_on_the_host_are_a_miss(client, dev):
    """The data plane's codes for layer 1 fail the host's check (a fault injected into the host's codec
    view): that write fails, its round is a miss (kind ``write``), nothing crashes, later fetches hit."""
    from sgl_remote_kv.codec.errors import CorruptChunk

    c, keys, _ = client
    real = c.io.codec

    class Faulty:
        def view(self, header, layer, decoded):
            if layer == 1:
                raise CorruptChunk("injected: codes do not parse")
            return real.view(header, layer, decoded)

    c.io.codec = Faulty()
    res = c.fetch("bad-codes", keys[:2], CHUNK, make_pool(LAYOUT, 512, 2 * CHUNK, ops=dev), timeout=60)
    assert res.hit_chunks == 0 and res.failures.get(0) == "write"
    c.io.codec = real
    res = c.fetch("good-codes", keys[:2], CHUNK, make_pool(LAYOUT, 512, 2 * CHUNK, ops=dev), timeout=60)
    assert res.hit_chunks == 2 and not res.failures


@pytest.mark.parametrize("client", [(True, "kv"), (True, "codes")], indirect=True, ids=["kv", "codes"])
def test_device_fault_during_the_write_fails_the_round_never_a_hit(client, dev):
    c, keys, _ = client
    target = make_pool(LAYOUT, 512, 5 * CHUNK, ops=dev)
    dev.error = RuntimeError("an illegal memory access was encountered")  # sticky, like CUDA's
    res = c.fetch("fault", keys, CHUNK, target, timeout=60)
    assert res.hit_chunks == 0 and res.failures.get(0) == "write"
    assert c.stats()["write_failed"] >= 1


def test_device_hang_is_a_timed_out_write_and_readers_stay_fenced(client, dev):
    c, keys, _ = client
    kv = StrictKVPool(dev, LAYOUT, 512, torch.bfloat16)
    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
    from sgl_remote_kv.kvpool import PoolTensors, writer_for

    writer = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), LAYOUT, timeout_s=0.3, ops=dev)
    slots = torch.randperm(512)[: 5 * CHUNK]
    dev.hang()
    res = c.fetch("hang", keys[:2], CHUNK, KVTarget(writer, slots), timeout=60)
    assert res.hit_chunks == 0 and res.failures.get(0) == "write"
    from strict_device import UnfencedRead

    with pytest.raises(UnfencedRead):
        kv.get_key_buffer(0)  # the late scatter may still land: no reader passes before its event
    dev.resume()
    writer.fence()
    kv.get_key_buffer(0)


def test_close_with_a_wedged_device_does_not_hang(client, dev):
    import time

    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
    from sgl_remote_kv.kvpool import PoolTensors, writer_for

    c, keys, _ = client
    kv = StrictKVPool(dev, LAYOUT, 512, torch.bfloat16)
    writer = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), LAYOUT, timeout_s=0.3, ops=dev)
    dev.hang()
    try:
        res = c.fetch(
            "wedged", keys[:2], CHUNK, KVTarget(writer, torch.randperm(512)[: 2 * CHUNK]), timeout=60
        )
        assert res.hit_chunks == 0
        t0 = time.monotonic()
        c.close()  # unpinning waits for the device at most the writer's timeout, then gives up loudly
        assert time.monotonic() - t0 < 10
    finally:
        dev.reset()  # the region is unmapped now: the wedged copies must never run


def test_a_finished_chunk_whose_layers_never_reached_the_pool_is_not_a_hit():
    """Chunk 0 of a 2-chunk round finished, chunk 1 was lost with the data plane. Chunk 0 is a hit only
    once every one of its layers was written into the pool (``mark_written`` runs after a write returned);
    with one layer missing it is not."""
    import threading

    from sgl_remote_kv.fetch.dpu_client.jobs import DONE, ClientFetch, HostRound, KVTarget
    from sgl_remote_kv.kvpool import PoolTensors, writer_for

    k = [
        torch.zeros(8, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=torch.bfloat16)
        for _ in range(LAYOUT.num_layers)
    ]
    target = KVTarget(writer_for(PoolTensors(k, k), LAYOUT), torch.arange(2 * CHUNK))
    n = LAYOUT.num_layers
    for written, hit in ((0, 0), (n - 1, 0), (n, 1)):
        h = ClientFetch(threading.Condition(), "r", [b"a" * 32, b"b" * 32], [CHUNK, CHUNK], n, target)
        h.rounds.append(HostRound(h, 0, 2, 0, 2 * CHUNK, terminal=True))
        h.mark_written(0, 1, 0, written)
        h.state[0] = DONE
        h.mark_failed(1, "dataplane_lost")
        assert h.check_finished()
        assert h.result().hit_chunks == hit
        assert h.layer_ready[0] == (written > 0) and h.layer_ready[n - 1] == (written == n)


def test_a_hung_write_holds_up_neither_submit_nor_another_cancel_and_cancel_waits_for_its_own(client, dev):
    """Pool writes run outside the client's lock: while one fetch's write hangs on the device, another
    fetch can be submitted and cancelled and the stats read (all return while that write is still
    running), and cancelling the fetch whose write runs returns only after the write returned (its caller
    frees the KV slots next)."""
    import time

    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
    from sgl_remote_kv.kvpool import PoolTensors, writer_for

    c, keys, _ = client
    kv = StrictKVPool(dev, LAYOUT, 512, torch.bfloat16)
    writer = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), LAYOUT, timeout_s=3.0, ops=dev)
    dev.hang()
    try:
        ha = c.submit("a", keys[:2], CHUNK, KVTarget(writer, torch.randperm(512)[: 2 * CHUNK]))
        deadline = time.monotonic() + 30
        while not (ha.writing and not c.book.writes) and time.monotonic() < deadline:
            time.sleep(0.01)  # until a's first write was taken by the receiver (it hangs there)
        assert ha.writing and not ha.finished
        hb = c.submit("b", keys[2:4], CHUNK, make_pool(LAYOUT, 512, 2 * CHUNK, ops=dev))
        c.stats()
        c.cancel(hb)
        assert ha.writing and not ha.finished  # none of them waited for a's write
        c.cancel(ha)
        assert ha.writing == 0  # returned only after a's write returned (timed out: no hit)
        assert ha.wait(30).hit_chunks == 0 and hb.wait(30).hit_chunks == 0
    finally:
        dev.resume()
        writer.fence()
