"""NVDEC backend (PyNvVideoCodec) of ``VideoDecoder(device="cuda")`` against the CPU twin (PyAV ``hevc``).

Two halves:

* ``TestOnGpu`` (``pytestmark = pytest.mark.gpu``, deselected by default; run with ``-m gpu``):
  real NVDEC on real bitstreams, skipped with the reason when there is no CUDA GPU or PyNvVideoCodec
  (``pip install pynvvideocodec``) cannot be used. Never ran on the development machine (no GPU).
* CPU tests: the backend selection's errors without the package, and the backend's glue (packets
  handed over by address, end-of-stream handling, session reuse, frame copies before the decoder reuses
  its buffers, counting, error mapping) driven through a stand-in ``PyNvVideoCodec`` module that has the
  real package's API names and decodes with PyAV. They check our code, not NVIDIA's.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import types

import av
import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")
from sgl_remote_kv.nvdec import layout as lo
from sgl_remote_kv.nvdec import nvcodec, video
from sgl_remote_kv.nvdec.pool import DecoderPool, SlotWriter

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.errors import ChunkError, CorruptChunk
from sgl_remote_kv.codec.format import layer_section, parse_header

FRAMES = 8


def _kv_like_planes(frames: int, h: int, w: int, seed: int) -> np.ndarray:
    """Quantized-KV-like planes: per-column channel scale, slow drift over frames, noise."""
    rng = np.random.default_rng(seed)
    chan = rng.gamma(2.0, 12.0, size=(1, 3, 1, w))
    drift = 20 * np.sin(np.arange(frames) / 3)[:, None, None, None]
    x = 128 + drift + rng.standard_normal((frames, 3, h, w)) * chan
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


@functools.cache
def _videos() -> tuple[tuple[list[bytes], int, int, int], ...]:
    """(packets, frames, height, width): KV-like and pure-noise videos at NVDEC-sized pictures."""
    out = []
    for i, (h, w) in enumerate([(256, 256), (256, 512), (320, 256)]):
        planes = _kv_like_planes(FRAMES, h, w, seed=i)
        out.append((video.encode_planes(planes), FRAMES, h, w))
    noise = np.random.default_rng(9).integers(0, 256, (4, 3, 256, 256), dtype=np.uint8)
    out.append((video.encode_planes(noise), 4, 256, 256))
    return tuple(out)


def _chunk(tokens: int = 64, layers: int = 4):
    """A real hevc chunk blob (synthetic KV, default 256-pixel minimum side: NVDEC's >= 144)."""
    fp = synthetic.fingerprint(num_layers=layers, dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, tokens, seed=7)
    codec = get_codec("hevc", tokens_per_frame=16)
    return codec, fp, codec.encode(k, v, fp)


def _group_videos(codec, fp, blob):
    hdr = parse_header(blob, fp)
    lay = hdr.layout
    fl = codec.frame_layout(hdr.num_tokens, lay.num_kv_heads, lay.head_dim)
    gs = codec.parse_group(layer_section(blob, hdr, 0), fl)
    return [(list(v), fl.frames, *fl.size) for v in gs.videos]


def _host(frame) -> np.ndarray:
    return frame if isinstance(frame, np.ndarray) else frame.cpu().numpy()


def _decode_all(dec: video.VideoDecoder, packets, count, h, w) -> list[np.ndarray]:
    return [_host(f) for f in dec.frames([memoryview(p) for p in packets], count, h, w)]


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.shape == y.shape and x.dtype == y.dtype == np.uint8, i
        assert np.array_equal(x, y), f"frame {i}: {int((x != y).sum())} samples differ"


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
        return {"num_decoder_engines": 7, "width_min": width_min, "height_min": width_min,
                "width_max": 8192, "height_max": 8192}  # fmt: skip

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
