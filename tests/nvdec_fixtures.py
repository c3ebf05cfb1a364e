"""Committed hevc chunks for the NVDEC tests: real chunk blobs with their expected decodes.

The GPU machine has no PyAV (its wheel alone is 34 MiB of the 64 MiB a device call carries), so the NVDEC
suite (``tests/test_gpu_nvdec.py``) decodes bitstreams made here and compares against decodes made here.
Each fixture in ``tests/fixtures/nvdec/`` is one chunk of synthetic KV encoded by the product's own path
(``get_codec("hevc", ...).encode``: quantization, ``nvdec/layout.py``'s frame layout, libx265 lossless
through PyAV) and stored as ``<name>.npz`` (no pickles): ``blob`` (the chunk, uint8), ``frames`` (every
video's decoded frames in chunk order, group by group, K video then V video: ``[N, 3, H, W]`` uint8) and,
where kept, ``k``/``v`` (the chunk's CPU decode, storage dtype). ``manifest.json`` records the specs,
sizes, SHA-256s and the encoder's versions.

``tests/test_nvdec_fixtures.py`` (default run) checks that the committed bitstreams still decode to the
committed frames and KV with PyAV, and that the current encoder and layout still produce them byte for
byte, so they cannot go stale silently. Regenerate after an intended change (encoder, layout, codec)::

    .venv/bin/python tests/nvdec_fixtures.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIR = Path(__file__).resolve().parent / "fixtures" / "nvdec"
MANIFEST = DIR / "manifest.json"


@dataclass(frozen=True)
class FixtureSpec:
    """One chunk: synthetic KV (``benchmarks.synthetic_kv``, bfloat16) of ``layers x tokens x heads x dim``
    encoded by ``get_codec("hevc", **params)``."""

    name: str
    layers: int
    heads: int
    dim: int
    tokens: int
    seed: int
    params: tuple[tuple[str, object], ...]
    keep_kv: bool = False
    dtype: str = "bfloat16"


# Frame sizes NVDEC must take in one decoder, one after the other: square, taller than wide, wider than
# tall, widths and heights not multiples of 64 (pitch and crop handling), a full 3-layer group and a
# 1-layer group (constant U/V planes). Non-square frames need a ``min_side`` under the default 256 (still
# over NVDEC's 144) to pass ``hevc_codec.check_geometry``'s bound on padding.
SPECS = (
    # 4 layers (groups of 3 + 1), 8 frames of 256x256 per video
    FixtureSpec("square", 4, 3, 64, 64, 7, (("tokens_per_frame", 8),), keep_kv=True),
    # one 3-layer group, 4 frames of 240x192: a column of ten 3x1-head blocks
    FixtureSpec(
        "tall",
        3,
        3,
        64,
        40,
        8,
        (("tokens_per_frame", 10), ("tiling", "3x1/8x8"), ("grid_cols", 1), ("min_side", 192)),
    ),
    # one 2-layer group, 4 frames of 192x240: two rows of ten 1x3-head blocks
    FixtureSpec("wide", 2, 3, 64, 64, 9, (("tokens_per_frame", 16), ("grid_cols", 10), ("min_side", 192))),
)


@dataclass(frozen=True)
class Video:
    """One video of a chunk: its packets (views into the blob) and the frames it must decode to."""

    packets: list[memoryview]
    count: int
    height: int
    width: int
    frames: np.ndarray  # [count, 3, height, width] uint8


@dataclass(frozen=True)
class Fixture:
    spec: FixtureSpec
    blob: bytes
    fingerprint: object  # ModelFingerprint
    codec: object  # HevcCodec
    videos: tuple[Video, ...]
    kv: tuple[np.ndarray, np.ndarray] | None


def fingerprint(spec: FixtureSpec):
    from benchmarks import synthetic_kv as synthetic

    return synthetic.fingerprint(num_layers=spec.layers, heads=spec.heads, dim=spec.dim, dtype=spec.dtype)


def codec_of(spec: FixtureSpec):
    import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")

    from sgl_remote_kv.codec.base import get_codec

    return get_codec("hevc", **dict(spec.params))


def encode(spec: FixtureSpec) -> bytes:
    """The chunk blob the current encoder and layout make for ``spec`` (needs PyAV)."""
    from benchmarks import synthetic_kv as synthetic

    fp = fingerprint(spec)
    k, v = synthetic.kv(fp.layout, spec.tokens, seed=spec.seed)
    return codec_of(spec).encode(k, v, fp)


def videos_of(codec, fp, blob: bytes) -> list[tuple[list[memoryview], int, int, int]]:
    """(packets, frames, height, width) of every video in ``blob``: group by group, K then V."""
    from sgl_remote_kv.codec.format import layer_section, parse_header

    hdr = parse_header(blob, fp)
    lay = hdr.layout
    fl = codec.frame_layout(hdr.num_tokens, lay.num_kv_heads, lay.head_dim)
    out = []
    for first in range(0, lay.num_layers, 3):  # hevc_codec.GROUP
        gs = codec.parse_group(layer_section(blob, hdr, first), fl)
        out += [(list(packets), fl.frames, *fl.size) for packets in gs.videos]
    return out


def cpu_decode(spec: FixtureSpec, blob: bytes) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Every video's frames and the chunk's KV, decoded with the CPU twin (PyAV's software ``hevc``)."""
    from sgl_remote_kv.nvdec import video

    fp, codec = fingerprint(spec), codec_of(spec)
    frames = []
    for packets, count, h, w in videos_of(codec, fp, blob):
        frames += list(video.VideoDecoder("cpu").frames(packets, count, h, w))
    return np.stack(frames), codec.decode(blob, fp)


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes() if isinstance(a, np.ndarray) else bytes(a))
    return h.hexdigest()


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def load(name: str) -> Fixture:
    """A committed fixture, without PyAV (the GPU machine's case)."""
    spec = next(s for s in SPECS if s.name == name)
    with np.load(DIR / f"{name}.npz", allow_pickle=False) as z:
        blob = z["blob"].tobytes()
        frames = z["frames"]
        kv = (z["k"], z["v"]) if spec.keep_kv else None
    fp, codec = fingerprint(spec), codec_of(spec)
    videos, at = [], 0
    for packets, count, h, w in videos_of(codec, fp, blob):
        videos.append(Video(packets, count, h, w, frames[at : at + count]))
        at += count
    if at != len(frames):
        raise ValueError(f"{name}: {len(frames)} committed frames, the blob's videos hold {at}")
    return Fixture(spec, blob, fp, codec, tuple(videos), kv)


def write() -> dict:
    """Encode every spec, decode it with the CPU twin, write the ``.npz`` files and the manifest."""
    import av

    DIR.mkdir(parents=True, exist_ok=True)
    chunks = {}
    for spec in SPECS:
        blob = encode(spec)
        frames, (k, v) = cpu_decode(spec, blob)
        arrays = {"blob": np.frombuffer(blob, np.uint8), "frames": frames}
        if spec.keep_kv:
            arrays |= {"k": k, "v": v}
        np.savez_compressed(DIR / f"{spec.name}.npz", **arrays)
        vids = videos_of(codec_of(spec), fingerprint(spec), blob)
        chunks[spec.name] = {
            "layers": spec.layers,
            "heads": spec.heads,
            "dim": spec.dim,
            "tokens": spec.tokens,
            "dtype": spec.dtype,
            "seed": spec.seed,
            "codec_params": dict(spec.params),
            "videos": [[count, h, w] for _, count, h, w in vids],
            "blob_bytes": len(blob),
            "blob_sha256": _sha(blob),
            "frames_sha256": _sha(frames),
            "kv_sha256": _sha(k, v) if spec.keep_kv else None,
            "file_bytes": (DIR / f"{spec.name}.npz").stat().st_size,
        }
    doc = {
        "generator": "tests/nvdec_fixtures.py (python tests/nvdec_fixtures.py)",
        "encoder": {"pyav": av.__version__, "ffmpeg": av.ffmpeg_version_info, "libx265": "PyAV's bundled"},
        "chunks": chunks,
    }
    MANIFEST.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    sys.path.insert(0, str(DIR.parents[2]))  # the repo root: benchmarks.synthetic_kv
    out = write()
    total = sum(c["file_bytes"] for c in out["chunks"].values()) + MANIFEST.stat().st_size
    for name, c in out["chunks"].items():
        print(f"{name}: blob {c['blob_bytes']} B, videos {c['videos']}, file {c['file_bytes']} B")
    print(f"{DIR}: {total / 1024:.0f} KiB")
