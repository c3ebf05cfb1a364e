"""The write-back's device encode (issue 51): on a device pool (the strict CPU double of a CUDA device), a
``quant_*`` codec quantizes on the device's side stream and only codes and scales come back; the host runs
no quantizer (a counter proves it) and the blobs are byte-identical to a host encode of the same KV."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv import runtime
from sgl_remote_kv.codec import quant
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.kvpool.device_writer import DeviceKVWriter
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.writeback.worker import WriteBack
from tests.strict_device import StrictDevice, StrictKVPool

TD = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CH = 32


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


def _pool_with(dev, fp, k, v, slots):
    """A strict device pool holding ``k``, ``v`` ([L, T, H, D] storage dtype) at ``slots``."""
    lay = fp.layout
    pool = StrictKVPool(dev, lay, 256, TD[lay.dtype])
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, 10.0, ops=dev)
    assert isinstance(w, DeviceKVWriter)
    w.write(k, v, slots)
    return w


def _kv(fp, magnitudes: list[float], seed: int = 4):
    """[L, T, H, D] K and V in the storage dtype, chunk ``i`` of magnitude ``magnitudes[i]`` (zero rows too)."""
    lay = fp.layout
    rng = np.random.default_rng(seed)
    shape = (lay.num_layers, CH * len(magnitudes), lay.num_kv_heads, lay.head_dim)
    x = rng.standard_normal((2, *shape)).astype(np.float32)
    x *= np.repeat(np.asarray(magnitudes, np.float32), CH)[None, None, :, None, None]
    x[:, :, 5] = 0.0  # an all-zero token
    x[0, :, :CH, :, 3] *= 30  # an outlier key channel
    np.clip(x, -6e4, 6e4, out=x)  # finite in fp16
    return synthetic.from_f32(x[0], lay.dtype), synthetic.from_f32(x[1], lay.dtype)


def _request(n: int):
    return types.SimpleNamespace(
        rid="r",
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=list(range(100, 100 + n)),
    )


CODECS = {
    "quant_deflate token": ("quant_deflate", {"k_bins": "256@0,16@1", "v_bins": "96"}),
    "quant_deflate head+channel": ("quant_deflate", {"granularity": "head", "k_channel_scale": True}),
    "quant_rans": ("quant_rans", {"k_bins": "64", "v_bins": "32"}),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(CODECS))
def test_device_encode_is_byte_identical_and_runs_no_host_quantizer(dev, tmp_path, monkeypatch, name, dtype):
    fp = synthetic.fingerprint(num_layers=3, heads=2, dim=32, dtype=dtype)
    codec_name, params = CODECS[name]
    if codec_name == "quant_rans":
        codec = synthetic.fitted_rans_codec(fp, **params)
    else:
        codec = get_codec(codec_name, **params)
    k, v = _kv(fp, [1.0, 1e4, 1e-3])  # chunk 1 needs fp32 scales, chunk 2 is tiny
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(2))[: 3 * CH]
    writer = _pool_with(dev, fp, k, v, slots)
    want = [codec.encode(k[:, i * CH : (i + 1) * CH], v[:, i * CH : (i + 1) * CH], fp) for i in range(3)]

    calls = {"host quantize": 0}
    real = quant.quantize_layer

    def counted(*a, **kw):
        calls["host quantize"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(quant, "quantize_layer", counted)
    store = open_client(f"file://{tmp_path / 'store'}")
    keys = runtime.KeySpace(fp, codec, CH)
    r2t = types.SimpleNamespace(req_to_token=slots[None, :].clone())
    wb = WriteBack(codec, fp, store, keys, RemoteKVMetrics(), writer, WriteBackRequests(r2t), 1 << 30)
    assert wb.device_encode
    req = _request(3 * CH)
    wb.offer(req, 3 * CH)
    assert wb.flush(30)
    assert calls["host quantize"] == 0 and writer.stats["device_encode"] == 1
    got = store.get_many(keys.keys_for(req.full_untruncated_fill_ids, 3, None))
    assert got == want  # byte for byte what the host encode makes
    q = writer.read_quantized_later(slots, codec.spec, CH).result()
    assert q.f16[0].tolist() == [1, 0, 1]  # the chunks cover both scale dtypes
    wb.close()


def test_non_finite_kv_fails_that_write_back_as_on_the_host(dev, tmp_path) -> None:
    fp = synthetic.fingerprint(num_layers=2, heads=2, dim=32, dtype="float16")
    codec = get_codec("quant_deflate")
    k, v = synthetic.kv(fp.layout, CH, seed=1)
    k[1, 3, 0, 0] = np.float16(np.inf)
    slots = torch.arange(CH)
    writer = _pool_with(dev, fp, k, v, slots)
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(k, v, fp)
    q = writer.read_quantized_later(slots, codec.spec, CH).result()
    assert not q.finite[1, 0] and q.finite[0, 0]
    with pytest.raises(ValueError, match="layer 1: non-finite"):
        codec.encode_quantized(q, 0, fp)


def test_codecs_without_a_device_quantizer_keep_the_host_encode(dev) -> None:
    assert get_codec("quant_deflate").device_encode
    assert not get_codec("quant_deflate", k_outliers=4).device_encode  # outlier channels: host
    assert not getattr(get_codec("lossless"), "device_encode", False)
    host = writer_for(
        PoolTensors([torch.zeros(8, 2, 4)], [torch.zeros(8, 2, 4)]),
        synthetic.fingerprint(1, 2, 4, "float32").layout,
    )
    assert host.read_quantized_later(torch.arange(4), get_codec("quant_deflate").spec, 4) is None
