"""The committed hevc chunks of the NVDEC suite (``tests/fixtures/nvdec/``, made by ``tests/nvdec_fixtures.py``)
are still true: they decode with PyAV's software ``hevc`` to the committed frames and KV, and the current
encoder and layout still produce them byte for byte (else: regenerate, ``.venv/bin/python
tests/nvdec_fixtures.py``). The GPU machine loads them without PyAV, which is checked here too."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import nvdec_fixtures as nf
import pytest
from sgl_remote_kv.nvdec import video

ROOT = Path(__file__).resolve().parents[1]
NAMES = [s.name for s in nf.SPECS]
REGENERATE = "regenerate them: .venv/bin/python tests/nvdec_fixtures.py (and commit tests/fixtures/nvdec/)"


@pytest.mark.parametrize("name", NAMES)
def test_committed_bitstreams_decode_to_the_committed_frames_and_kv(name):
    fx = nf.load(name)
    assert fx.videos, name
    for i, vid in enumerate(fx.videos):
        got = np.stack(list(video.VideoDecoder("cpu").frames(vid.packets, vid.count, vid.height, vid.width)))
        assert got.shape == vid.frames.shape and got.dtype == np.uint8
        assert np.array_equal(got, vid.frames), f"{name} video {i}: {int((got != vid.frames).sum())} differ"
    if fx.kv is not None:
        k, v = fx.codec.decode(fx.blob, fx.fingerprint)
        assert np.array_equal(k.view(np.uint16), fx.kv[0].view(np.uint16))
        assert np.array_equal(v.view(np.uint16), fx.kv[1].view(np.uint16))


@pytest.mark.parametrize("name", NAMES)
def test_the_current_encoder_and_layout_produce_the_committed_chunks(name):
    spec = next(s for s in nf.SPECS if s.name == name)
    committed = nf.load(name).blob
    now = nf.encode(spec)
    assert now == committed, (
        f"{name}: the hevc encode path now makes {len(now)} bytes (sha256 "
        f"{hashlib.sha256(now).hexdigest()[:16]}), the committed chunk is {len(committed)}: {REGENERATE}"
    )


def test_manifest_describes_the_files():
    doc = nf.manifest()
    assert sorted(doc["chunks"]) == sorted(NAMES)
    total = nf.MANIFEST.stat().st_size
    for name, entry in doc["chunks"].items():
        fx = nf.load(name)
        assert entry["blob_sha256"] == hashlib.sha256(fx.blob).hexdigest(), REGENERATE
        assert entry["videos"] == [[v.count, v.height, v.width] for v in fx.videos]
        total += (nf.DIR / f"{name}.npz").stat().st_size
    assert total < 1 << 20, f"the NVDEC fixtures travel to the GPU machine: keep them under 1 MiB ({total} B)"


def test_fixtures_load_and_parse_without_pyav():
    """What the GPU machine does (no PyAV there): import the hevc codec, load every fixture, check every
    video's SPS, all with ``av`` unimportable."""
    code = (
        "import sys; sys.modules['av'] = None\n"
        "import nvdec_fixtures as nf\n"
        "from sgl_remote_kv.nvdec import video\n"
        "n = 0\n"
        "for s in nf.SPECS:\n"
        "    for v in nf.load(s.name).videos:\n"
        "        video.check_bitstream(v.packets, v.height, v.width); n += 1\n"
        "assert 'av' not in sys.modules or sys.modules['av'] is None\n"
        "print(n)\n"
    )
    env_path = f"{ROOT}:{ROOT / 'tests'}"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": env_path},
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip()) == sum(len(c["videos"]) for c in nf.manifest()["chunks"].values())
