"""Pinning host regions for device KV writes (``sgl_remote_kv.kvpool.host_pin``), against the strict
CPU double's ``FakeCudart`` (per-thread sticky last error, double registration refused like CUDA), and
the writer's input bounds that a device scatter would not check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sgl_remote_kv.kvpool import KVWriteError, PoolTensors, writer_for
from sgl_remote_kv.kvpool.host_pin import HostPinner
from sgl_remote_kv.types import KVLayout, numpy_storage_dtype
from tests.strict_device import ALREADY_REGISTERED, FakeCudart, StrictDevice, StrictKVPool

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


def _writer(dev, pool=64):
    kv = StrictKVPool(dev, LAY, pool, torch.float16)
    return kv, writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), LAY, 10.0, ops=dev)


def _region_kv(t: int, seed: int):
    region = np.zeros(2 * LAY.num_layers * t * 2 * 8, numpy_storage_dtype("float16"))
    rng = np.random.default_rng(seed)
    region[...] = rng.standard_normal(region.size).astype(np.float16)
    half = region.size // 2
    shape = (LAY.num_layers, t, 2, 8)
    return region, region[:half].reshape(shape), region[half:].reshape(shape)


def test_a_failed_registration_clears_the_threads_error_and_writes_are_staged(dev):
    """A failed cudaHostRegister sets the thread's last error; left set, the thread's next launch raises
    an unrelated error (a forward pass on the scheduler thread). The pinner clears it."""
    _, w = _writer(dev)
    region, k, v = _region_kv(5, 0)
    dev.cudart.fail_next = 2  # cudaErrorMemoryAllocation (e.g. a pinning limit)
    w.register_host(region)
    assert dev.pinned == [] and dev.cudart.registered == {}
    slots = torch.arange(5)
    w.write(k, v, slots)  # its launches pass torch's launch check: the error was cleared
    assert w.stats["staged"] == 1 and w.stats["zero_copy"] == 0
    rk, rv = w.read(slots)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)


def test_an_uncleared_error_would_surface_in_the_next_launch():
    """The double's rule itself: what the pinner's clearing prevents."""
    rt = FakeCudart()
    rt.fail_next = 2
    assert rt.register(1000, 10, 1) == 2
    with pytest.raises(RuntimeError, match="earlier call"):
        rt.launch_check()
    rt.launch_check()  # torch's check reads (and resets) it once


def test_two_writers_share_one_registration_of_a_region(dev):
    """Draft + target pools (or two ranks in one process) over one DPU region: registered once, both
    write zero-copy, unpinned only when the last writer lets go."""
    kv1, w1 = _writer(dev)
    kv2, w2 = _writer(dev)
    region, k, v = _region_kv(4, 1)
    w1.register_host(region)
    w2.register_host(region)
    assert len(dev.cudart.registered) == 1 and dev.pinner.pinned() == 1
    for w in (w1, w2):
        w.write(k, v, torch.arange(4))
        assert w.stats["zero_copy"] == 1
        np.testing.assert_array_equal(w.read(torch.arange(4))[0], k)
    w1.unregister_host(region)
    assert len(dev.cudart.registered) == 1  # w2 still writes from it
    w2.unregister_host(region)
    assert dev.cudart.registered == {} and dev.pinner.pinned() == 0


def test_a_range_registered_by_someone_else_is_not_ours_to_use(dev):
    _, w = _writer(dev)
    region, k, v = _region_kv(3, 2)
    ptr = region.__array_interface__["data"][0]
    assert dev.cudart.register(ptr, region.nbytes, 1) == 0  # another library pinned it
    w.register_host(region)  # fails with "already registered": staged, and the error is cleared
    assert dev.pinned == []
    w.write(k, v, torch.arange(3))
    assert w.stats["staged"] == 1


def test_pinner_without_a_runtime_pins_nothing():
    p = HostPinner(None)
    assert not p.pin(4096, 100) and p.pinned() == 0
    rt = FakeCudart()
    p = HostPinner(rt)
    assert p.pin(4096, 100) and p.pin(4096, 100) and len(rt.registered) == 1
    rt.fail_next = ALREADY_REGISTERED
    assert not p.pin(8192, 10) and rt.clear_error() == 0  # cleared by the pinner


@pytest.mark.parametrize("bad", [-1, 64])
def test_slots_outside_the_pool_are_a_write_error_and_change_nothing(dev, bad):
    kv, w = _writer(dev, pool=64)
    host_pool = [torch.zeros(64, 2, 8, dtype=torch.float16) for _ in range(2)]
    host = writer_for(PoolTensors(host_pool, [t.clone() for t in host_pool]), LAY)
    _, k, v = _region_kv(3, 3)
    slots = torch.tensor([0, bad, 5])
    for writer in (w, host):
        with pytest.raises(KVWriteError, match="outside the pool"):
            writer.write(k, v, slots)
        rk, _ = writer.read(torch.arange(64))
        assert not rk.any()


def test_a_chunk_larger_than_one_scatter_is_a_write_error_not_a_recursion(dev, monkeypatch):
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.codec.format import parse_header
    from sgl_remote_kv.kvpool import device_writer

    fp = synthetic.fingerprint(num_layers=2, dtype="float16")
    codec = get_codec("quant_deflate", k_bins="64", granularity="token")
    k, v = synthetic.kv(fp.layout, 16, seed=4)
    blob = codec.encode(k, v, fp)
    hdr = parse_header(blob, fp)
    view = codec.codes_stage(blob, hdr, 0, np.empty(codec.scratch_bytes(hdr, 0), np.uint8))
    kv = StrictKVPool(dev, fp.layout, 64, torch.float16)
    w = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), fp.layout, 10.0, ops=dev)
    monkeypatch.setattr(device_writer, "MAX_TOKENS", 8)  # the chunk (16 tokens) exceeds one launch
    with pytest.raises(KVWriteError, match="exceeds one scatter"):
        w.write_quantized([view], torch.arange(16), 0)
