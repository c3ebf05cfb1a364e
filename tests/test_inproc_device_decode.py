"""The in-process path on a *device* pool (strict CUDA double, ``strict_device.py``): workers run only the
codec's lossless stage, the pool's ``KVWriter`` dequantizes on the device (``kernels/dequant.py``'s
definition) and scatters; real embedded store, real quantized codec, real ``InProcessFetchBackend`` and
``LayerwiseInstalls`` (on-demand decode in the forward thread). The pool must hold exactly what the
codec's own CPU decode gives, and reads go through the completion-event rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from strict_device import StrictDevice, StrictKVPool

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.kvpool import KVWriteError, PoolTensors, writer_for
from sgl_remote_kv.sglang_glue import layerwise
from sgl_remote_kv.sglang_glue.fetch import FetchHandle, InProcessFetchBackend
from sgl_remote_kv.sglang_glue.metrics import RemoteKVMetrics
from sgl_remote_kv.store.client import open_client

C, N = 16, 3
FP = synthetic.fingerprint(num_layers=3, dtype="bfloat16")
LAY = FP.layout


@pytest.fixture
def stored(tmp_path):
    client = open_client(f"file://{tmp_path / 'store'}")
    codec = get_codec("quant_deflate", k_bins="256", v_bins="96", granularity="token")
    keys = [bytes([i]) * 32 for i in range(N)]
    blobs = [codec.encode(*synthetic.kv(LAY, C, seed=i), FP) for i in range(N)]
    client.put_many(list(zip(keys, blobs, strict=True)))
    ref = [codec.decode(b, FP) for b in blobs]
    k = np.concatenate([r[0] for r in ref], axis=1)
    v = np.concatenate([r[1] for r in ref], axis=1)
    yield client, codec, keys, k, v
    client.close()


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
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    be.close()


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
    counter = layerwise.attach(kv, w, FP, RemoteKVMetrics())
    h = FetchHandle("r", N, 0, C)
    blobs = client.get_many(keys)
    h._mark_verified(blobs, [codec.parse(b, FP) for b in blobs])
    slots = torch.randperm(128)[: N * C]
    counter.add(h, slots, codec, on_demand=True)
    kv.get_key_buffer(1)  # waits for (decodes + fences) layers 0 and 1; strict read check passes
    assert w.stats["device_dequant"] == 2 * N  # one per chunk and layer so far
    counter.finish_all()
    rk, rv = w.read(slots)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
