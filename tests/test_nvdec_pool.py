"""Decoder pool: bit-exact encode -> pool -> restoration into a KV pool tensor; failures; shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401
from sgl_remote_kv.nvdec.pool import DecoderPool, PoolClosed, SlotWriter

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.errors import ChunkError, ForeignChunk

SMALL = dict(tokens_per_frame=4, min_side=16)


def _chunks(fp, n, tokens=12):
    codec = get_codec("hevc", **SMALL)
    out = []
    for i in range(n):
        k, v = synthetic.kv(fp.layout, tokens, seed=20 + i)
        out.append((codec.encode(k, v, fp), *codec.decode(codec.encode(k, v, fp), fp)))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pool_restores_bit_exact_into_kv_slots(dtype):
    fp = synthetic.fingerprint(num_layers=5, dtype=dtype)
    chunks = _chunks(fp, 3)
    slots_total = 64
    rng = np.random.default_rng(0)
    k_pool, _ = synthetic.kv(fp.layout, slots_total, seed=99)
    before = k_pool.copy()
    v_pool = k_pool.copy()
    perm = rng.permutation(slots_total)
    slot_sets = [perm[i * 12 : (i + 1) * 12] for i in range(3)]
    with DecoderPool(instances=2) as pool:
        futs = [
            pool.submit(blob, fp, SlotWriter(list(k_pool), list(v_pool), slots, dtype), chunk_id=i)
            for i, ((blob, _, _), slots) in enumerate(zip(chunks, slot_sets, strict=True))
        ]
        results = [f.result(timeout=60) for f in futs]
    assert [r.chunk_id for r in results] == [0, 1, 2]
    assert all(r.frames == 2 * 2 * 3 for r in results)  # 2 groups x (K, V) x 3 frames of 4 tokens
    for (_, rk, rv), slots in zip(chunks, slot_sets, strict=True):
        assert np.array_equal(k_pool[:, slots].view(np.uint8), rk.view(np.uint8))
        assert np.array_equal(v_pool[:, slots].view(np.uint8), rv.view(np.uint8))
    untouched = perm[36:]
    assert np.array_equal(k_pool[:, untouched].view(np.uint8), before[:, untouched].view(np.uint8))
    assert pool.stats["ok"] == 3 and pool.stats["frames"] == 36


def test_pool_reports_corrupt_and_foreign_chunks_and_keeps_working():
    fp = synthetic.fingerprint(num_layers=3)
    ((blob, rk, _),) = _chunks(fp, 1)
    bad = bytearray(blob)
    bad[-10] ^= 0xFF  # CRC mismatch
    k, v = synthetic.kv(fp.layout, 12)
    other = get_codec("quant_deflate").encode(k, v, fp)
    calls = []

    def boom(fc):
        calls.append(fc.kind)
        raise RuntimeError("sink bug")

    lay = fp.layout
    k_pool = np.zeros((3, 12, lay.num_kv_heads, lay.head_dim), np.uint16)
    v_pool = k_pool.copy()
    with DecoderPool(instances=1) as pool:
        with pytest.raises(ChunkError):
            pool.submit(bytes(bad), fp, lambda fc: None).result(timeout=30)
        with pytest.raises(ForeignChunk):
            pool.submit(other, fp, lambda fc: None).result(timeout=30)
        with pytest.raises(RuntimeError, match="sink bug"):
            pool.submit(blob, fp, boom).result(timeout=30)
        pool.submit(blob, fp, SlotWriter(list(k_pool), list(v_pool), np.arange(12), "bfloat16")).result(
            timeout=30
        )
    assert np.array_equal(k_pool, rk) and calls == ["k"]
    assert pool.stats == {
        "ok": 1,
        "chunk_errors": 2,
        "internal_errors": 1,
        "cancelled": 0,
        "frames": 6,
        "instance_restarts": 0,
    }


def test_shutdown_with_chunks_in_flight():
    fp = synthetic.fingerprint(num_layers=3)
    ((blob, _, _),) = _chunks(fp, 1)
    started = threading.Event()

    def slow(fc):
        started.set()
        time.sleep(0.05)

    pool = DecoderPool(instances=2)
    futs = [pool.submit(blob, fp, slow, chunk_id=i) for i in range(20)]
    assert started.wait(30)
    t0 = time.perf_counter()
    pool.close(cancel_pending=True, timeout=10)
    assert time.perf_counter() - t0 < 5
    assert all(not t.is_alive() for t in pool._threads)
    outcomes = []
    for f in futs:
        assert f.done()
        outcomes.append("ok" if f.exception() is None else type(f.exception()).__name__)
    assert outcomes.count("PoolClosed") >= 17  # running ones abort at their next frame, queued never start
    assert pool.stats["cancelled"] == outcomes.count("PoolClosed")
    with pytest.raises(PoolClosed):
        pool.submit(blob, fp, slow).result(timeout=1)


def test_graceful_close_finishes_queued_chunks():
    fp = synthetic.fingerprint(num_layers=3)
    ((blob, _, _),) = _chunks(fp, 1)
    pool = DecoderPool(instances=1)
    futs = [pool.submit(blob, fp, lambda fc: None) for _ in range(4)]
    pool.close(cancel_pending=False, timeout=30)
    assert [f.result(timeout=0).frames for f in futs] == [6] * 4


def test_decoder_pool_device_follows_the_kv_pool(caplog, monkeypatch):
    """CPU pools decode in software; a GPU pool asks for NVDEC and, where PyNvVideoCodec cannot decode
    (here: no package/driver), says why once and decodes the same bitstreams in software."""
    import types

    import torch
    from sgl_remote_kv.nvdec import nvcodec
    from strict_device import StrictDevice

    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.fetch.paths import _decoder_device
    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from sgl_remote_kv.types import KVLayout

    lay = KVLayout(2, 1, 8, "float32")
    cfg = RemoteKVConfig(nvdec_instances=3)
    cpu = writer_for(PoolTensors([torch.zeros(4, 1, 8)] * 2, [torch.zeros(4, 1, 8)] * 2), lay)
    assert _decoder_device(types.SimpleNamespace(kv_writer=cpu, config=cfg, pool_device=None)) == (
        "cpu",
        0,
        3,
    )
    # the linker's fetch paths write host staging rows: the decoder follows the KV pool's device, where NVDEC
    # decodes into host frames (here the driver check says no NVDEC, named once)
    on_gpu = types.SimpleNamespace(kv_writer=cpu, config=cfg, pool_device=torch.device("cuda", 1))
    assert _decoder_device(on_gpu) == ("cpu", 0, 3)
    assert "NVDEC unusable on GPU 1" in caplog.text
    monkeypatch.setattr(nvcodec, "unavailable_reason", lambda gpu: None)
    monkeypatch.setattr(nvcodec, "nvdec_engines", lambda gpu: 7)
    assert _decoder_device(on_gpu) == ("cuda", 1, 7)
    monkeypatch.undo()
    dev = StrictDevice()
    try:
        planes = [dev.plane((4, 1, 8), torch.float32) for _ in range(2)]
        gpu = writer_for(PoolTensors(planes, planes), lay, ops=dev)
        reason = nvcodec.unavailable_reason(0)
        assert reason is not None  # this machine has no NVDEC
        assert _decoder_device(types.SimpleNamespace(kv_writer=gpu, config=cfg, pool_device=None)) == (
            "cpu",
            0,
            3,
        )
        assert "NVDEC unusable on GPU 0" in caplog.text
    finally:
        dev.close()
