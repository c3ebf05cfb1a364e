"""Lossless HEVC encode/decode of ``[F, 3, H, W]`` uint8 plane stacks.

Two decoder backends behind one interface, :class:`VideoDecoder` (``frames(packets, count, height,
width)`` yielding ``[3, H, W]`` uint8 frames, ``reset()``), decoding the same Annex-B bitstreams:

* ``device="cpu"``, the CPU twin: FFmpeg's software ``hevc`` decoder through PyAV (imported on first
  use, like the encoder: a GPU machine decoding with NVDEC alone needs no PyAV).
* ``device="cuda"``: NVDEC through NVIDIA's PyNvVideoCodec (PyPI ``pynvvideocodec``), in
  :mod:`sgl_remote_kv.nvdec.nvcodec`, imported on first use; without the package, a driver, a GPU or
  HEVC 4:4:4 support it raises ``NvdecUnavailable`` (a ``RuntimeError``) with the reason.
  :func:`default_device` picks ``"cuda"`` when NVDEC is usable, else ``"cpu"``. UNTESTED on hardware:
  no GPU on the development machine; ``tests/test_gpu_nvdec.py`` checks it bit-exact against the twin.

Encoding is always libx265 on the CPU, whatever the device (write-back encodes on the CPU):
:func:`encoder_name` returns ``libx265`` for both devices. NVENC is not used: PyAV 18.1's wheel lists
``hevc_nvenc`` but it needs a driver to open (here ``avcodec_open2`` fails) and never ran, and one
encoder everywhere keeps the stored bitstreams identical whichever machine wrote them.

Frames are counted and size-checked here, identically for both backends: exactly ``count`` frames of
``[3, height, width]`` uint8, else ``CorruptChunk``; so is every decoder error.

Hostile input: FFmpeg sizes its frame buffers from the bitstream's sequence parameter set (SPS), not
from our chunk header (and NVDEC sizes its surfaces the same way), so a blob whose in-band SPS claims a
huge picture would make the decoder allocate before any check of ours sees a decoded frame.
:func:`check_bitstream` therefore parses every SPS of a video (pure Python, bounded work) and refuses,
*before either decoder is even created or fed*, any video whose SPS is malformed, is not 8-bit 4:4:4,
or declares a picture other than the expected ``height x width`` (coded size at most one 64-pixel CTB
larger), or that carries no SPS at all.

Threading: a :class:`VideoDecoder` belongs to one thread (neither a PyAV context nor a PyNvVideoCodec
decoder is thread-safe). FFmpeg decodes with the GIL released; PyNvVideoCodec says its C++ layer
releases it too (not measured). Encoding is called by whichever thread encodes a chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from types import ModuleType

import numpy as np

from sgl_remote_kv.codec.errors import CorruptChunk

PIX_FMT = "yuv444p"
FULL_RANGE = 2  # AVCOL_RANGE_JPEG: full-range tagging, so no device ever clamps to 16..235
DEVICES = ("cpu", "cuda")
MAX_SIDE = 8192  # NVDEC's HEVC limit per side (and HEVC level 6.2's 8192x4320 fits under it)
MAX_CTB = 64  # HEVC's largest coding tree block: coded size may exceed the picture by less than this
NAL_SPS = 33
MAX_SPS_BYTES = 1024  # a real SPS is tens of bytes; bounds the parse of a hostile one


ENCODER = "libx265"
SOFTWARE_DECODER = "hevc"  # FFmpeg's software decoder, through PyAV
NVDEC_DECODER = "pynvvideocodec"  # NVDEC through NVIDIA's PyNvVideoCodec


def _av() -> ModuleType:
    """PyAV, imported on first use: encoding and the CPU twin need it, the NVDEC backend does not."""
    import av

    return av


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")


def encoder_name(device: str) -> str:
    """The encoder for ``device``: libx265 (CPU) for both; write-back encodes on the CPU even on a GPU
    machine (``hevc_nvenc`` is not used, see the module docstring)."""
    _check_device(device)
    return ENCODER


def decoder_name(device: str) -> str:
    """The decoder backend for ``device``: ``hevc`` (FFmpeg software, PyAV) or ``pynvvideocodec``."""
    _check_device(device)
    return NVDEC_DECODER if device == "cuda" else SOFTWARE_DECODER


def default_device(gpu_id: int = 0) -> str:
    """``"cuda"`` when PyNvVideoCodec can decode our videos on ``gpu_id``, else ``"cpu"``.

    The first call imports PyNvVideoCodec and queries NVDEC (creating a CUDA context) when available."""
    return "cuda" if nvdec_unavailable_reason(gpu_id) is None else "cpu"


def nvdec_unavailable_reason(gpu_id: int = 0) -> str | None:
    """``None`` when the NVDEC backend is usable on ``gpu_id``, else the reason (one line)."""
    from sgl_remote_kv.nvdec import nvcodec

    return nvcodec.unavailable_reason(gpu_id)


def _encoder_options(frames: int, preset: str) -> dict[str, str]:
    """libx265's settings. ``info=0``: no "encoder info" SEI, which is ~1.1 KB of text per video holding
    the writing machine's CPU id (``cpuid=``), so without it the same planes give the same bytes on every
    machine (checked across x265's SIMD levels, ``asm=none`` to ``avx``)."""
    x265 = (
        f"lossless=1:pools=1:frame-threads=1:bframes=0:ref=3:keyint={max(frames, 1)}:info=0:log-level=error"
    )
    return {"x265-params": x265, "preset": preset}


def encode_planes(planes: np.ndarray, device: str = "cpu", preset: str = "fast") -> list[bytes]:
    """``[F, 3, h, w]`` uint8 -> the packets of a lossless HEVC video (headers in-band, first packet).

    Always libx265 on the CPU (``device`` is validated, then only names where the video will be
    decoded); one packet per frame, IPPP (``bframes=0``), which both decoder backends decode."""
    f_n, c, h, w = planes.shape
    if c != 3 or planes.dtype != np.uint8 or h % 2 or w % 2:
        raise ValueError(f"planes must be [F, 3, even h, even w] uint8, got {planes.shape} {planes.dtype}")
    av = _av()
    ctx = av.CodecContext.create(encoder_name(device), "w")
    ctx.width, ctx.height, ctx.pix_fmt = w, h, PIX_FMT
    ctx.time_base = Fraction(1, 25)
    ctx.color_range = FULL_RANGE
    ctx.options = _encoder_options(f_n, preset)
    packets: list[bytes] = []
    for i in range(f_n):
        frame = av.VideoFrame.from_ndarray(planes[i], format=PIX_FMT)
        frame.pts = i
        frame.color_range = FULL_RANGE
        packets += [bytes(p) for p in ctx.encode(frame)]
    packets += [bytes(p) for p in ctx.encode(None)]
    return packets


class _Bits:
    """MSB-first reader over an RBSP; raises ``CorruptChunk`` when it runs out."""

    def __init__(self, data: bytes) -> None:
        self._v, self._n, self._pos = int.from_bytes(data, "big"), 8 * len(data), 0

    def u(self, n: int) -> int:
        if self._pos + n > self._n:
            raise CorruptChunk("hevc SPS truncated")
        self._pos += n
        return (self._v >> (self._n - self._pos)) & ((1 << n) - 1)

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise CorruptChunk("hevc SPS: bad Exp-Golomb code")
        return (1 << zeros) - 1 + self.u(zeros)


def _nal_units(data: bytes) -> Iterator[bytes]:
    """The NAL units of an Annex-B byte stream (start code ``00 00 01``; trailing zeros kept)."""
    starts, i = [], data.find(b"\x00\x00\x01")
    while i >= 0:
        starts.append(i + 3)
        i = data.find(b"\x00\x00\x01", i + 3)
    if not starts:  # no start code: no NAL unit (a junk packet; check_bitstream then finds no SPS)
        return
    for a, b in zip(starts, [*starts[1:], len(data) + 3], strict=True):
        yield data[a : b - 3]


def _sps_picture(nal: bytes) -> tuple[int, int, int, int, int, int]:
    """(coded width, coded height, cropped width, cropped height, chroma_format_idc, bit depth) of
    an SPS NAL unit (H.265 7.3.2.2, up to the bit depths). Raises ``CorruptChunk``."""
    if len(nal) > MAX_SPS_BYTES:
        raise CorruptChunk(f"hevc SPS of {len(nal)} bytes")
    r = _Bits(nal[2:].replace(b"\x00\x00\x03", b"\x00\x00"))  # skip the NAL header; drop emulation bytes
    r.u(4)
    sub_layers = r.u(3)
    r.u(1)
    r.u(96)  # general profile_tier_level: profile (8) + compatibility (32) + constraints (48) + level (8)
    present = [(r.u(1), r.u(1)) for _ in range(sub_layers)]
    if sub_layers:
        r.u(2 * (8 - sub_layers))
    for profile, level in present:
        r.u(88 * profile + 8 * level)
    r.ue()  # sps_seq_parameter_set_id
    chroma = r.ue()
    if chroma == 3 and r.u(1):
        raise CorruptChunk("hevc SPS: separate colour planes")
    width, height = r.ue(), r.ue()
    crop = [r.ue() for _ in range(4)] if r.u(1) else [0, 0, 0, 0]  # left, right, top, bottom
    depth = max(r.ue(), r.ue()) + 8  # luma, chroma
    sub = 1 if chroma == 3 else 2  # SubWidthC/SubHeightC (only 4:4:4 is accepted anyway)
    shown = (width - sub * (crop[0] + crop[1]), height - sub * (crop[2] + crop[3]))
    return width, height, *shown, chroma, depth


def check_bitstream(packets: list[memoryview], height: int, width: int) -> None:
    """Refuse a video whose SPS could make the decoder allocate for anything but an 8-bit 4:4:4
    ``height x width`` picture. Pure Python, before any decoder exists. Raises ``CorruptChunk``."""
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise CorruptChunk(f"frame {width}x{height} beyond the decoder limit {MAX_SIDE}x{MAX_SIDE}")
    seen = 0
    for p in packets:
        for nal in _nal_units(bytes(p)):
            if len(nal) < 2 or (nal[0] >> 1) & 0x3F != NAL_SPS:
                continue
            seen += 1
            cw, ch, w, h, chroma, depth = _sps_picture(nal)
            if (w, h) != (width, height) or not (
                width <= cw < width + MAX_CTB and height <= ch < height + MAX_CTB
            ):
                raise CorruptChunk(f"hevc SPS declares {cw}x{ch} (shown {w}x{h}), expected {width}x{height}")
            if chroma != 3 or depth != 8:
                raise CorruptChunk(f"hevc SPS: chroma format {chroma}, {depth}-bit; expected 4:4:4 8-bit")
    if not seen:
        raise CorruptChunk("hevc video without a sequence parameter set")


class VideoDecoder:
    """One decoder instance: on ``device="cpu"`` a PyAV ``hevc`` context, on ``"cuda"`` an NVDEC session
    (PyNvVideoCodec, GPU ``gpu_id``). Owned and used by a single thread.

    Frames come out as new ``[3, H, W]`` uint8 arrays the caller owns. The NVDEC backend copies each
    frame to host numpy by default (the decoder writes it to host memory itself), because the consumers
    (``layout.from_frame``, ``SlotWriter``) are numpy-only; with ``on_device=True`` it yields CUDA torch
    tensors instead, so a consumer of such a decoder must accept numpy or torch.

    The constructor never raises (a pool builds its decoders on its worker threads); an unknown device
    or an unusable NVDEC surfaces on the first :meth:`frames` call.
    """

    def __init__(self, device: str = "cpu", *, gpu_id: int = 0, on_device: bool = False):
        self.device, self.gpu_id, self.on_device = device, gpu_id, on_device
        self._ctx = None

    def _context(self):
        """The backend's decoder, built on first use: a PyAV context or an ``NvdecDecoder``."""
        if self._ctx is None:
            if decoder_name(self.device) == NVDEC_DECODER:
                from sgl_remote_kv.nvdec.nvcodec import NvdecDecoder

                self._ctx = NvdecDecoder(self.gpu_id, self.on_device)
            else:
                self._ctx = _av().CodecContext.create(SOFTWARE_DECODER, "r")
                self._ctx.thread_count = 1
        return self._ctx

    def frames(self, packets: list[memoryview], count: int, height: int, width: int) -> Iterator[np.ndarray]:
        """Decode one video; yield exactly ``count`` frames as new ``[3, height, width]`` uint8 arrays
        (CUDA torch tensors for ``on_device=True``).

        Raises ``CorruptChunk`` for any decoder error or a frame of another size/format/count; a
        bitstream declaring another picture is refused before any decoder sees it (``check_bitstream``).
        """
        check_bitstream(packets, height, width)
        ctx = self._context()
        if self.device == "cuda":
            source = ctx.frames(packets, count, height, width)
        else:
            source = _software_frames(ctx, packets, count, height, width)
        n, done = 0, False
        try:
            for planes in source:
                n += 1
                if n > count:
                    raise CorruptChunk(f"video holds more than {count} frames")
                if tuple(planes.shape) != (3, height, width) or str(planes.dtype) not in _UINT8:
                    raise CorruptChunk(f"decoded frame {n} is {tuple(planes.shape)} {planes.dtype}")
                yield planes
            done = True
        finally:
            source.close()
            if not done:  # error or abandoned mid-video: never reuse a half-fed decoder
                self.reset()
        if n != count:
            raise CorruptChunk(f"video holds {n} frames, expected {count}")

    def reset(self) -> None:
        """Drop the decoder (after an error); the next video builds a fresh one."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None and self.device == "cuda":
            ctx.close()


_UINT8 = ("uint8", "torch.uint8")


def _software_frames(
    ctx, packets: list[memoryview], count: int, height: int, width: int
) -> Iterator[np.ndarray]:
    """The CPU twin: FFmpeg's software ``hevc`` through a PyAV context (flushed after a whole video)."""
    av = _av()
    n = 0
    try:
        for p in [*packets, None]:
            for fr in ctx.decode(av.Packet(p) if p is not None else None):
                n += 1
                if n > count or fr.width != width or fr.height != height or fr.format.name != PIX_FMT:
                    raise CorruptChunk(f"decoded frame {n} is {fr.width}x{fr.height} {fr.format.name}")
                yield fr.to_ndarray()
    except av.FFmpegError as e:
        raise CorruptChunk(f"hevc decoder: {e}") from None
    ctx.flush_buffers()
