"""The in-process path on a *device* pool (strict CUDA double, ``strict_device.py``): workers run only the
codec's lossless stage, the pool's ``KVWriter`` dequantizes on the device (``kernels/dequant.py``'s and
``kernels/transform.py``'s torch definitions) and scatters; real embedded store, real quantized and
transform codecs, real ``InProcessFetchBackend`` and ``LayerwiseInstalls`` (on-demand decode in the forward
thread). The pool must hold what the codec's own CPU decode gives (exactly for the quantized codec; for
the transform codec up to float32 summation order: at most one bf16 step on a few values), and reads go
through the completion-event rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from calibration_helpers import device_decode_codec, layer_views
from pool_fake import attach_installs
from strict_device import StrictDevice, StrictKVPool

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec import quant
from sgl_remote_kv.fetch.base import FetchHandle
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.kvpool import KVWriteError, PoolTensors, device_writer, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.store.client import open_client

C, N = 16, 3
FP = synthetic.fingerprint(num_layers=3, dtype="bfloat16")
LAY = FP.layout


@pytest.fixture(params=["quant_deflate", "transform", "transform_trellis", "transform_trellis_zstd"])
def stored(tmp_path, request):
    client, codec, keys, k, v = _store(tmp_path, request.param)
    yield client, codec, keys, k, v
    client.close()


def _store(tmp_path, kind: str):
    client = open_client(f"file://{tmp_path / 'store'}")
    codec = device_decode_codec(kind, FP)  # transform: escapes and an exact sink token (chunk 0) on this KV
    keys = [bytes([i]) * 32 for i in range(N)]
    blobs = [codec.encode(*synthetic.kv(LAY, C, seed=i), FP, start=i * C) for i in range(N)]
    client.put_many(list(zip(keys, blobs, strict=True)))
    ref = [codec.decode(b, FP) for b in blobs]
    k = np.concatenate([r[0] for r in ref], axis=1)
    v = np.concatenate([r[1] for r in ref], axis=1)
    return client, codec, keys, k, v


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


def _device_pool(dev):
    kv = StrictKVPool(dev, LAY, 128, torch.bfloat16)
    return kv, writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), LAY, ops=dev)


def test_codes_staged_and_dequantized_on_the_device(stored, dev):
    client, codec, keys, k, v = stored
    kv, w = _device_pool(dev)
    assert w.device_dequant
    be = InProcessFetchBackend(client, codec, FP, C, keep_codes=w.device_dequant)
    h = be.submit("r", keys, start_token=0)
    assert h.wait(30) and h.failure is None and h.ok_chunks == N
    assert h.k is None and len(h.codes) == LAY.num_layers and len(h.codes[0]) == N  # codes, not KV
    slots = torch.randperm(128)[: N * C]
    h.write_staged(w, slots, N * C)
    assert w.stats["device_dequant"] == LAY.num_layers  # one device write per layer
    rk, rv = w.read(slots)
    _assert_decoded(codec, rk, k)
    _assert_decoded(codec, rv, v)
    be.close()


def _assert_decoded(codec, got: np.ndarray, want: np.ndarray) -> None:
    if codec.name != "transform":
        np.testing.assert_array_equal(got, want)
        return
    g, w = quant.to_f32(got, LAY.dtype), quant.to_f32(want, LAY.dtype)
    diff = np.abs(g - w)
    # at most one bf16 step (of the larger of the two: a step across a power of two is the upper one's), or
    # float32 rounding near zero (the GEMM's sums cancel: 1e-5 of the largest value)
    tol = np.maximum(np.abs(g), np.abs(w)) * 2.0**-7 + 1e-5 * np.abs(w).max()
    assert np.all(diff <= tol), float((diff - tol).max())
    assert np.mean(got != want) < 0.01


def test_transform_views_have_escapes_and_sinks(tmp_path):
    """The transform parameters above exercise the device path's escapes and sink tokens."""
    client, codec, keys, _, _ = _store(tmp_path, "transform")
    blobs = client.get_many(keys)
    client.close()
    views = [
        codec.codes_stage(
            b, codec.parse(b, FP), 1, np.empty(codec.scratch_bytes(codec.parse(b, FP), 1), np.uint8)
        )
        for b in blobs
    ]
    assert views[0].n_sink == 1 and all(vw.n_sink == 0 for vw in views[1:])
    assert sum(vw.esc.size for vw in views) > 0 and all(vw.escapes_consistent() for vw in views)


def test_a_failing_device_is_a_write_error_for_the_install(stored, dev):
    client, codec, keys, _, _ = stored
    _, w = _device_pool(dev)
    be = InProcessFetchBackend(client, codec, FP, C, keep_codes=True)
    h = be.submit("r", keys, start_token=0)
    assert h.wait(30)
    dev.error = RuntimeError("an illegal memory access was encountered")
    with pytest.raises(KVWriteError):
        h.write_staged(w, torch.randperm(128)[: N * C], N * C)
    be.close()


def test_layerwise_on_demand_decode_dequantizes_on_the_device(stored, dev):
    client, codec, keys, k, v = stored
    kv, w = _device_pool(dev)
    counter = attach_installs(kv, w, FP, RemoteKVMetrics())
    h = FetchHandle("r", N, 0, C)
    blobs = client.get_many(keys)
    h._mark_verified(blobs, [codec.parse(b, FP) for b in blobs])
    slots = torch.randperm(128)[: N * C]
    counter.add(h, slots, codec, on_demand=True)
    kv.get_key_buffer(1)  # waits for (decodes + fences) layers 0 and 1; strict read check passes
    assert w.stats["device_dequant"] == 2 * N  # one per chunk and layer so far
    counter.finish_all()
    rk, rv = w.read(slots)
    _assert_decoded(codec, rk, k)
    _assert_decoded(codec, rv, v)


def test_transform_constants_are_not_replaced_under_a_late_write(tmp_path, dev):
    """A timed-out device write may still read the transform constants it was given: while one is
    pending, the constants cache is not cleared (a write that would need it to be is a failed write);
    once the late work completed, it is."""
    client, codec, keys, _, _ = _store(tmp_path, "transform")
    kv = StrictKVPool(dev, LAY, 128, torch.bfloat16)
    w = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), LAY, ops=dev, timeout_s=0.2)
    blob = client.get_many(keys[:1])[0]
    client.close()
    hdr = codec.parse(blob, FP)

    def write(layer):
        vw = codec.codes_stage(blob, hdr, layer, np.empty(codec.scratch_bytes(hdr, layer), np.uint8))
        w.write_quantized([vw], torch.arange(C), layer)

    dev.hang()
    with pytest.raises(KVWriteError, match="not done"):
        write(0)  # times out: its inverse transform is still queued on the device
    w._consts.update(
        {("another calibration", i): None for i in range(device_writer.CONSTS_PER_LAYER * LAY.num_layers)}
    )  # full
    with pytest.raises(KVWriteError, match="not replacing constants"):
        write(1)
    dev.resume()
    dev.synchronize()
    write(1)  # the late write completed: the cache may be replaced now
    assert ("another calibration", 0) not in w._consts


def test_a_layer_s_chunks_decode_in_one_call_per_length(dev, monkeypatch):
    """The device writer hands a layer's transform chunks to the device in one ``inverse_transform`` per run
    of equal length (here 16, 16, 16 then an 8-token tail: two calls), and the pool holds what the host
    decodes."""
    codec = device_decode_codec("transform_trellis", FP)
    kv, w = _device_pool(dev)
    blobs = [
        codec.encode(*synthetic.kv(LAY, n, seed=i), FP, start=16 * i) for i, n in enumerate((16, 16, 16, 8))
    ]
    calls: list[int] = []
    real = dev.inverse_transform

    def spy(syms, *a, **kw):
        calls.append(len(syms))
        return real(syms, *a, **kw)

    monkeypatch.setattr(dev, "inverse_transform", spy)
    slots = torch.randperm(128)[:56]
    for layer in range(LAY.num_layers):
        w.write_quantized(layer_views(codec, FP, blobs, layer), slots, layer)
    assert calls == [3, 1] * LAY.num_layers
    ref = [codec.decode(b, FP) for b in blobs]
    rk, rv = w.read(slots)
    _assert_decoded(codec, rk, np.concatenate([r[0] for r in ref], axis=1))
    _assert_decoded(codec, rv, np.concatenate([r[1] for r in ref], axis=1))
