"""Layer-wise installs on the DPU path without a server: a real data-plane process, a real embedded store,
the lossless codec, the real ``DpuFetchBackend`` and ``LayerwiseInstalls``, and a stand-in MHA pool.

Covers: a fetch is ``verified`` before its layers are in the pool and each ``wait_until(l)`` returns
once layer ``l`` is (exact KV, no fallback); the data plane SIGKILLed after ``verified``: the remaining
layers are decoded from the host's blob copies (exact KV) and the client restarts the data plane; the
data plane stalled (SIGSTOP) after ``verified``: fallback after ``stall_s`` and, once it resumes, the
client never writes those slots again.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from dpu_helpers import CHUNK, FP, LAYOUT, codecs, put_chunks, random_chunks
from pool_fake import FakeKVPool

from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.contract.settings import DataPlaneSettings, Debug
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch import layerwise
from sgl_remote_kv.fetch.dpu import DpuFetchBackend
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.metrics import RemoteKVMetrics

N = 3
CB = chunk_bytes(LAYOUT, CHUNK)


class Pool(FakeKVPool):
    """bf16 pool; ``layer_bits`` reads slots back as raw bits for exact comparisons."""

    def __init__(self, slots: int = 256) -> None:
        super().__init__(LAYOUT, slots, torch.bfloat16)

    def layer_bits(self, layer: int, slots) -> tuple[np.ndarray, np.ndarray]:
        return (
            self.k_buffer[layer][slots].view(torch.uint16).numpy(),
            self.v_buffer[layer][slots].view(torch.uint16).numpy(),
        )


@pytest.fixture
def setup(tmp_path, request):
    """(backend, pool, counter, metrics, blobs, keys); ``request.param``: DMA delay per slab (s)."""
    delay = getattr(request, "param", 0.0)
    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(N, seed=11))
    spec = DataPlaneSettings(
        workers=(1, 1, 1, 1), layer_group=1, slots=2, slot_bytes=N * CB, debug=Debug(dma_delay_s=delay)
    )
    cfg = DpuClientConfig(url, dest_slots=2, dest_slot_bytes=N * CB, blob_slot_bytes=2 * N * CB, process=spec)
    client = DpuClient(cfg, FP, codec)
    client.start()
    pool, metrics = Pool(), RemoteKVMetrics()
    counter = layerwise.LayerwiseInstalls(pool.writer, FP, metrics, stall_s=1.0)
    pool.register_layer_transfer_counter(counter)
    be = DpuFetchBackend(client, pool.writer, CHUNK)
    yield be, pool, counter, metrics, blobs, keys
    be.close()


def _slots() -> torch.Tensor:
    return torch.arange(200, 200 - N * CHUNK, -1)  # scattered, descending: catches index mix-ups


def _expected(blobs):
    parts = [decode(b, FP) for b in blobs]
    return np.concatenate([k for k, _ in parts], axis=1), np.concatenate([v for _, v in parts], axis=1)


def _assert_layer(pool, slots, k, v, layer) -> None:
    pk, pv = pool.layer_bits(layer, slots)
    assert np.array_equal(pk, k[layer]) and np.array_equal(pv, v[layer]), f"layer {layer} differs"


def _admit(be, counter, keys, slots):
    h = be.submit("r", keys, 0, slots)
    assert h.verified.wait(30)
    counter.add(h, slots, be.client.codec)
    return h


@pytest.mark.parametrize("setup", [0.2], indirect=True)
def test_admitted_at_verified_each_layer_waits_for_its_own_kv(setup):
    be, pool, counter, metrics, blobs, keys = setup
    slots = _slots()
    h = _admit(be, counter, keys, slots)
    assert not h.layer_ready(LAYOUT.num_layers - 1) and not h.done()  # admitted before the KV is in
    k, v = _expected(blobs)
    pool.get_key_buffer(0)
    _assert_layer(pool, slots, k, v, 0)
    assert not h.layer_ready(LAYOUT.num_layers - 1)  # layer 0 did not wait for the last layer
    for layer in range(1, LAYOUT.num_layers):
        pool.get_key_buffer(layer)
        _assert_layer(pool, slots, k, v, layer)
    assert not counter.busy() and h.wait(30) and h.ok_chunks == N
    assert "failures|kind=layerwise_fallback" not in metrics.snapshot()


@pytest.mark.parametrize("setup", [0.3], indirect=True)
def test_data_plane_killed_after_verified_decodes_the_rest_on_the_host(setup):
    be, pool, counter, metrics, blobs, keys = setup
    slots = _slots()
    h = _admit(be, counter, keys, slots)
    os.kill(be.client.pid, signal.SIGKILL)
    t = threading.Thread(target=counter.finish_all)
    t.start()
    t.join(60)
    assert not t.is_alive() and not counter.busy()
    k, v = _expected(blobs)
    for layer in range(LAYOUT.num_layers):
        _assert_layer(pool, slots, k, v, layer)
    assert metrics.snapshot()["failures|kind=layerwise_fallback"] == 1
    assert h.broken()
    deadline = time.monotonic() + 30
    while be.client.stats()["restarts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert be.client.stats()["restarts"] >= 1  # and the server would keep serving (new generation)


@pytest.mark.parametrize("setup", [0.3], indirect=True)
def test_stalled_data_plane_falls_back_and_never_writes_the_slots_afterwards(setup):
    be, pool, counter, metrics, blobs, keys = setup
    slots = _slots()
    h = _admit(be, counter, keys, slots)
    pid = be.client.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        counter.finish_all()  # no progress for stall_s: decodes from the host's blob copies
    finally:
        os.kill(pid, signal.SIGCONT)
    k, v = _expected(blobs)
    for layer in range(LAYOUT.num_layers):
        _assert_layer(pool, slots, k, v, layer)
    assert metrics.snapshot()["failures|kind=layerwise_fallback"] == 1
    for buf in pool.k_buffer + pool.v_buffer:  # slots are ours again (e.g. reused): poison them
        buf[slots] = 0
    assert h.wait(60)  # the resumed data plane finishes the (cancelled) job
    time.sleep(0.5)
    for layer in range(LAYOUT.num_layers):
        pk, pv = pool.layer_bits(layer, slots)
        assert not pk.any() and not pv.any(), "the client wrote a cancelled install's slots"
