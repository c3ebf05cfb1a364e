"""The write-back's device encode of the transform codec (issue 51): on a device pool (the strict CPU double of
a CUDA device) RoPE undo, the forward transform, token scales and the quantizer (scalar or trellis) run on the
device's side stream; the host runs neither transform nor quantizer (counters prove it) and only entropy-codes.
The blobs decode with the same decoder to the KV a host encode's blobs decode to, within float32 rounding."""

from __future__ import annotations

import types

import calibration_helpers
import numpy as np
import pytest
import torch
from sgl_remote_kv.kernels.transform_encode import trellis_rates, trellis_search_reference

from sgl_remote_kv import runtime
from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec import transform_ops, trellis
from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.codec.transform import TransformCodec
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint, RopeSpec
from sgl_remote_kv.writeback.worker import WriteBack
from tests.strict_device import StrictDevice, StrictKVPool

L, H, D, CH = 3, 2, 16, 32
TD = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _fp(dtype: str) -> ModelFingerprint:
    return ModelFingerprint("Llama", KVLayout(L, H, D, dtype), "w", 0, 1)


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


@pytest.fixture
def cal():
    c = calibration_helpers.make_calibration(
        _fp("float32"), ("0.0005", "0.001"), 0.02, 0, RopeSpec(10000.0, D, "neox"), 1, sinks=3
    )
    yield c
    cm.unregister(c.calib_id)


def _kv(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((L, n * CH, H, D)).astype(np.float32) for _ in range(2))
    k[:, 7] *= 1e3  # a token whose scale does not fit the log grid's range: fp16 scales for its chunk
    return k, v


def _stored(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


def test_the_trellis_search_on_the_device_picks_the_host_search_s_codes() -> None:
    rng = np.random.default_rng(0)
    y = rng.standard_normal((2, 48, 8)).astype(np.float32)
    steps = np.full((2, 8), 0.05, np.float32)
    scale = (np.abs(rng.standard_normal(48)) + 0.5).astype(np.float32)
    scale[0] = 0.0  # an exact sink token
    sym, esc = np.empty((16, 48), np.uint8), np.empty(1000, np.int16)
    assert trellis.quantize(y, steps, scale, trellis.DELTA, trellis.LAMBDA, sym, esc) == 0
    u = (
        torch.from_numpy(y).double()
        / torch.from_numpy(steps).double()[:, None]
        / torch.from_numpy(scale).double()[:, None]
    )
    u = torch.nan_to_num(u, 0.0, 0.0, 0.0).permute(0, 2, 1).reshape(16, 48)
    live = torch.from_numpy(scale > 0)[None].expand(16, 48)
    assert np.array_equal(
        trellis_search_reference(u, live, *trellis_rates(u)).numpy(), sym.astype(np.int64) - 128
    )


@pytest.mark.parametrize("quantizer", ["scalar", "trellis"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_encode_runs_no_host_transform_or_quantizer_and_decodes_as_the_host_s(
    dev, cal, tmp_path, monkeypatch, quantizer, dtype
):
    fp = _fp(dtype)
    codec = TransformCodec(cal.calib_id.hex(), "0.0005", "deflate", quantizer=quantizer)
    assert codec.device_encode
    n = 3
    k32, v32 = _kv(n)
    k, v = _stored(k32, dtype), _stored(v32, dtype)
    want = [
        codec.encode(
            np.ascontiguousarray(k[:, j * CH : (j + 1) * CH]),
            np.ascontiguousarray(v[:, j * CH : (j + 1) * CH]),
            fp,
            start=j * CH,
        )
        for j in range(n)
    ]
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(2))[: n * CH]
    pool = StrictKVPool(dev, fp.layout, 256, TD[dtype])
    writer = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), fp.layout, 10.0, ops=dev)
    writer.write(k, v, slots)

    calls = {"forward": 0, "quantize": 0, "trellis": 0}
    for mod, name, key in (
        (transform_ops, "forward", "forward"),
        (transform_ops, "quantize", "quantize"),
        (trellis, "quantize", "trellis"),
    ):
        real = getattr(mod, name)
        monkeypatch.setattr(
            mod,
            name,
            lambda *a, _r=real, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1), _r(*a, **kw))[1],
        )
    store = open_client(f"file://{tmp_path / 'store'}")
    keys = runtime.KeySpace(fp, codec, CH)
    r2t = types.SimpleNamespace(req_to_token=slots[None, :].clone())
    wb = WriteBack(codec, fp, store, keys, RemoteKVMetrics(), writer, WriteBackRequests(r2t), 1 << 30)
    ids = list(range(100, 100 + n * CH))
    req = types.SimpleNamespace(
        rid="r",
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=ids,
    )
    wb.offer(req, n * CH)
    assert wb.flush(60)
    wb.close()
    assert calls == {"forward": 0, "quantize": 0, "trellis": 0} and writer.stats["device_encode"] == 1
    got = store.get_many(keys.keys_for(ids, n, None))
    assert all(b is not None for b in got)
    q = writer.read_quantized_later(slots, codec.device_encode_spec(fp), CH, 0).result()
    assert set(q.fmt[0].tolist()) == {transform_ops.SCALE_FP16, transform_ops.SCALE_LOG8}  # both scale forms
    assert q.nesc.sum() > 0 and q.sinks.shape[2] == cal.sinks  # escapes and exact sinks were exercised
    for j in range(n):
        (hk, hv), (dk, dv) = decode(want[j], fp), decode(got[j], fp)
        if j == 0:  # the sink positions are stored exactly by both
            assert np.array_equal(dk[:, : cal.sinks], k[:, : cal.sinks]) and np.array_equal(
                dk[:, : cal.sinks], hk[:, : cal.sinks]
            )
        for x, a, b in ((k32, hk, dk), (v32, hv, dv)):
            x = x[:, j * CH : (j + 1) * CH]
            err_host, err_dev = (float(np.sqrt(np.mean((_f32(y) - x) ** 2))) for y in (a, b))
            apart = float(np.sqrt(np.mean((_f32(a) - _f32(b)) ** 2)))
            # the same codes but for float32 rounding at a quantizer's boundary: as close to the KV, and far closer
            # to each other than to it
            assert err_dev <= 1.001 * err_host and apart <= 1e-3 * err_host


def _f32(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x.astype(np.float32)


def test_a_chunk_the_device_cannot_code_fails_its_encode_as_on_the_host(dev, cal) -> None:
    """Non-finite KV (flagged on the device), or more escapes than the device kept: ``encode_quantized`` raises
    the host encode's ``ValueError`` for that chunk, so the write-back stores nothing of it."""
    fp = _fp("float32")
    codec = TransformCodec(cal.calib_id.hex(), "0.0005", "deflate")
    k, v = _kv(2)
    k[1, CH + 3, 0, 0] = np.inf  # layer 1 of chunk 1
    slots = torch.arange(2 * CH)
    pool = StrictKVPool(dev, fp.layout, 64, torch.float32)
    writer = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), fp.layout, 10.0, ops=dev)
    writer.write(k, v, slots)
    q = writer.read_quantized_later(slots, codec.device_encode_spec(fp), CH, 0).result()
    assert q.bad[:, 0].tolist() == [0, 0, 0] and q.bad[:, 1].tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="layer 1: KV too far"):
        codec.encode_quantized(q, 1, fp)
    codec.encode_quantized(q, 0, fp)  # the other chunk is fine
    q.nesc[2, 0, 0] = q.esc.shape[-1] + 1  # as if the device found more escapes than it kept
    with pytest.raises(ValueError, match="layer 2: KV too far"):
        codec.encode_quantized(q, 0, fp)
