"""Lossless HEVC encode/decode of ``[F, 3, H, W]`` uint8 plane stacks through PyAV (FFmpeg).

The only hardware-specific code of the NVDEC path lives here: :func:`encoder_name` / :func:`decoder_name`
pick ``hevc_nvenc`` / ``hevc_cuvid`` for ``device="cuda"`` and libx265 / FFmpeg's software ``hevc`` for
``device="cpu"``. Both sides speak the same Annex-B bitstream, so a blob encoded on one decodes on the
other. UNTESTED: the ``cuda`` paths never ran (no GPU on the development machine); bit-exactness after
NVDEC must be verified on first use (``tests/test_nvdec_codec.py`` does it for whatever device is given).

Hostile input: FFmpeg sizes its frame buffers from the bitstream's sequence parameter set (SPS), not
from our chunk header, so a blob whose in-band SPS claims a huge picture would make FFmpeg allocate
before any check of ours sees a decoded frame. :func:`check_bitstream` therefore parses every SPS of a
video (pure Python, bounded work) and refuses, *before a decoder context is even created*, any video
whose SPS is malformed, is not 8-bit 4:4:4, or declares a picture other than the expected
``height x width`` (coded size at most one 64-pixel CTB larger), or that carries no SPS at all.

Threading: a :class:`VideoDecoder` belongs to one thread (its PyAV context is not thread-safe); FFmpeg's
decode runs with the GIL released. Encoding is called by whichever thread encodes a chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from fractions import Fraction

import av
import numpy as np

from sgl_remote_kv.codec.errors import CorruptChunk

logger = logging.getLogger(__name__)

PIX_FMT = "yuv444p"
FULL_RANGE = 2  # AVCOL_RANGE_JPEG: full-range tagging, so no device ever clamps to 16..235
DEVICES = ("cpu", "cuda")
MAX_SIDE = 8192  # NVDEC's HEVC limit per side (and HEVC level 6.2's 8192x4320 fits under it)
MAX_CTB = 64  # HEVC's largest coding tree block: coded size may exceed the picture by less than this
NAL_SPS = 33
MAX_SPS_BYTES = 1024  # a real SPS is tens of bytes; bounds the parse of a hostile one


def encoder_name(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}")
    return "hevc_nvenc" if device == "cuda" else "libx265"


def decoder_name(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}")
    return "hevc_cuvid" if device == "cuda" else "hevc"


def _encoder_options(device: str, frames: int, preset: str) -> dict[str, str]:
    if device == "cuda":  # UNTESTED: NVENC lossless, no B-frames, <= 3 reference frames
        return {"tune": "lossless", "preset": "p4", "bf": "0", "refs": "3", "g": str(max(frames, 1))}
    x265 = f"lossless=1:pools=1:frame-threads=1:bframes=0:ref=3:keyint={max(frames, 1)}:log-level=error"
    return {"x265-params": x265, "preset": preset}


def encode_planes(planes: np.ndarray, device: str = "cpu", preset: str = "fast") -> list[bytes]:
    """``[F, 3, h, w]`` uint8 -> the packets of a lossless HEVC video (headers in-band, first packet)."""
    f_n, c, h, w = planes.shape
    if c != 3 or planes.dtype != np.uint8 or h % 2 or w % 2:
        raise ValueError(f"planes must be [F, 3, even h, even w] uint8, got {planes.shape} {planes.dtype}")
    ctx = av.CodecContext.create(encoder_name(device), "w")
    ctx.width, ctx.height, ctx.pix_fmt = w, h, PIX_FMT
    ctx.time_base = Fraction(1, 25)
    ctx.color_range = FULL_RANGE
    ctx.options = _encoder_options(device, f_n, preset)
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
    """One decoder instance (on a GPU: one NVDEC session). Owned and used by a single thread."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._ctx = None

    def _context(self):
        if self._ctx is None:
            self._ctx = av.CodecContext.create(decoder_name(self.device), "r")
            self._ctx.thread_count = 1
        return self._ctx

    def frames(self, packets: list[memoryview], count: int, height: int, width: int) -> Iterator[np.ndarray]:
        """Decode one video; yield exactly ``count`` frames as new ``[3, height, width]`` uint8 arrays.

        Raises ``CorruptChunk`` for any decoder error or a frame of another size/format/count; a
        bitstream declaring another picture is refused before the decoder sees it (``check_bitstream``).
        """
        check_bitstream(packets, height, width)
        ctx = self._context()
        n, done = 0, False
        try:
            for p in [*packets, None]:
                for fr in ctx.decode(av.Packet(p) if p is not None else None):
                    n += 1
                    if n > count or fr.width != width or fr.height != height or fr.format.name != PIX_FMT:
                        raise CorruptChunk(f"decoded frame {n} is {fr.width}x{fr.height} {fr.format.name}")
                    yield fr.to_ndarray()
            done = True
        except av.FFmpegError as e:
            raise CorruptChunk(f"hevc decoder: {e}") from None
        finally:
            if not done:  # error or abandoned mid-video: never reuse a half-fed context
                self.reset()
        self._ctx.flush_buffers()
        if n != count:
            raise CorruptChunk(f"video holds {n} frames, expected {count}")

    def reset(self) -> None:
        """Drop the context (after an error); the next video builds a fresh one."""
        self._ctx = None
