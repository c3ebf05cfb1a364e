"""Shared by the NVDEC backend tests (``test_gpu_nvdec.py`` on a GPU, ``test_nvdec_nvcodec.py`` on CPU):
HEVC videos and real hevc chunks of NVDEC-sized pictures, frame decoding and comparison helpers."""

from __future__ import annotations

import functools

import numpy as np
import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")
from sgl_remote_kv.nvdec import video

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec
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
