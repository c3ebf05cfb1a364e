"""NVDEC backend (PyNvVideoCodec) of ``VideoDecoder(device="cuda")`` on a GPU (``pytest.mark.gpu``,
deselected by default; run with ``-m gpu``): real NVDEC on real chunk bitstreams, bit-exact against the
frames and KV the CPU twin (PyAV's ``hevc``) decoded from them.

The bitstreams and their expected decodes are committed (``tests/fixtures/nvdec/``, made and kept true by
``tests/nvdec_fixtures.py`` and ``tests/test_nvdec_fixtures.py``), so the GPU machine needs PyNvVideoCodec
but no PyAV (``scripts/gpu_wheels.sh nvdec``). Skipped with the reason: no CUDA device; a driver without
NVDEC's ``libnvcuvid.so.1`` (checked first, before PyNvVideoCodec is imported); PyNvVideoCodec not
installed or unusable. Passed on an H200 (docs/HARDWARE.md); CI has no GPU. The CPU tests of the backend's glue
are ``test_nvdec_nvcodec.py``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from gpu_gate import gpu_gate, nvcuvid_reason, reason  # noqa: F401  (gpu_gate: autouse, skips without CUDA)
from nvdec_fixtures import load
from nvdec_video_helpers import _assert_same, _decode_all, _host
from sgl_remote_kv.nvdec import nvcodec, video
from sgl_remote_kv.nvdec.pool import DecoderPool, SlotWriter

from sgl_remote_kv.codec.errors import ChunkError, CorruptChunk

pytestmark = pytest.mark.gpu
# loaded at collection: parsing them needs no CUDA, so `make gpu-rehearsal` checks it with each wheel set
FIXTURES = {name: load(name) for name in ("square", "tall", "wide")}


@pytest.fixture
def real_nvdec():
    """torch, once NVDEC is known to work here; else skip naming why (the driver's library first). Runs
    after the autouse ``gpu_gate``, so a machine without CUDA says only that."""
    why = nvcuvid_reason()
    if why is None and importlib.util.find_spec(nvcodec.MODULE) is None:
        why = reason(nvcodec.MODULE, None)
    if why is None:
        why = video.nvdec_unavailable_reason(0)
        why = f"NVDEC backend unusable: {why}" if why else None
    if why is not None:
        pytest.skip(why)
    import torch

    return torch


def _videos():
    """Every committed video, in fixture order: square (4 videos), tall, wide (2 each)."""
    return [v for fx in FIXTURES.values() for v in fx.videos]


def _square():
    return FIXTURES["square"].videos[0]


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_bit_exact_vs_cpu_twin(real_nvdec, on_device):
    gpu = video.VideoDecoder("cuda", on_device=on_device)  # one decoder for all: reuse + size changes
    for vid in _videos():
        hard = list(gpu.frames(vid.packets, vid.count, vid.height, vid.width))
        if on_device:
            assert all(f.is_cuda and f.dtype == real_nvdec.uint8 for f in hard)
        else:
            assert all(isinstance(f, np.ndarray) for f in hard)
        _assert_same([_host(f) for f in hard], list(vid.frames))


def test_chunk_and_pool_decode_bit_exact(real_nvdec):
    fx = FIXTURES["square"]
    rk, rv = fx.kv  # the CPU twin's decode, committed
    gk, gv = fx.codec.decode(fx.blob, fx.fingerprint, decoder=video.VideoDecoder("cuda"))
    assert np.array_equal(gk.view(np.uint16), rk.view(np.uint16))
    assert np.array_equal(gv.view(np.uint16), rv.view(np.uint16))
    lay, t = fx.fingerprint.layout, rk.shape[1]
    k_pool = np.zeros((lay.num_layers, t, lay.num_kv_heads, lay.head_dim), rk.dtype)
    v_pool = k_pool.copy()
    with DecoderPool(instances=2, device="cuda") as pool:
        sink = SlotWriter(list(k_pool), list(v_pool), np.arange(t), "bfloat16")
        pool.submit(fx.blob, fx.fingerprint, sink).result(timeout=120)
    assert np.array_equal(k_pool.view(np.uint16), rk.view(np.uint16))
    assert np.array_equal(v_pool.view(np.uint16), rv.view(np.uint16))


def test_frame_count_is_checked_and_decoder_recovers(real_nvdec):
    vid = _square()
    dec = video.VideoDecoder("cuda")
    for wrong in (vid.count - 1, vid.count + 1):
        with pytest.raises(CorruptChunk, match="frames"):
            _decode_all(dec, vid.packets, wrong, vid.height, vid.width)
    with pytest.raises(CorruptChunk):
        _decode_all(dec, vid.packets[:-3], vid.count, vid.height, vid.width)  # truncated video
    _assert_same(_decode_all(dec, vid.packets, vid.count, vid.height, vid.width), list(vid.frames))


def test_corrupt_bitstreams_are_corrupt_chunks(real_nvdec):
    vid = _square()
    packets, count, h, w = [bytes(p) for p in vid.packets], vid.count, vid.height, vid.width
    dec = video.VideoDecoder("cuda")
    with pytest.raises(CorruptChunk):  # only the headers' packet survives, the rest is junk
        _decode_all(dec, [packets[0], *[b"\xff" * 700] * (count - 1)], count, h, w)
    fresh = video.VideoDecoder("cuda")
    with pytest.raises(CorruptChunk):  # the SPS claims another picture: refused before NVDEC
        _decode_all(fresh, packets, count, h, w + 64)
    assert fresh._ctx is None, "NVDEC was handed a bitstream whose SPS failed the check"
    rng = np.random.default_rng(1)
    for _ in range(20):  # random damage: typed errors or well-formed frames, never a crash
        bad = [bytearray(p) for p in packets]
        j = int(rng.integers(0, len(bad)))
        for at in rng.integers(0, len(bad[j]), 4):
            bad[j][at] ^= int(rng.integers(1, 256))
        try:
            out = _decode_all(dec, [bytes(p) for p in bad], count, h, w)
        except ChunkError:
            continue
        assert len(out) == count and all(f.shape == (3, h, w) for f in out)
    _assert_same(_decode_all(dec, packets, count, h, w), list(vid.frames))


def test_one_session_serves_same_size_videos(real_nvdec):
    """Performance property: LOW latency + ENDOFPICTURE hands every frame back without an end of
    stream, so consecutive videos of one size share one NVDEC session."""
    vids = FIXTURES["square"].videos  # four videos of 256x256
    dec = video.VideoDecoder("cuda")
    for vid in vids * 2:
        _decode_all(dec, vid.packets, vid.count, vid.height, vid.width)
    stats = dec._ctx.stats
    assert stats["videos"] == 2 * len(vids)
    assert stats["flushes"] == 0 and stats["sessions"] == 1, stats


def test_engines_reported(real_nvdec):
    assert nvcodec.nvdec_engines(0) >= 1
    assert video.default_device() == "cuda"
