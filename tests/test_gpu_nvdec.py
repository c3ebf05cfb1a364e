"""NVDEC backend (PyNvVideoCodec) of ``VideoDecoder(device="cuda")`` against the CPU twin (PyAV ``hevc``)
on a GPU (``TestOnGpu``, ``pytest.mark.gpu``, deselected by default; run with ``-m gpu``): real NVDEC on
real bitstreams, skipped with the reason when there is no CUDA GPU or PyNvVideoCodec
(``pip install pynvvideocodec``) cannot be used. Never ran on the development machine (no GPU). The CPU
tests of the backend's glue are ``test_nvdec_nvcodec.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")
from nvdec_video_helpers import _assert_same, _chunk, _decode_all, _group_videos, _host, _videos
from sgl_remote_kv.nvdec import nvcodec, video
from sgl_remote_kv.nvdec.pool import DecoderPool, SlotWriter

from sgl_remote_kv.codec.errors import ChunkError, CorruptChunk

# ---- real NVDEC (GPU machines) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_nvdec():
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed (used to detect a CUDA GPU)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    reason = video.nvdec_unavailable_reason(0)
    if reason is not None:
        pytest.skip(f"NVDEC backend unusable: {reason}")
    return torch


class TestOnGpu:
    pytestmark = pytest.mark.gpu

    @pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
    def test_bit_exact_vs_cpu_twin(self, real_nvdec, on_device):
        codec, fp, blob = _chunk()
        vids = [*_videos(), *_group_videos(codec, fp, blob)]
        gpu = video.VideoDecoder("cuda", on_device=on_device)  # one decoder for all: reuse + size changes
        for packets, count, h, w in vids:
            soft = _decode_all(video.VideoDecoder("cpu"), packets, count, h, w)
            hard = list(gpu.frames([memoryview(p) for p in packets], count, h, w))
            if on_device:
                assert all(f.is_cuda and f.dtype == real_nvdec.uint8 for f in hard)
            else:
                assert all(isinstance(f, np.ndarray) for f in hard)
            _assert_same([_host(f) for f in hard], soft)

    def test_chunk_and_pool_decode_bit_exact(self, real_nvdec):
        codec, fp, blob = _chunk()
        rk, rv = codec.decode(blob, fp)  # CPU twin
        gk, gv = codec.decode(blob, fp, decoder=video.VideoDecoder("cuda"))
        assert np.array_equal(gk.view(np.uint16), rk.view(np.uint16))
        assert np.array_equal(gv.view(np.uint16), rv.view(np.uint16))
        lay, t = fp.layout, rk.shape[1]
        k_pool = np.zeros((lay.num_layers, t, lay.num_kv_heads, lay.head_dim), rk.dtype)
        v_pool = k_pool.copy()
        with DecoderPool(instances=2, device="cuda") as pool:
            sink = SlotWriter(list(k_pool), list(v_pool), np.arange(t), "bfloat16")
            pool.submit(blob, fp, sink).result(timeout=120)
        assert np.array_equal(k_pool.view(np.uint16), rk.view(np.uint16))
        assert np.array_equal(v_pool.view(np.uint16), rv.view(np.uint16))

    def test_frame_count_is_checked_and_decoder_recovers(self, real_nvdec):
        packets, count, h, w = _videos()[0]
        ref = _decode_all(video.VideoDecoder("cpu"), packets, count, h, w)
        dec = video.VideoDecoder("cuda")
        for wrong in (count - 1, count + 1):
            with pytest.raises(CorruptChunk, match="frames"):
                _decode_all(dec, packets, wrong, h, w)
        with pytest.raises(CorruptChunk):
            _decode_all(dec, packets[:-3], count, h, w)  # truncated video
        _assert_same(_decode_all(dec, packets, count, h, w), ref)

    def test_corrupt_bitstreams_are_corrupt_chunks(self, real_nvdec):
        packets, count, h, w = _videos()[0]
        ref = _decode_all(video.VideoDecoder("cpu"), packets, count, h, w)
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
        _assert_same(_decode_all(dec, packets, count, h, w), ref)

    def test_one_session_serves_same_size_videos(self, real_nvdec):
        """Performance property: LOW latency + ENDOFPICTURE hands every frame back without an end of
        stream, so consecutive videos of one size share one NVDEC session."""
        vids = [v for v in _videos() if (v[2], v[3]) == (256, 256)]
        dec = video.VideoDecoder("cuda")
        for packets, count, h, w in vids * 2:
            _decode_all(dec, packets, count, h, w)
        stats = dec._ctx.stats
        assert stats["videos"] == 2 * len(vids)
        assert stats["flushes"] == 0 and stats["sessions"] == 1, stats

    def test_engines_reported(self, real_nvdec):
        assert nvcodec.nvdec_engines(0) >= 1
        assert video.default_device() == "cuda"
