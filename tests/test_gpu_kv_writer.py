"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): the KV writer on a real CUDA device.

- the device writer into a real SGLang ``MHATokenToKVPool`` on ``cuda``: bit-exact for fp32/fp16/bf16,
  zero-copy out of a pinned shared-memory region (``HostRegion`` + ``cudaHostRegister``) and staged out of
  pageable memory, rows not written stay untouched;
- writes from another thread on the side stream while a forward-like kernel loop runs on the default
  stream, each layer read only after ``wait_layer``: every read sees the written KV;
- the DPU client end to end: a real data-plane process fetches from an embedded store into a CUDA pool,
  as decoded KV (``--remote-kv-dpu-output kv``) and as codes the writer dequantizes on the device (the
  CUDA default; the quantized codec bit-exact, the transform codec within float32 rounding).
- ``write_quantized`` on the device: the quantized codec bit-exact against its CPU decode; the transform
  codec (Triton inverse transform, escapes, a sink token) within one step of the dtype of its CPU decode.

Skipped with the reason when there is no CUDA device (always, in CI), or naming the module when SGLang
or a data-plane dependency was not carried to the GPU machine (``tests/gpu_gate.py``). Passed on an
H200 (docs/HARDWARE.md).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.kvpool.device_writer import DeviceKVWriter
from sgl_remote_kv.types import KVLayout, numpy_storage_dtype

# every test builds an SGLang pool on CUDA
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_needs("sglang.srt.mem_cache.memory_pool")]
# the DPU client and its data-plane process (`python -m sgl_remote_kv.dpu`: ZeroMQ, msgspec, ...)
needs_dpu = pytest.mark.gpu_needs("sgl_remote_kv.fetch.dpu_client.client", "sgl_remote_kv.dpu.server")

TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sglang_pool(layout: KVLayout, size: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size, 1, TD[layout.dtype], layout.num_kv_heads, layout.head_dim, layout.num_layers, "cuda", False
    )


def _kv(layout: KVLayout, t: int, seed: int):
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((2, layout.num_layers, t, layout.num_kv_heads, layout.head_dim), np.float32)
    if layout.dtype == "bfloat16":
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return f.astype(numpy_storage_dtype(layout.dtype))


def _writer(pool, layout):
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), layout)
    assert isinstance(w, DeviceKVWriter)
    return w


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("pinned", [True, False])
def test_writer_into_sglang_pool_is_exact(dtype, pinned):
    from sgl_remote_kv.fetch.dpu_client.host_region import HostRegion

    lay = KVLayout(num_layers=6, num_kv_heads=3, head_dim=64, dtype=dtype)
    pool = _sglang_pool(lay, 4096)
    w = _writer(pool, lay)
    kv = _kv(lay, 300, seed=1)
    region = HostRegion(kv.nbytes, f"srkv-gpu-test-{dtype}-{pinned}", named=False)
    try:
        src = region.array[: kv.nbytes].view(kv.dtype).reshape(kv.shape)
        src[...] = kv
        if pinned:
            w.register_host(region.array)
        slots = torch.randperm(4096)[:300]
        w.write(src[0], src[1], slots)
        assert w.stats["zero_copy" if pinned else "staged"] == 1
        src[...] = 0  # the source is reusable once write() returned
        rk, rv = w.read(slots)
        np.testing.assert_array_equal(rk, kv[0])
        np.testing.assert_array_equal(rv, kv[1])
        rows = pool.k_buffer[0].shape[0]  # SGLang's pool has size + page_size rows (a padding slot page)
        others = torch.ones(rows, dtype=torch.bool)
        others[slots] = False
        assert not pool.k_buffer[0][others.cuda()].any()  # only the written rows changed
    finally:
        if pinned:
            w.unregister_host(region.array)  # before the region is unmapped, also after a failed check
        region.close()


def test_writes_on_the_side_stream_while_a_forward_runs():
    lay = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype="bfloat16")
    pool = _sglang_pool(lay, 1 << 15)
    w = _writer(pool, lay)
    stop = threading.Event()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def forward_like():  # keeps the default stream busy with work of its own
        while not stop.is_set():
            torch.mm(a, a)
        torch.cuda.synchronize()

    t = threading.Thread(target=forward_like)
    t.start()
    try:
        for i in range(20):
            kv = _kv(lay, 256, seed=10 + i)
            slots = torch.arange(i * 256, (i + 1) * 256)
            writer_thread = threading.Thread(target=w.write, args=(kv[0], kv[1], slots))
            writer_thread.start()  # like the DPU receiver thread
            writer_thread.join(30)
            assert not writer_thread.is_alive()
            for layer in range(lay.num_layers):
                w.wait_layer(layer)  # the consumer (current) stream waits on the layer's event
                got = pool.get_key_buffer(layer)[slots.cuda()].view(torch.int16).cpu().numpy()
                np.testing.assert_array_equal(got.view(np.uint16), kv[0][layer])
    finally:
        stop.set()
        t.join()


def _dpu_fetch_into_cuda(tmp_path, codec, output: str, seed: int):
    """A real data plane fetches 5 chunks of ``codec`` into an SGLang pool on CUDA with ``output``;
    returns (writer, slots, blobs)."""
    from dpu_helpers import CHUNK, FP, LAYOUT, put_chunks, random_chunks

    from sgl_remote_kv.contract.settings import DataPlaneSettings
    from sgl_remote_kv.contract.sizing import chunk_bytes
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget

    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(5, seed=seed))
    cb = chunk_bytes(LAYOUT, CHUNK)
    spec = DataPlaneSettings(workers=(1, 1, 1, 1), layer_group=2, slots=2, slot_bytes=2 * cb)
    cfg = DpuClientConfig(url, dest_slots=2, dest_slot_bytes=2 * cb, process=spec, output=output)
    c = DpuClient(cfg, FP, codec)
    c.start()
    try:
        w = _writer(_sglang_pool(LAYOUT, 1024), LAYOUT)
        slots = torch.randperm(1024)[: 5 * CHUNK]
        res = c.fetch("gpu", keys, CHUNK, KVTarget(w, slots), timeout=120)
        assert res.hit_chunks == 5 and not res.failures
    finally:
        c.close()
    return w, slots, blobs


@needs_dpu
@pytest.mark.parametrize("output", ["kv", "auto"])
def test_dpu_client_end_to_end_into_a_cuda_pool(tmp_path, output):
    """``kv``: decoded KV out of the pinned destination region (zero-copy H2D + scatter); ``auto`` on a CUDA
    pool = codes: the data plane only inflates, the writer dequantizes on the device. Bit-exact both ways."""
    from dpu_helpers import CHUNK, FP, codecs

    from sgl_remote_kv.codec.base import decode

    w, slots, blobs = _dpu_fetch_into_cuda(tmp_path, codecs()["quant"], output, seed=3)
    if output == "kv":
        assert w.stats["zero_copy"] >= 1  # out of the pinned destination region
    else:
        assert w.stats["device_dequant"] == w.stats["writes"] > 0
    for i in range(5):
        k, v = decode(blobs[i], FP)
        pk, pv = w.read(slots[i * CHUNK : (i + 1) * CHUNK])
        np.testing.assert_array_equal(pk, k)
        np.testing.assert_array_equal(pv, v)


@needs_dpu
def test_dpu_transform_codes_into_a_cuda_pool(tmp_path, monkeypatch):
    """The transform codec through the data plane as codes (a CUDA pool's default): the Triton inverse
    transform on the device; the pool holds the CPU decode up to float32 rounding."""
    from calibration_helpers import make_calibration
    from dpu_helpers import CHUNK, FP

    from sgl_remote_kv.codec import calibration as cm
    from sgl_remote_kv.codec import quant
    from sgl_remote_kv.codec.base import decode, get_codec

    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "cache"))  # where the data plane finds it
    cal = make_calibration(FP, step=0.05)
    cal.save(cm.default_dir())
    try:
        codec = get_codec("transform", calibration=cal.calib_id.hex())
        w, slots, blobs = _dpu_fetch_into_cuda(tmp_path, codec, "auto", seed=6)
        assert w.stats["device_dequant"] == w.stats["writes"] > 0
        for i in range(5):
            got = w.read(slots[i * CHUNK : (i + 1) * CHUNK])
            for g, x in zip(got, decode(blobs[i], FP), strict=True):
                g, x = quant.to_f32(g, "bfloat16"), quant.to_f32(x, "bfloat16")
                assert np.all(np.abs(g - x) <= np.abs(x) * 2.0**-7 + 1e-4), float(np.abs(g - x).max())
    finally:
        cm.unregister(cal.calib_id)


def _write_codes(codec, fp, blobs):
    """Every layer of ``blobs`` through ``write_quantized`` (the lossless stage's views, all chunks at once)
    into a fresh SGLang pool on CUDA; returns the writer and the slots written."""
    lay = fp.layout
    w = _writer(_sglang_pool(lay, 1024), lay)
    slots = torch.randperm(1024)[: 64 * len(blobs)]
    from calibration_helpers import layer_views

    for layer in range(lay.num_layers):
        w.write_quantized(layer_views(codec, fp, blobs, layer), slots, layer)
    assert w.stats["device_dequant"] == lay.num_layers
    return w, slots


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("k_channel_scale", [False, True])
def test_write_quantized_dequantizes_on_the_device_bit_exact(dtype, k_channel_scale):
    """The in-process path on a CUDA pool: codes + scales H2D, Triton dequant, scatter; the pool must hold
    the same bits as the codec's CPU decode (numba)."""
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec

    fp = synthetic.fingerprint(num_layers=4, dtype=dtype)
    lay = fp.layout
    gran = "head" if k_channel_scale else "token"
    codec = get_codec(
        "quant_deflate", k_bins="256", v_bins="96", granularity=gran, k_channel_scale=k_channel_scale
    )
    chunks = [synthetic.kv(lay, 64, seed=s) for s in range(3)]
    blobs = [codec.encode(k, v, fp) for k, v in chunks]
    w, slots = _write_codes(codec, fp, blobs)
    ref = [codec.decode(b, fp) for b in blobs]
    rk, rv = w.read(slots)
    np.testing.assert_array_equal(rk, np.concatenate([r[0] for r in ref], axis=1))
    np.testing.assert_array_equal(rv, np.concatenate([r[1] for r in ref], axis=1))


@pytest.mark.parametrize("quantizer", ["scalar", "trellis"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_quantized_transform_codec_on_the_device(dtype, quantizer):
    """The transform codec on a CUDA pool: symbols, escapes, scales, RoPE tables and the sink token H2D,
    ``kernels/transform.py`` (Triton) per chunk (a trellis chunk's k replayed into codes there first), one
    scatter per layer; the pool holds the codec's CPU decode up to float32 rounding (at most one step of the
    dtype on a few values)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from calibration_helpers import make_calibration

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec import quant
    from sgl_remote_kv.codec.base import get_codec

    fp = synthetic.fingerprint(num_layers=3, dtype=dtype)
    lay = fp.layout
    cal = make_calibration(fp, step=0.02, seed=4)
    codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.0005", quantizer=quantizer)
    chunks = [synthetic.kv(lay, 64, seed=s) for s in range(3)]
    blobs = [codec.encode(k, v, fp, start=64 * i) for i, (k, v) in enumerate(chunks)]
    w, slots = _write_codes(codec, fp, blobs)
    ref = [codec.decode(b, fp) for b in blobs]
    rk, rv = w.read(slots)
    step = 2.0**-7 if dtype == "bfloat16" else 1e-5
    for got, want in (
        (rk, np.concatenate([r[0] for r in ref], axis=1)),
        (rv, np.concatenate([r[1] for r in ref], axis=1)),
    ):
        g, x = quant.to_f32(got, dtype), quant.to_f32(want, dtype)
        assert np.all(np.abs(g - x) <= np.abs(x) * step + 1e-4), float(np.abs(g - x).max())
        if dtype != "float32":  # float32 keeps each side's own rounding (the CPU sums exactly in int32)
            assert np.mean(got != want) < 0.02
