"""NVDEC backend (PyNvVideoCodec) glue on CPU: the backend selection's errors without the package, and
the glue (packets handed over by address, end-of-stream handling, session reuse, frame copies before the
decoder reuses its buffers, counting, error mapping) driven through a stand-in ``PyNvVideoCodec`` module
that has the real package's API names and decodes with PyAV. They check our code, not NVIDIA's; the
real decoder is ``test_gpu_nvdec.py`` (GPU suite).
"""

from __future__ import annotations

import ctypes
import sys
import types

import av
import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")
from nvdec_video_helpers import _assert_same, _chunk, _decode_all, _videos
from sgl_remote_kv.nvdec import layout as lo
from sgl_remote_kv.nvdec import nvcodec, video
from sgl_remote_kv.nvdec.pool import DecoderPool, SlotWriter

from sgl_remote_kv.codec.errors import CorruptChunk

# ---- CPU: selection errors without the package ------------------------------------------------------


@pytest.fixture
def fresh_nvcodec(monkeypatch):
    """nvcodec's per-process import/caps caches, emptied for this test (restored after)."""
    monkeypatch.setattr(nvcodec, "_module", None)
    monkeypatch.setattr(nvcodec, "_import_error", None)
    monkeypatch.setattr(nvcodec, "_caps", {})
    return monkeypatch


def test_missing_package_gives_a_clear_error(fresh_nvcodec):
    fresh_nvcodec.setitem(sys.modules, "PyNvVideoCodec", None)  # import -> ModuleNotFoundError
    packets, count, h, w = _videos()[0]
    reason = video.nvdec_unavailable_reason()
    assert reason and "pip install pynvvideocodec" in reason
    assert video.default_device() == "cpu"
    dec = video.VideoDecoder("cuda")  # constructing never raises (pool workers build theirs)
    with pytest.raises(nvcodec.NvdecUnavailable, match="pip install pynvvideocodec"):
        _decode_all(dec, packets, count, h, w)
    with pytest.raises(CorruptChunk):  # the bitstream check still comes first
        _decode_all(dec, packets, count, h, w + 64)
    assert video.encoder_name("cuda") == "libx265" == video.encoder_name("cpu")
    assert video.decoder_name("cuda") == "pynvvideocodec" and video.decoder_name("cpu") == "hevc"
    with pytest.raises(ValueError):
        _decode_all(video.VideoDecoder("gpu"), packets, count, h, w)


def test_package_without_driver_gives_a_clear_error(fresh_nvcodec):
    class Finder:  # PyNvVideoCodec's __init__ raises RuntimeError when libnvidia-encode is missing
        def find_spec(self, name, path=None, target=None):
            if name != "PyNvVideoCodec":
                return None
            from importlib.machinery import ModuleSpec

            class Loader:
                def create_module(self, spec):
                    return None

                def exec_module(self, module):
                    raise RuntimeError("Failed to load NVENC library: libnvidia-encode.so.1: cannot open")

            return ModuleSpec(name, Loader())

    fresh_nvcodec.delitem(sys.modules, "PyNvVideoCodec", raising=False)
    fresh_nvcodec.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    reason = video.nvdec_unavailable_reason()
    assert reason and "libnvidia-encode" in reason and "NVIDIA_DRIVER_CAPABILITIES" in reason


# ---- CPU: the backend's glue, through a stand-in PyNvVideoCodec -------------------------------------


def _fake_pynvvideocodec(
    *, output_format: str = "YUV444", width_min: int = 144, fail_on: int = -1, delay: int = 0
):
    """A module with PyNvVideoCodec 2.2's decode API (names, enums, buffer semantics) decoding with
    PyAV: one frame buffer per decoder, overwritten by every ``Decode`` call; after an end-of-stream
    packet the decoder refuses more data (so our code must never feed a flushed session). ``delay``
    holds frames back until later calls or the end of stream, as NVDEC would if LOW latency did not
    apply."""
    m = types.ModuleType("PyNvVideoCodec")
    enum = lambda **kw: types.SimpleNamespace(__members__=kw, **kw)  # noqa: E731
    m.cudaVideoCodec = enum(HEVC=8, H264=4)
    m.cudaVideoChromaFormat = enum(**{"420": 1, "444": 3})
    m.OutputColorType = enum(NATIVE=0, RGB=1, RGBP=2)
    m.DisplayDecodeLatencyType = enum(NATIVE=0, LOW=1, ZERO=2)
    m.VideoPacketFlag = enum(ENDOFSTREAM=1, TIMESTAMP=2, DISCONTINUITY=4, ENDOFPICTURE=8, NOTIFY_EOS=16)
    m.Pixel_Format = enum(NV12=3, YUV444=4)
    m.PyNvVCException = type("PyNvVCException", (Exception,), {})
    m.created = []

    class PacketData:
        def __init__(self):
            self.bsl = self.bsl_data = self.pts = self.decode_flag = 0

    class DecodedFrame:
        def __init__(self, buf, fmt):
            self._buf, self.format = buf, fmt

        def framesize(self):
            return self._buf.size

        def GetPtrToPlane(self, i):
            return self._buf.ctypes.data

        def __dlpack__(self, stream=None):
            return self._buf.__dlpack__()

        def __dlpack_device__(self):
            return self._buf.__dlpack_device__()

    class Decoder:
        def __init__(self, **kw):
            assert kw["codec"] == m.cudaVideoCodec.HEVC and kw["outputColorType"] == m.OutputColorType.NATIVE
            self.kw, self.ctx, self.ended, self.calls = kw, av.CodecContext.create("hevc", "r"), False, 0
            self.buf, self.size, self.held = None, (0, 0), []
            m.created.append(self)

        def Decode(self, pkt):
            self.calls += 1
            if self.calls == fail_on:
                raise m.PyNvVCException("cuvidParseVideoData failed")
            if self.ended:
                raise AssertionError("fed after end of stream")
            if pkt.bsl == 0:
                assert pkt.decode_flag == m.VideoPacketFlag.ENDOFSTREAM
                self.ended, self.held = True, self.held + list(self.ctx.decode(None))
                frames, self.held = self.held, []
            else:
                assert pkt.decode_flag == m.VideoPacketFlag.ENDOFPICTURE
                data = ctypes.string_at(pkt.bsl_data, pkt.bsl)  # read through the address we were given
                try:
                    self.held += self.ctx.decode(av.Packet(data))
                except av.FFmpegError as e:
                    raise m.PyNvVCException(str(e)) from None
                cut = max(0, len(self.held) - delay)
                frames, self.held = self.held[:cut], self.held[cut:]
            out = []
            for i, fr in enumerate(frames):  # into the decoder's own buffers, overwritten by the next call
                a = fr.to_ndarray()
                shape = (8, 3 * a.shape[1], a.shape[2])  # (3H, W) per frame: planar YUV444, planes stacked
                if self.buf is None or self.buf.shape != shape:
                    self.buf = np.zeros(shape, np.uint8)
                self.buf[i] = a.reshape(shape[1:])
                self.size = (a.shape[2], a.shape[1])
                out.append(DecodedFrame(self.buf[i], getattr(m.Pixel_Format, output_format)))
            return out

        def GetWidth(self):
            return self.size[0]

        def GetHeight(self):
            return self.size[1]

        def SyncOnCUStream(self):
            pass

    m.PacketData = PacketData
    m.CreateDecoder = lambda **kw: Decoder(**kw)

    def caps(**kw):
        assert kw["chromaformat"] == 3 and kw["bitdepth"] == 8
        return {
            "num_decoder_engines": 7,
            "width_min": width_min,
            "height_min": width_min,
            "width_max": 8192,
            "height_max": 8192,
        }

    m.GetDecoderCaps = caps
    return m


@pytest.fixture
def fake_nvc(fresh_nvcodec):
    def install(**kw):
        m = _fake_pynvvideocodec(**kw)
        fresh_nvcodec.setitem(sys.modules, "PyNvVideoCodec", m)
        fresh_nvcodec.setattr(nvcodec, "_module", None)  # a new stand-in replaces a cached one
        fresh_nvcodec.setattr(nvcodec, "_caps", {})
        return m

    return install


def test_glue_bit_exact_reuse_and_copies(fake_nvc):
    m = fake_nvc()
    assert video.nvdec_unavailable_reason() is None and video.default_device() == "cuda"
    assert nvcodec.nvdec_engines() == 7
    dec = video.VideoDecoder("cuda")
    vids = _videos()
    for packets, count, h, w in vids + vids[:1]:
        # keep every frame, as a consumer may: they must be copies, not views of the decoder's buffers
        kept = list(dec.frames([memoryview(p) for p in packets], count, h, w))
        _assert_same(kept, _decode_all(video.VideoDecoder("cpu"), packets, count, h, w))
    # 256x256 -> 256x512 -> 320x256 -> 256x256 (noise) -> 256x256: a session per size change only
    assert dec._ctx.stats == {"sessions": 4, "flushes": 0, "videos": 5}
    assert all(d.kw["usedevicememory"] is False for d in m.created)
    assert all(d.kw["latency"] == m.DisplayDecodeLatencyType.LOW for d in m.created)


def test_glue_decoder_holding_frames_back_is_flushed(fake_nvc):
    """If NVDEC kept frames until the end of stream, the videos still decode bit-exact: an end-of-stream
    packet flushes them, and the session (never fed after it; the stand-in asserts so) is replaced."""
    m = fake_nvc(delay=2)
    dec = video.VideoDecoder("cuda")
    for packets, count, h, w in _videos()[:2]:
        _assert_same(
            _decode_all(dec, packets, count, h, w),
            _decode_all(video.VideoDecoder("cpu"), packets, count, h, w),
        )
    assert dec._ctx.stats == {"sessions": 2, "flushes": 2, "videos": 2} and len(m.created) == 2


def test_glue_on_device_yields_tensors(fake_nvc):
    torch = pytest.importorskip("torch")
    m = fake_nvc()
    packets, count, h, w = _videos()[1]
    out = list(
        video.VideoDecoder("cuda", on_device=True).frames([memoryview(p) for p in packets], count, h, w)
    )
    assert all(isinstance(f, torch.Tensor) and f.shape == (3, h, w) and f.dtype == torch.uint8 for f in out)
    _assert_same([f.numpy() for f in out], _decode_all(video.VideoDecoder("cpu"), packets, count, h, w))
    assert m.created[0].kw["usedevicememory"] is True


def test_glue_counts_and_maps_errors(fake_nvc):
    packets, count, h, w = _videos()[0]
    ref = _decode_all(video.VideoDecoder("cpu"), packets, count, h, w)
    fake_nvc()
    dec = video.VideoDecoder("cuda")
    for wrong in (count - 1, count + 1):
        with pytest.raises(CorruptChunk, match="frames"):
            _decode_all(dec, packets, wrong, h, w)
    with pytest.raises(CorruptChunk):
        _decode_all(dec, packets[:-2], count, h, w)
    with pytest.raises(CorruptChunk, match="outside NVDEC"):  # below NVDEC's 144-pixel minimum
        small = video.encode_planes(np.zeros((2, 3, 64, 64), np.uint8))
        _decode_all(dec, small, 2, 64, 64)
    _assert_same(_decode_all(dec, packets, count, h, w), ref)  # recovered
    fake_nvc(fail_on=3)
    with pytest.raises(CorruptChunk, match="nvdec: cuvidParseVideoData failed"):
        _decode_all(video.VideoDecoder("cuda"), packets, count, h, w)
    fake_nvc(output_format="NV12")  # a GPU whose NVDEC falls back to 4:2:0 output: not lossless
    with pytest.raises(nvcodec.NvdecUnavailable, match="YUV444"):
        _decode_all(video.VideoDecoder("cuda"), packets, count, h, w)


def test_glue_abandoned_video_drops_the_session(fake_nvc):
    m = fake_nvc()
    packets, count, h, w = _videos()[0]
    dec = video.VideoDecoder("cuda")
    gen = dec.frames([memoryview(p) for p in packets], count, h, w)
    next(gen)
    gen.close()  # e.g. the pool closing mid-chunk
    assert dec._ctx is None
    _assert_same(
        _decode_all(dec, packets, count, h, w), _decode_all(video.VideoDecoder("cpu"), packets, count, h, w)
    )
    assert len(m.created) == 2


def test_glue_pool_and_codec(fake_nvc):
    fake_nvc()
    codec, fp, blob = _chunk(tokens=32, layers=3)
    rk, rv = codec.decode(blob, fp)
    gk, gv = codec.decode(blob, fp, decoder=video.VideoDecoder("cuda"))
    assert np.array_equal(gk.view(np.uint16), rk.view(np.uint16)) and np.array_equal(
        gv.view(np.uint16), rv.view(np.uint16)
    )
    lay, t = fp.layout, rk.shape[1]
    k_pool = np.zeros((lay.num_layers, t, lay.num_kv_heads, lay.head_dim), rk.dtype)
    v_pool = k_pool.copy()
    with DecoderPool(instances=2, device="cuda") as pool:
        pool.submit(blob, fp, SlotWriter(list(k_pool), list(v_pool), np.arange(t), "bfloat16")).result(
            timeout=60
        )
    assert np.array_equal(k_pool.view(np.uint16), rk.view(np.uint16))
    assert np.array_equal(v_pool.view(np.uint16), rv.view(np.uint16))
    assert lo.NVENC_MIN_SIDE >= 144  # the default frame size is one NVDEC takes
