"""The NVDEC backend of :class:`~sgl_remote_kv.nvdec.video.VideoDecoder`: NVIDIA's PyNvVideoCodec.

NVIDIA's PyNvVideoCodec (PyPI ``pynvvideocodec``, MIT) ships the Video Codec SDK's ``NvDecoder`` as a
Python module, with host or device (DLPack) output; this file drives it on the same in-memory Annex-B
packets the CPU twin (FFmpeg's software ``hevc`` through PyAV) decodes. Imported lazily, only for
``device="cuda"``.

**UNTESTED on hardware**: written against PyNvVideoCodec 2.2.4 without a GPU. The API below was read
from the wheel itself (the pybind11 signatures of ``PyNvVideoCodec_130.*.so``, introspected with a stub
``libcuda``; ``samples/advanced/decode_with_low_latency.py``, ``samples/utils/Utils.py``) and NVIDIA's
programming guide (docs.nvidia.com/video-technologies/pynvvideocodec/pynvc-api-prog-guide). Bit-exactness
vs the CPU twin is what ``tests/test_gpu_nvdec.py`` checks on first use.

Calls used:

* ``CreateDecoder(gpuid=, codec=cudaVideoCodec.HEVC, usedevicememory=, outputColorType=
  OutputColorType.NATIVE, latency=DisplayDecodeLatencyType.LOW)``: NATIVE output of an 8-bit 4:4:4
  stream is the planar ``YUV444`` surface, the three planes as decoded (no colour conversion).
* ``PacketData()`` with ``bsl_data`` (address), ``bsl`` (bytes), ``pts``, ``decode_flag``; one packet
  is one access unit (our encoder's packets), flagged ``VideoPacketFlag.ENDOFPICTURE`` so that with LOW
  latency an IPPP stream (``bframes=0``) hands each frame back from the call that fed it. A packet with
  ``bsl == 0`` is end of stream (the SDK's ``NvDecoder::Decode`` adds ``CUVID_PKT_ENDOFSTREAM``); it is
  sent only when frames are still missing after the last packet, and the session is dropped after it.
* ``PyNvDecoder.Decode(packet) -> [DecodedFrame]``; a frame's buffer is the decoder's and is reused by
  the next ``Decode`` call, so every frame is copied before that. ``DecodedFrame.format``
  (``Pixel_Format``), ``framesize()``, ``GetPtrToPlane(0)`` (host output), ``__dlpack__`` (device output),
  ``PyNvDecoder.GetWidth()/GetHeight()`` (the cropped picture), ``SyncOnCUStream()``.
* ``GetDecoderCaps(gpuid=, codec=, chromaformat=cudaVideoChromaFormat '444', bitdepth=8)`` -> dict with
  ``num_decoder_engines``, ``width_min/max``, ``height_min/max``: refuses a GPU without HEVC 4:4:4
  (the SDK would silently fall back to NV12 output, i.e. lossy chroma) and videos it cannot take.

Output: by default host ``numpy`` ``[3, H, W]`` uint8 (``usedevicememory=False``: the decoder copies
the surface to host itself), because every consumer today (``layout.from_frame``, ``SlotWriter``'s numba
dequantization) is numpy-only. ``on_device=True`` keeps frames on the GPU and yields CUDA ``torch``
tensors ``[3, H, W]`` uint8 (needs torch), for a sink that writes the device KV pool directly.

Errors: no package, no driver (the package's import needs ``libcuda`` and ``libnvidia-encode``; in a
container ``NVIDIA_DRIVER_CAPABILITIES`` must include ``video``), no GPU or no HEVC 4:4:4 on it ->
:class:`NvdecUnavailable` (a configuration problem, not the chunk's). Anything the decoder raises on a
video, a frame of the wrong size/format, or a video NVDEC cannot take -> ``CorruptChunk``. Like the
software decoder, NVDEC has no checksum: a forged residual bit can decode to wrong codes (the blob's
CRCs are the integrity guarantee); NVDEC also conceals errors instead of failing, which only the
frame count can catch.

Threading: one :class:`NvdecDecoder` (one NVDEC session at a time) per thread, as for PyAV; run about
one per NVDEC engine (:func:`nvdec_engines`). PyNvVideoCodec's notes say it releases the GIL in its
C++ layer (not measured here).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from sgl_remote_kv.codec.errors import CorruptChunk

PACKAGE = "pynvvideocodec"  # PyPI name; the module is PyNvVideoCodec
MODULE = "PyNvVideoCodec"

_lock = threading.Lock()
_module: Any = None
_import_error: str | None = None
_caps: dict[int, dict[str, int]] = {}


class NvdecUnavailable(RuntimeError):
    """NVDEC cannot be used here (package, driver, GPU or HEVC 4:4:4 support missing)."""


def load() -> Any:
    """Import PyNvVideoCodec once per process; raises :class:`NvdecUnavailable` with the reason."""
    global _module, _import_error
    with _lock:
        if _module is None and _import_error is None:
            try:
                import PyNvVideoCodec as nvc
            except ModuleNotFoundError as e:
                if e.name != MODULE:
                    raise
                _import_error = (
                    f"PyNvVideoCodec is not installed: `pip install {PACKAGE}` (GPU machines only; the CPU "
                    "twin, device='cpu', needs nothing)"
                )
            except Exception as e:  # its __init__ raises RuntimeError without libcuda/libnvidia-encode
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _import_error = (
                    f"PyNvVideoCodec failed to import ({first}): it needs an NVIDIA driver with libcuda and "
                    "libnvidia-encode (in a container, NVIDIA_DRIVER_CAPABILITIES must include 'video')"
                )
            else:
                _module = nvc
        if _module is None:
            raise NvdecUnavailable(_import_error)
        return _module


def decoder_caps(gpu_id: int = 0) -> dict[str, int]:
    """NVDEC's limits for 8-bit 4:4:4 HEVC on ``gpu_id`` (cached). Raises :class:`NvdecUnavailable`."""
    nvc = load()
    with _lock:
        caps = _caps.get(gpu_id)
    if caps is None:
        try:
            raw = nvc.GetDecoderCaps(
                gpuid=gpu_id,
                codec=nvc.cudaVideoCodec.HEVC,
                chromaformat=nvc.cudaVideoChromaFormat.__members__["444"],
                bitdepth=8,
            )
        except Exception as e:
            raise NvdecUnavailable(f"NVDEC capability query failed on GPU {gpu_id}: {e}") from None
        caps = {str(k): int(v) for k, v in dict(raw).items()}
        if caps.get("width_max", 0) <= 0 or caps.get("height_max", 0) <= 0:
            raise NvdecUnavailable(f"GPU {gpu_id}'s NVDEC does not decode 8-bit 4:4:4 HEVC (caps {caps})")
        with _lock:
            _caps[gpu_id] = caps
    return caps


def nvdec_engines(gpu_id: int = 0) -> int:
    """NVDEC engines on ``gpu_id``: the number of decoder instances worth running on it."""
    return max(1, decoder_caps(gpu_id).get("num_decoder_engines", 1))


def unavailable_reason(gpu_id: int = 0) -> str | None:
    """``None`` when NVDEC can decode our videos on ``gpu_id``, else why not (one line)."""
    try:
        decoder_caps(gpu_id)
    except NvdecUnavailable as e:
        return str(e)
    return None


class _Session:
    """One PyNvVideoCodec decoder for one picture size."""

    def __init__(self, nvc: Any, gpu_id: int, size: tuple[int, int], on_device: bool) -> None:
        try:
            self.dec = nvc.CreateDecoder(
                gpuid=gpu_id,
                codec=nvc.cudaVideoCodec.HEVC,
                usedevicememory=on_device,
                outputColorType=nvc.OutputColorType.NATIVE,
                latency=nvc.DisplayDecodeLatencyType.LOW,
            )
        except Exception as e:
            raise NvdecUnavailable(f"cannot create an NVDEC decoder on GPU {gpu_id}: {e}") from None
        self.size = size


class NvdecDecoder:
    """The NVDEC backend: decodes one video at a time, reusing its session while the size stays.

    ``frames`` expects a video that already passed ``check_bitstream`` and yields new ``[3, H, W]``
    uint8 frames (numpy, or CUDA torch tensors with ``on_device``); counting them against the
    expected number is the caller's (:class:`VideoDecoder`'s) job. Owned by one thread.
    """

    def __init__(self, gpu_id: int = 0, on_device: bool = False) -> None:
        self.nvc = load()
        self.gpu_id, self.on_device = gpu_id, on_device
        self.caps = decoder_caps(gpu_id)
        self._session: _Session | None = None
        self.stats = {"sessions": 0, "flushes": 0, "videos": 0}
        if on_device:
            try:
                import torch  # noqa: F401
            except ImportError:
                raise NvdecUnavailable("on_device=True yields torch tensors; torch is missing") from None

    def close(self) -> None:
        self._session = None  # PyNvDecoder's destructor ends the NVDEC session

    def _open(self, height: int, width: int) -> _Session:
        c = self.caps
        lo_w, lo_h = c.get("width_min", 0), c.get("height_min", 0)
        if not (lo_w <= width <= c["width_max"] and lo_h <= height <= c["height_max"]):
            raise CorruptChunk(
                f"{width}x{height} video outside NVDEC's HEVC range {lo_w}x{lo_h}.."
                f"{c['width_max']}x{c['height_max']} (the CPU twin decodes it)"
            )
        if self._session is None or self._session.size != (height, width):
            self._session = None
            self._session = _Session(self.nvc, self.gpu_id, (height, width), self.on_device)
            self.stats["sessions"] += 1
        return self._session

    def frames(self, packets: list[memoryview], count: int, height: int, width: int) -> Iterator[Any]:
        nvc = self.nvc
        sess = self._open(height, width)
        self.stats["videos"] += 1
        n, flushed = 0, False
        try:
            for i, p in enumerate([*packets, None]):
                pkt = nvc.PacketData()
                if p is None:
                    if n >= count:
                        break  # every frame is out: no end of stream, the session serves the next video
                    pkt.decode_flag, flushed = nvc.VideoPacketFlag.ENDOFSTREAM, True
                    self.stats["flushes"] += 1
                    buf = None
                else:
                    buf = np.frombuffer(p, np.uint8)  # zero-copy; alive until Decode returns (parser copies)
                    pkt.bsl_data, pkt.bsl, pkt.pts = buf.ctypes.data, buf.size, i
                    pkt.decode_flag = nvc.VideoPacketFlag.ENDOFPICTURE
                try:
                    out = sess.dec.Decode(pkt)
                    if out and self.on_device:
                        sess.dec.SyncOnCUStream()
                except Exception as e:  # PyNvVCException & co: the decoder refused this video
                    raise CorruptChunk(f"nvdec: {e}") from None
                for fr in out:
                    n += 1
                    yield self._copy(sess, fr, n, height, width)  # before the next Decode reuses its buffer
        finally:
            if flushed:  # the parser saw end of stream: start the next video on a fresh session
                self._session = None

    def _copy(self, sess: _Session, fr: Any, n: int, height: int, width: int) -> Any:
        nvc = self.nvc
        w, h = sess.dec.GetWidth(), sess.dec.GetHeight()
        if fr.format != nvc.Pixel_Format.YUV444:
            raise NvdecUnavailable(f"NVDEC gave {fr.format}, not planar YUV444 (no 4:4:4 output on this GPU)")
        size = 3 * height * width
        if (w, h) != (width, height) or fr.framesize() != size:
            raise CorruptChunk(
                f"decoded frame {n} is {w}x{h} ({fr.framesize()} bytes), expected {width}x{height}"
            )
        if not self.on_device:
            ptr = fr.GetPtrToPlane(0)
            if not ptr:
                raise CorruptChunk(f"nvdec: frame {n} has no data")
            host = (ctypes.c_uint8 * size).from_address(ptr)
            return np.frombuffer(host, np.uint8).reshape(3, height, width).copy()
        import torch

        t = torch.from_dlpack(fr)
        if t.dtype != torch.uint8 or tuple(t.shape) not in ((3 * height, width), (3, height, width)):
            raise CorruptChunk(f"nvdec: frame {n} exported as {tuple(t.shape)} {t.dtype}")
        return t.reshape(3, height, width).clone()
