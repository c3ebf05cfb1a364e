"""The one KV writer (``sgl_remote_kv.kvpool``): host pools, and the device writer's code against the strict
CPU double of a CUDA device (``tests/strict_device.py``), which enforces CUDA's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sgl_remote_kv.kvpool import KVWriteError, PoolTensors, writer_for
from sgl_remote_kv.kvpool.device_writer import DeviceKVWriter
from sgl_remote_kv.kvpool.writer import HostKVWriter
from sgl_remote_kv.types import KVLayout, numpy_storage_dtype
from tests.strict_device import StrictDevice, StrictKVPool, UnfencedRead, UnorderedWrite

LAY = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _kv(layout: KVLayout, n_layers: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (n_layers, t, layout.num_kv_heads, layout.head_dim)
    f = rng.standard_normal((2, *shape)).astype(np.float32)
    if layout.dtype == "bfloat16":
        f = (f.view(np.uint32) >> 16).astype(np.uint16)
    else:
        f = f.astype(numpy_storage_dtype(layout.dtype))
    return f[0], f[1]


def _slots(n: int, pool: int, seed: int = 1) -> torch.Tensor:
    return torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:n].to(torch.int64)


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


def _strict(dev, layout=LAY, pool=64, timeout_s=10.0):
    kv = StrictKVPool(dev, layout, pool, TD[layout.dtype])
    w = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), layout, timeout_s, ops=dev)
    assert isinstance(w, DeviceKVWriter)
    return kv, w


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_host_writer_round_trip(dtype):
    lay = KVLayout(3, 2, 8, dtype)
    k_pool = [torch.zeros(40, 2, 8, dtype=TD[dtype]) for _ in range(3)]
    v_pool = [torch.zeros(40, 2, 8, dtype=TD[dtype]) for _ in range(3)]
    w = writer_for(PoolTensors(k_pool, v_pool), lay)
    assert isinstance(w, HostKVWriter)
    k, v = _kv(lay, 2, 5)
    s = _slots(5, 40)
    w.write(k, v, s, layer_lo=1)
    rk, rv = w.read(s)
    np.testing.assert_array_equal(rk[1:], k)
    np.testing.assert_array_equal(rv[1:], v)
    assert not rk[0].any() and not rv[0].any()  # layer 0 untouched


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("pinned", [False, True])
def test_device_writer_round_trip_under_strict_rules(dev, dtype, pinned):
    lay = KVLayout(3, 2, 8, dtype)
    kv, w = _strict(dev, lay)
    region = np.zeros(2 * 3 * 7 * 2 * 8, numpy_storage_dtype(dtype))
    if pinned:
        w.register_host(region)
    k, v = _kv(lay, 3, 7)
    half = region.size // 2
    region[:half].reshape(k.shape)[...] = k  # the source lives in the (pinned) region, like the DPU's
    region[half:].reshape(v.shape)[...] = v
    s = _slots(7, 64)
    w.write(region[:half].reshape(k.shape), region[half:].reshape(v.shape), s)
    assert w.stats["zero_copy" if pinned else "staged"] == 1
    region[...] = 0  # the source may be reused once write() returned
    for layer in range(3):
        w.wait_layer(layer)
        got = kv.get_key_buffer(layer)[s]  # strict read: fenced by wait_layer
        assert torch.equal(got.cpu(), torch.from_numpy(k[layer]).view(TD[dtype]))
    rk, rv = w.read(s)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    if pinned:
        w.unregister_host(region)
        assert dev.pinned == []


def test_strict_double_refuses_the_old_dpu_scatter(dev):
    """The DPU path's old scatter (``kernels.scatter.scatter_reference`` on a host source, the only path
    a host shared-memory region could reach): ``pool[layer][slots] = host_src[layer]``. CUDA rejects it;
    a CPU pool accepted it, which is how the bug hid. The strict double rejects it like CUDA."""
    kv = StrictKVPool(dev, LAY, 64, torch.bfloat16)
    k, _ = _kv(LAY, 3, 4)
    src = torch.from_numpy(k).view(torch.bfloat16)
    s = _slots(4, 64)
    with pytest.raises(RuntimeError, match="same device"):
        for layer, dst in enumerate(kv.k_buffer):  # the old code, verbatim
            dst[s] = src[layer].to(dst.dtype)
    with pytest.raises(TypeError, match="numpy"):  # the old CPU fast path (numpy views) cannot apply
        kv.k_buffer[0].numpy()


def test_strict_double_refuses_device_writes_off_the_stream(dev):
    kv = StrictKVPool(dev, LAY, 64, torch.bfloat16)
    d = dev.tensor(torch.zeros(4, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(UnorderedWrite):
        kv.k_buffer[0][_slots(4, 64)] = d


def test_read_before_the_completion_event_is_refused(dev):
    """Enqueue a scatter without waiting: reading the plane is refused until the reader waited on an
    event recorded after the write (what ``DeviceKVWriter.wait_layer`` does)."""
    kv = StrictKVPool(dev, LAY, 64, torch.bfloat16)
    dev.hang()
    s = dev.tensor(_slots(4, 64))
    src = dev.tensor(torch.ones(1, 4, 2, 8, dtype=torch.bfloat16))
    dev.scatter(src, [kv.k_buffer[1]], s)
    ev = dev.record()
    with pytest.raises(UnfencedRead):
        kv.get_key_buffer(1)
    with pytest.raises(UnfencedRead):
        kv.k_buffer[1][s]
    kv.get_key_buffer(0)  # other layers are readable
    dev.resume()
    dev.stream_wait(ev)
    assert kv.get_key_buffer(1)[s].float().eq(1).all()


def test_writer_timeout_is_a_failed_write_and_later_readers_stay_ordered(dev):
    kv, w = _strict(dev, timeout_s=0.2)
    k, v = _kv(LAY, 3, 4)
    s = _slots(4, 64)
    dev.hang()
    with pytest.raises(KVWriteError, match="not done"):
        w.write(k, v, s)
    assert w.stats["timeouts"] == 1
    with pytest.raises(UnfencedRead):  # the late scatter is still pending: no reader may pass
        kv.get_key_buffer(0)
    dev.resume()
    w.fence()
    kv.get_key_buffer(0)


def test_bad_input_is_a_clear_write_error(dev):
    _, w = _strict(dev)
    k, v = _kv(LAY, 3, 4)
    with pytest.raises(KVWriteError, match="slots"):
        w.write(k, v, _slots(3, 64))
    with pytest.raises(KVWriteError, match="outside the pool"):
        w.write(k, v, _slots(4, 64), layer_lo=1)
    with pytest.raises(KVWriteError, match="dtype"):
        w.write(k.astype(np.float32), v.astype(np.float32), _slots(4, 64))


def test_staging_source_reused_too_early_would_be_caught(dev):
    """Negative control for the double: an H2D copy reads its source when the stream runs it, so a
    source overwritten before completion lands as wrong KV (the writer waits; this bypass does not)."""
    dev.hang()
    host = torch.ones(16, dtype=torch.uint8)
    dst = dev.device_empty(16)
    dev.upload(dst, host)
    host.zero_()
    dev.resume()
    dev.synchronize()
    assert dst.cpu().sum().item() == 0


def test_only_the_writer_touches_the_pool_tensors():
    """Every write (and the write-back's read) of token KV goes through ``kvpool``: outside it, only the
    SGLang seam (``sglang_glue/seam.py``: pool layout + building the writer) names SGLang's per-layer
    tensors, and nothing else in the package uses a tensor scatter/copy op that could write them."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shipped = [p for d in ("sgl_remote_kv", "dpu", "nvdec", "kernels") for p in (root / d).rglob("*.py")]
    allowed_names = {root / "sgl_remote_kv/sglang_glue/seam.py", root / "kernels/scatter.py"}
    pool_names = re.compile(r"\b[kv]_buffer\b")
    writes = re.compile(r"\.(index_copy_|index_put_|index_put|scatter_|copy_)\(")
    offenders = []
    for p in shipped:
        text = p.read_text()
        if "kvpool" in p.parts:
            continue
        if p not in allowed_names and pool_names.search(text):
            offenders.append(f"{p.relative_to(root)} names k_buffer/v_buffer")
        if writes.search(text):
            offenders.append(f"{p.relative_to(root)} uses an in-place tensor write op")
    assert not offenders, offenders
    assert len(shipped) > 50  # the walk found the package


def _views(codec, fp, chunks, layer):
    """The lossless stage's output (``LayerView``) of ``layer`` for each encoded chunk."""
    from sgl_remote_kv.codec.format import parse_header

    out = []
    for k, v in chunks:
        blob = codec.encode(k, v, fp)
        hdr = parse_header(blob, fp)
        out.append(codec.codes_stage(blob, hdr, layer, np.empty(codec.scratch_bytes(hdr, layer), np.uint8)))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "params",
    [
        {"k_bins": "256", "v_bins": "96", "granularity": "token"},
        {"k_bins": "64", "granularity": "head", "k_channel_scale": True},
        {"k_bins": "64", "granularity": "token", "k_outliers": 2},  # outliers: host dequant fallback
    ],
)
def test_write_quantized_device_equals_host_dequant(dev, dtype, params):
    """The device writer dequantizes on the device (kernels/dequant.py's definition); the host writer with
    the CPU codec path (numba). Both must put the same bits into the pool as the codec's own decode."""
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec

    fp = synthetic.fingerprint(num_layers=2, dtype=dtype)
    lay = fp.layout
    codec = get_codec("quant_deflate", **params)
    chunks = [synthetic.kv(lay, 33, seed=s) for s in (1, 2)]
    s = _slots(66, 128)
    host = writer_for(
        PoolTensors(
            *[
                [torch.zeros(128, lay.num_kv_heads, lay.head_dim, dtype=TD[dtype]) for _ in range(2)]
                for _ in "kv"
            ]
        ),
        lay,
    )
    kv, w = _strict(dev, lay, pool=128)
    for layer in range(2):
        views = _views(codec, fp, chunks, layer)
        host.write_quantized(views, s, layer)
        w.write_quantized(views, s, layer)
    hk, hv = host.read(s)
    dk, dv = w.read(s)
    np.testing.assert_array_equal(dk, hk)
    np.testing.assert_array_equal(dv, hv)
    ref = [codec.decode(codec.encode(k, v, fp), fp) for k, v in chunks]
    np.testing.assert_array_equal(hk, np.concatenate([r[0] for r in ref], axis=1))
    np.testing.assert_array_equal(hv, np.concatenate([r[1] for r in ref], axis=1))
    assert w.stats["writes"] == 2
    assert w.stats["device_dequant"] == (0 if params.get("k_outliers") else 2)


def test_write_quantized_bad_input_is_a_write_error(dev):
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec

    fp = synthetic.fingerprint(num_layers=2, dtype="float16")
    codec = get_codec("quant_deflate", k_bins="64", granularity="token")
    views = _views(codec, fp, [synthetic.kv(fp.layout, 8, seed=3)], 0)
    _, w = _strict(dev, fp.layout, pool=32)
    with pytest.raises(KVWriteError, match="slots"):
        w.write_quantized(views, _slots(7, 32), 0)


def test_device_writer_odd_sizes_keep_the_slot_index_aligned(dev):
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=3, dtype="float16")  # 60 bytes of K+V
    kv, w = _strict(dev, lay, pool=16)
    k, v = _kv(lay, 1, 5)
    s = _slots(5, 16)
    w.write(k, v, s, layer_lo=1)
    rk, rv = w.read(s)
    np.testing.assert_array_equal(rk[1:], k)
    np.testing.assert_array_equal(rv[1:], v)


def test_device_writer_splits_large_writes_into_bounded_pieces(dev, monkeypatch):
    """Large writes go in pieces (tokens per launch and bytes per piece bounded), exact all the same."""
    from sgl_remote_kv.kvpool import device_writer

    monkeypatch.setattr(device_writer, "MAX_TOKENS", 4)
    monkeypatch.setattr(device_writer, "MAX_PIECE_BYTES", 2 * 4 * 2 * 8 * 2)  # one layer of 4 tokens
    kv, w = _strict(dev)
    k, v = _kv(LAY, 3, 10)
    s = _slots(10, 64)
    w.write(k, v, s)
    assert w.stats["writes"] == 3 * 3  # 3 token pieces (4, 4, 2) x 3 layers
    rk, rv = w.read(s)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_read_later_gathers_on_the_side_stream_into_pinned_host_memory(dev, dtype):
    """The write-back's read (``readback.py``): one async D2H per plane on the writer's stream, ordered
    after the fetched writes enqueued there; the result is the pool's KV at the slots."""
    lay = KVLayout(3, 2, 8, dtype)
    kv, w = _strict(dev, lay)
    k, v = _kv(lay, 3, 9)
    s = _slots(9, 64)
    w.write(k, v, s)
    pending = w.read_later(s)
    rk, rv = pending.result()
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    assert rk.shape == (3, 9, 2, 8) and rk.dtype == numpy_storage_dtype(dtype)


def test_a_read_that_does_not_complete_is_a_write_error_not_stale_data():
    from sgl_remote_kv.kvpool.writer import PendingRead

    z = np.zeros((1, 1, 1, 1), np.float32)
    with pytest.raises(KVWriteError, match="not done in time"):
        PendingRead(z, z, lambda: False).result()
    assert PendingRead(z, z + 1, lambda: True).result()[1][0, 0, 0, 0] == 1


def test_codes_in_the_pinned_region_are_uploaded_from_where_they_lie(dev):
    """DPU output ``codes``: the lossless stage's output sits in the pinned destination region; the writer
    uploads it from there (no host re-copy), and pieces staged around it never overwrite it on the device
    (chunks 0 and 2 staged, chunk 1 in the region)."""
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.codec.format import parse_header

    fp = synthetic.fingerprint(num_layers=2, dtype="float16")
    lay = fp.layout
    codec = get_codec("quant_deflate", k_bins="64", granularity="token")
    chunks = [synthetic.kv(lay, 16, seed=s) for s in (5, 6, 7)]
    region = np.zeros(1 << 16, np.uint8)
    kv, w = _strict(dev, lay, pool=64)
    w.register_host(region)
    views = []
    for i, (k, v) in enumerate(chunks):
        blob = codec.encode(k, v, fp)
        hdr = parse_header(blob, fp)
        n = codec.scratch_bytes(hdr, 0)
        out = region[:n] if i == 1 else np.empty(n, np.uint8)
        views.append(codec.codes_stage(blob, hdr, 0, out))
    s = _slots(48, 64)
    w.write_quantized(views, s, 0)
    assert w.stats["zero_copy_parts"] >= 2  # chunk 1's K and V codes
    rk, rv = w.read(s)
    ref = [codec.decode(codec.encode(k, v, fp), fp) for k, v in chunks]
    np.testing.assert_array_equal(rk[0], np.concatenate([r[0][0] for r in ref]))
    np.testing.assert_array_equal(rv[0], np.concatenate([r[1][0] for r in ref]))
    w.unregister_host(region)


@pytest.mark.parametrize("batch_bytes", [1 << 30, 1])
@pytest.mark.parametrize("codec_name", ["quant_deflate", "transform"])
def test_an_install_of_all_layers_waits_once_and_stays_exact(dev, monkeypatch, batch_bytes, codec_name):
    """``write_quantized_layers`` (the in-process install on the scheduler thread): each layer's staging
    lies after the previous layer's (the strict double's copies read their source late, so reused staging
    would put the wrong layer's KV in the pool); one host wait per batch, or per layer once the batch's
    staging is used up."""
    from calibration_helpers import make_calibration

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.types import RopeSpec

    fp = synthetic.fingerprint(num_layers=4, dtype="bfloat16")
    lay = fp.layout
    if codec_name == "transform":
        cal = make_calibration(fp, rope=RopeSpec(10000.0, lay.head_dim, "neox"))
        codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.0005")
    else:
        codec = get_codec("quant_deflate", k_bins="64", granularity="token")
    chunks = [synthetic.kv(lay, 32, seed=s) for s in (8, 9)]
    s = _slots(64, 128)
    kv, w = _strict(dev, lay, pool=128)
    w.staging.batch_bytes = batch_bytes
    waits = []
    real_wait = w._wait_host
    monkeypatch.setattr(w, "_wait_host", lambda ev: waits.append(ev) or real_wait(ev))
    w.write_quantized_layers([_views(codec, fp, chunks, layer) for layer in range(4)], s)
    assert len(waits) == (1 if batch_bytes > 1 else 4) and w.stats["device_dequant"] == 4
    rk, rv = w.read(s)
    ref = [codec.decode(codec.encode(k, v, fp), fp) for k, v in chunks]
    want_k = np.concatenate([r[0] for r in ref], axis=1)
    want_v = np.concatenate([r[1] for r in ref], axis=1)
    if codec_name == "transform":  # the device inverse transform: within one bf16 step of the CPU decode
        from sgl_remote_kv.codec import quant

        for got, want in ((rk, want_k), (rv, want_v)):
            g, wnt = quant.to_f32(got, "bfloat16"), quant.to_f32(want, "bfloat16")
            assert np.all(np.abs(g - wnt) <= np.abs(wnt) * 2.0**-7 + 1e-6)
    else:
        np.testing.assert_array_equal(rk, want_k)
        np.testing.assert_array_equal(rv, want_v)
