"""Lossless HEVC encode/decode of ``[F, 3, H, W]`` uint8 plane stacks through PyAV (FFmpeg).

The only hardware-specific code of the NVDEC path lives here: :func:`encoder_name` / :func:`decoder_name`
pick ``hevc_nvenc`` / ``hevc_cuvid`` for ``device="cuda"`` and libx265 / FFmpeg's software ``hevc`` for
``device="cpu"``. Both sides speak the same Annex-B bitstream, so a blob encoded on one decodes on the
other. UNTESTED: the ``cuda`` paths never ran (no GPU on the development machine); bit-exactness after
NVDEC must be verified on first use (``tests/test_nvdec_codec.py`` does it for whatever device is given).

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

        Raises ``CorruptChunk`` for any decoder error or a frame of another size/format/count.
        """
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
