"""Layer-wise installs without a server: a real embedded store, the real lossless codec, the in-process
fetch backend, and a stand-in KV pool (per-layer ``k_buffer``/``v_buffer`` tensors like SGLang's MHA
pool, with its ``register_layer_transfer_counter`` / ``get_key_buffer`` contract).

Covers: the handle is ``verified`` (all bytes fetched + parsed) before decoding finishes; per-layer
waits scatter exactly the fetched KV; a backend that dies or stalls after admission falls back to
decoding the verified blobs in-process (same bytes); the hot path is a no-op with nothing pending.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch
from pool_fake import FakeKVPool, attach_installs

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.fetch import layerwise
from sgl_remote_kv.fetch.base import FetchHandle
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint

C, N = 16, 3
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float32")
FP = ModelFingerprint("TestArch", LAYOUT, "w" * 64)


Pool = functools.partial(FakeKVPool, LAYOUT, 128)  # float32, 128 slots


@pytest.fixture()
def stored(tmp_path):
    client = open_client(f"file://{tmp_path / 'store'}")
    codec = get_codec("lossless")
    keys = keys_mod.chunk_keys(
        keys_mod.namespace(FP, codec.name, codec.params_bytes(), None), np.arange(N * C), C
    )
    rng = np.random.default_rng(1)
    shape = (LAYOUT.num_layers, N * C, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k, v = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
    for i in range(N):
        blob = codec.encode(k[:, i * C : (i + 1) * C].copy(), v[:, i * C : (i + 1) * C].copy(), FP)
        client.put_many([(keys[i], blob)])
    yield client, codec, keys, k, v
    client.close()


def _slots() -> torch.Tensor:
    return torch.arange(100, 100 - N * C, -1)  # scattered, descending: catches index mix-ups


def _assert_pool_holds(pool: Pool, slots, k, v) -> None:
    for layer in range(LAYOUT.num_layers):
        assert np.array_equal(pool.k_buffer[layer][slots].numpy(), k[layer])
        assert np.array_equal(pool.v_buffer[layer][slots].numpy(), v[layer])


def test_verified_then_per_layer_waits_install_exact_kv(stored):
    client, codec, keys, k, v = stored
    pool = Pool()
    counter = attach_installs(pool, pool.writer, FP, RemoteKVMetrics())
    assert pool.layer_transfer_counter is counter
    be = InProcessFetchBackend(client, codec, FP, C)
    h = be.submit("r", keys, 0)
    assert h.verified.wait(30) and len(h.blobs) == N
    slots = _slots()
    counter.add(h, slots, codec)
    assert counter.busy()
    pool.get_key_buffer(0)  # the forward pass's first layer: only layer 0 needs to be in
    assert np.array_equal(pool.k_buffer[0][slots].numpy(), k[0])
    for layer in range(1, LAYOUT.num_layers):
        pool.get_key_buffer(layer)
    assert not counter.busy()
    _assert_pool_holds(pool, slots, k, v)
    be.close()


def _dead_handle(client, codec, keys, *, failure: str | None) -> FetchHandle:
    """A handle whose bytes were verified but whose backend then died (or stalls forever)."""
    h = FetchHandle("r", N, 0, C)
    blobs = client.get_many(keys)
    h._mark_verified(blobs, [codec.parse(b, FP) for b in blobs])
    if failure is not None:
        h._fail_from(0, failure)
        h._finish()
    return h


@pytest.mark.parametrize("failure", ["internal", None])
def test_backend_death_or_stall_after_admission_decodes_in_process(stored, failure):
    client, codec, keys, k, v = stored
    pool, metrics = Pool(), RemoteKVMetrics()
    counter = layerwise.LayerwiseInstalls(pool.writer, FP, metrics, stall_s=0.05)
    pool.register_layer_transfer_counter(counter)
    slots = _slots()
    counter.add(_dead_handle(client, codec, keys, failure=failure), slots, codec)
    t = threading.Thread(target=counter.finish_all)
    t.start()
    t.join(30)
    assert not t.is_alive() and not counter.busy()
    _assert_pool_holds(pool, slots, k, v)
    assert metrics.snapshot()["failures|kind=layerwise_fallback"] == 1


def test_partial_fetch_is_never_verified(stored):
    client, codec, keys, _, _ = stored
    be = InProcessFetchBackend(client, codec, FP, C)
    h = be.submit("r", keys[:2] + [bytes(32)], 0)  # third key never written
    assert h.wait(30) and h.ok_chunks == 2
    assert not h.verified.is_set() and h.blobs is None
    be.close()


def test_on_demand_decodes_each_layer_when_first_needed(stored):
    client, codec, keys, k, v = stored
    pool, metrics = Pool(), RemoteKVMetrics()
    counter = attach_installs(pool, pool.writer, FP, metrics)
    h = _dead_handle(client, codec, keys, failure=None)  # no worker at all: only the blobs
    slots = _slots()
    counter.add(h, slots, codec, on_demand=True)
    pool.get_key_buffer(1)
    assert np.array_equal(pool.k_buffer[1][slots].numpy(), k[1])
    assert not np.any(pool.k_buffer[2][slots].numpy())  # layer 2 not decoded yet
    counter.finish_all()
    _assert_pool_holds(pool, slots, k, v)
    assert "failures|kind=layerwise_fallback" not in metrics.snapshot()


def test_on_demand_decode_frees_no_buffer_inside_the_forward_pass(stored):
    """The in-forward decode reuses its K/V staging and scratch: a buffer freed between attention layers
    hands its codec bytes to the forward's next ``torch.empty`` (SGLang's torch_native padded query), and
    bytes that read as denormal floats made attention ~60x slower (docs/INTEGRATION.md, layer-wise)."""
    import tracemalloc

    client, codec, keys, k, v = stored
    pool, metrics = Pool(), RemoteKVMetrics()
    counter = attach_installs(pool, pool.writer, FP, metrics)
    counter.add(_dead_handle(client, codec, keys, failure=None), _slots(), codec, on_demand=True)
    counter.finish_all()  # the first install sizes the buffers
    slots = torch.arange(N * C)
    counter.add(_dead_handle(client, codec, keys, failure=None), slots, codec, on_demand=True)
    layer_kv_bytes = 2 * k[0].nbytes
    tracemalloc.start()
    try:
        for layer in range(LAYOUT.num_layers):  # what the forward pass does, layer by layer
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            pool.get_key_buffer(layer)
            _, peak = tracemalloc.get_traced_memory()
            assert peak - before < layer_kv_bytes, (layer, peak - before)
    finally:
        tracemalloc.stop()
    assert not counter.busy()
    _assert_pool_holds(pool, slots, k, v)


def test_outgrown_decode_buffers_are_zeroed_before_release():
    bufs = layerwise._DecodeBuffers(LAYOUT)
    k, v = bufs.kv(C)
    scratch = bufs.scratch(64)
    for a in (k, v, scratch):
        a.view(np.uint8)[:] = 0x01  # stand-in for codec bytes left in the buffer
    k2, _ = bufs.kv(2 * C)
    scratch2 = bufs.scratch(128)
    assert k2.shape[0] == 2 * C and scratch2.size >= 128
    assert not np.any(k) and not np.any(v) and not np.any(scratch)
    assert np.shares_memory(bufs.kv(C)[0], k2)  # a smaller request reuses the buffer, no realloc


def test_a_full_prefill_graph_replay_finds_every_layer_installed(stored):
    """``--cuda-graph-backend-prefill full`` replays attention without the pool accessors' per-layer
    waits; SGLang's runner (``PrefillCudaGraphRunner._wait_for_layer_loads``, run here as SGLang ships
    it) waits for all layers first, but only when the counter's ``consumer_index`` is >= 0. The replay
    then reads the pool's tensors directly, as the graph's kernels do."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    client, codec, keys, k, v = stored
    pool = Pool()
    counter = attach_installs(pool, pool.writer, FP, RemoteKVMetrics())
    runner = SimpleNamespace(_is_full_backend=True, model_runner=SimpleNamespace(token_to_kv_pool=pool))
    assert counter.consumer_index < 0  # nothing pending: the replay does not wait
    PrefillCudaGraphRunner._wait_for_layer_loads(runner)
    be = InProcessFetchBackend(client, codec, FP, C)
    h = be.submit("r", keys, 0)
    assert h.verified.wait(30)
    slots = _slots()
    counter.add(h, slots, codec)
    assert counter.consumer_index >= 0
    PrefillCudaGraphRunner._wait_for_layer_loads(runner)  # before the replay
    _assert_pool_holds(pool, slots, k, v)  # the replay's direct reads see every layer
    assert not counter.busy() and counter.consumer_index < 0
    be.close()
