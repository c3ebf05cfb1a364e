"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): forced faults of the device KV writer on a real
CUDA device, into SGLang's ``MHATokenToKVPool``.

- **A stalled side stream** (``torch.cuda._sleep`` enqueued on the writer's stream, longer than its write
  timeout): the write raises ``KVWriteError``; through the DPU client the fetch is a miss (chunks failed
  with kind ``write``), never a hit. A reader that fences (``KVWriter.fence``, what the scheduler does
  before reusing slots) is ordered behind the late scatter: KV written into the same slots after the
  fence survives it (no wrong read).
- **Two writers on one host region** (a target and a draft pool fetching through one DPU client, whose
  destination region both register: ``kvpool/host_pin.py``'s refcounted ``HostPinner``): both write
  zero-copy, the range is registered once, the thread's CUDA error state stays clean (the next unrelated
  launch does not raise), and closing the client unpins it.
- **A cudaHostRegister that fails** (the range registered behind the pinner's back first, through
  ``torch.cuda.cudart()``: the pinner's call fails with cudaErrorHostMemoryAlreadyRegistered): writes are
  staged and exact, and the next unrelated kernel launch on that thread does not raise (the pinner
  cleared the error).

The CPU double of these rules is ``tests/strict_device.py`` (``tests/test_host_pin.py``,
``tests/test_faults_kv_write.py``). Skipped with the reason without a CUDA device, or naming a module not
carried (``tests/gpu_gate.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

from sgl_remote_kv.kvpool import KVWriteError, PoolTensors, writer_for
from sgl_remote_kv.types import KVLayout, ModelFingerprint

# every test builds an SGLang pool on CUDA
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_needs("sglang.srt.mem_cache.memory_pool")]
# the DPU client and its data-plane process
needs_dpu = pytest.mark.gpu_needs("sgl_remote_kv.fetch.dpu_client.client", "sgl_remote_kv.dpu.server")

LAY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
FP = ModelFingerprint("TestArch", LAY, "w" * 16)


def _pool(size: int = 512):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size, 1, torch.bfloat16, LAY.num_kv_heads, LAY.head_dim, LAY.num_layers, "cuda", False
    )


def _kv(tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from tier_scenarios import _random_kv

    return _random_kv(LAY, tokens, seed)


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds`` (measured here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    per_s = 10_000_000 / (start.elapsed_time(end) / 1e3)
    return int(per_s * seconds)


def _unrelated_launch() -> float:
    """A kernel launch and a sync on this thread: raises if the thread's CUDA error state was left set."""
    return float(torch.ones(4096, device="cuda").mul_(2).sum().item())


def _last_error() -> int:
    """cudaGetLastError of this thread (and resets it), through the pinner's runtime; 0 without one."""
    from sgl_remote_kv.kvpool.host_pin import cuda_pinner

    rt = cuda_pinner().runtime
    return 0 if rt is None else rt.clear_error()


def test_a_stalled_side_stream_fails_the_write_and_a_fenced_reader_is_ordered_behind_it():
    pool = _pool()
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), LAY, timeout_s=0.3)
    k, v = _kv(64, seed=1)
    slots = torch.randperm(500)[:64] + 1
    w.write(k, v, slots)  # compiled and warm: the stall below is the only reason to be late
    cycles = _sleep_cycles(2.0)
    with torch.cuda.stream(w.ops.stream):
        torch.cuda._sleep(cycles)  # a wedged side stream: the next write's scatter queues behind it
    k2, v2 = _kv(64, seed=2)
    with pytest.raises(KVWriteError, match="not done in"):
        w.write(k2, v2, slots)
    assert w.stats["timeouts"] == 1
    # the tier treats the chunk as failed and fences before its slots are reused; SGLang then writes them
    # on its own stream: the late scatter (k2) must land before that write (k3), never after it
    w.fence()
    k3, v3 = _kv(64, seed=3)
    dev_slots = slots.cuda()
    for layer in range(LAY.num_layers):
        pool.k_buffer[layer][dev_slots] = torch.from_numpy(k3[layer]).view(torch.bfloat16).cuda()
        pool.v_buffer[layer][dev_slots] = torch.from_numpy(v3[layer]).view(torch.bfloat16).cuda()
    torch.cuda.synchronize()
    got_k, got_v = w.read(slots)
    np.testing.assert_array_equal(got_k, k3)
    np.testing.assert_array_equal(got_v, v3)
    w.write(k, v, slots)  # the writer recovered once the stream moved on
    np.testing.assert_array_equal(w.read(slots)[0], k)


@needs_dpu
def test_a_stalled_side_stream_makes_the_dpu_fetch_a_miss(tmp_path):
    from dpu_helpers import codecs
    from tier_scenarios import CHUNK, N_CHUNKS, dpu_client, store_chunks

    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget

    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    k, v = _kv(N_CHUNKS * CHUNK, seed=4)
    keys, _ = store_chunks(url, codec, FP, k, v)
    pool = _pool()
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), LAY, timeout_s=0.3)
    slots = torch.randperm(500)[: N_CHUNKS * CHUNK] + 1
    cycles = _sleep_cycles(3.0)
    with dpu_client(url, FP, codec, blob_area=False) as client:
        # first a hit: the region is pinned and every kernel compiled before the stall (a pinning or a
        # compile that synchronized with the stalled stream would hide it)
        assert client.fetch("warm", keys, CHUNK, KVTarget(w, slots), timeout=60).hit_chunks == N_CHUNKS
        with torch.cuda.stream(w.ops.stream):
            torch.cuda._sleep(cycles)
        res = client.fetch("stalled", keys, CHUNK, KVTarget(w, slots), timeout=60)
        assert res.hit_chunks == 0, res  # a miss, never a hit over KV that may not be there
        assert res.failures and set(res.failures.values()) == {"write"}, res
        assert client.stats()["write_failed"] >= 1 and w.stats["timeouts"] >= 1
        torch.cuda.synchronize()  # the stall ends; the same fetch hits again
        w.fence()
        res = client.fetch("again", keys, CHUNK, KVTarget(w, slots), timeout=60)
        assert res.hit_chunks == N_CHUNKS, res
    np.testing.assert_array_equal(w.read(slots)[0], k)


@needs_dpu
def test_two_writers_share_the_dpu_region_pinned_once(tmp_path):
    from dpu_helpers import codecs
    from tier_scenarios import CHUNK, N_CHUNKS, dpu_client, store_chunks

    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
    from sgl_remote_kv.kvpool.host_pin import cuda_pinner

    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    k, v = _kv(N_CHUNKS * CHUNK, seed=5)
    keys, _ = store_chunks(url, codec, FP, k, v)
    target, draft = _pool(), _pool()
    writers = [writer_for(PoolTensors(p.k_buffer, p.v_buffer), LAY) for p in (target, draft)]
    slots = torch.randperm(500)[: N_CHUNKS * CHUNK] + 1
    pinner = cuda_pinner()
    before = pinner.pinned()
    assert _last_error() == 0
    with dpu_client(url, FP, codec, blob_area=False) as client:
        for i, w in enumerate(writers):  # each target registers the client's region with its writer
            res = client.fetch(f"r{i}", keys, CHUNK, KVTarget(w, slots), timeout=60)
            assert res.hit_chunks == N_CHUNKS, res
        assert pinner.pinned() == before + 1  # one range, counted twice
        assert _last_error() == 0  # the second registration never reached cudaHostRegister
        _unrelated_launch()
        for w in writers:
            assert w.stats["zero_copy"] >= 1 and w.stats["staged"] == 0, w.stats
            got_k, got_v = w.read(slots)
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)
    assert pinner.pinned() == before  # closing the client unpinned it (the last registration)
    _unrelated_launch()


def test_a_failed_host_register_stages_writes_and_leaves_no_error_behind():
    from gpu_measure import page_aligned

    from sgl_remote_kv.kvpool.host_pin import cuda_pinner

    pool = _pool()
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), LAY)
    k, v = _kv(64, seed=6)
    mapping, raw = page_aligned(k.nbytes + v.nbytes)
    region = raw.view(k.dtype)
    region[: k.size], region[k.size :] = k.reshape(-1), v.reshape(-1)
    src_k, src_v = region[: k.size].reshape(k.shape), region[k.size :].reshape(v.shape)
    cudart = torch.cuda.cudart()
    ptr = raw.__array_interface__["data"][0]
    assert int(cudart.cudaHostRegister(ptr, raw.nbytes, 0)) == 0  # behind the pinner's back
    try:
        pinned_before = cuda_pinner().pinned()
        w.register_host(raw)  # cudaErrorHostMemoryAlreadyRegistered inside; the pinner clears it
        assert cuda_pinner().pinned() == pinned_before
        assert _last_error() == 0
        _unrelated_launch()  # torch's launch check would raise a left-over error here
        slots = torch.randperm(500)[:64] + 1
        w.write(src_k, src_v, slots)
        assert w.stats["staged"] == 1 and w.stats["zero_copy"] == 0, w.stats
        got_k, got_v = w.read(slots)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
        w.unregister_host(raw)  # not pinned by the writer: nothing to undo, nothing raised
    finally:
        assert int(cudart.cudaHostUnregister(ptr)) == 0
    _unrelated_launch()
    del mapping
