"""The DPU data plane decodes transform-codec chunks: the pool holds exactly what the in-process decode
gives, for both lossless stages; a data plane without the chunks' calibration refuses the client. The calibration reaches the data-plane process the way it reaches a server: a file in
its cache directory (``SRKV_CACHE_DIR``)."""

from __future__ import annotations

import numpy as np
import pytest
from calibration_helpers import make_calibration
from dpu_helpers import (
    CHUNK,
    FP,
    LAYOUT,
    dataplane_stage_items,
    make_pool,
    pool_tokens,
    put_chunks,
    random_chunks,
)

from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec.base import decode, get_codec
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """A calibration of the DPU tests' model, saved where a child process started now looks for it."""
    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "cache"))
    cal = make_calibration(FP, step=0.05)
    cal.save(cm.default_dir())
    yield cal
    cm.unregister(cal.calib_id)


def _client(url, codec, output: str = "auto") -> DpuClient:
    spec = DataPlaneSettings(
        workers=(1, 1, 1, 1),
        layer_group=2,
        slots=2,
        slot_bytes=2 * chunk_bytes(LAYOUT, CHUNK),
        store_timeout_s=2.0,
    )
    cfg = DpuClientConfig(
        url, dest_slots=2, dest_slot_bytes=3 * chunk_bytes(LAYOUT, CHUNK), process=spec, output=output
    )
    c = DpuClient(cfg, FP, codec)
    c.start()
    return c


@pytest.mark.parametrize("output", ["kv", "codes"])
@pytest.mark.parametrize(
    "entropy,quantizer",
    [("deflate", "scalar"), ("rans", "scalar"), ("deflate", "trellis"), ("zstd", "trellis")],
)
def test_data_plane_decodes_transform_chunks_like_the_host(tmp_path, calibrated, entropy, quantizer, output):
    """Decoded on the data plane (``kv``) or only entropy-decoded there and inverse-transformed by the
    pool's writer (``codes``; here a CPU pool, so on the host's CPU): the same bits as the host's decode."""
    codec = get_codec(
        "transform", calibration=calibrated.calib_id.hex(), entropy=entropy, quantizer=quantizer
    )
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(5, seed=4))
    c = _client(url, codec, output)
    try:
        target = make_pool(LAYOUT, 1024, 5 * CHUNK)
        res = c.fetch("t", keys, CHUNK, target, timeout=60)
        assert res.hit_chunks == 5 and not res.failures
        stages = dataplane_stage_items(c)
        assert (stages["dequant"] == 0) == (output == "codes") and stages["inflate"] > 0
        for i in range(5):
            k, v = decode(blobs[i], FP)
            pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
            assert np.array_equal(k, pk) and np.array_equal(v, pv), f"chunk {i} differs"
    finally:
        c.close()


@pytest.mark.parametrize("quantizer", ["scalar", "trellis"])
def test_transform_codes_into_a_strict_device_pool(tmp_path, calibrated, monkeypatch, quantizer):
    """A device pool's default (``auto``): the data plane only entropy-decodes, the writer runs the inverse
    transform (and a trellis chunk's replay) on the device (``kernels.transform``; the strict double runs
    its torch reference), the host none of it. Equal to the host's decode up to float32 rounding."""
    from strict_device import StrictDevice

    from sgl_remote_kv.codec import transform, trellis

    def refuse(*a, **k):
        raise AssertionError("host decode on a device pool's read path")

    codec = get_codec("transform", calibration=calibrated.calib_id.hex(), quantizer=quantizer)
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(5, seed=5))
    dev = StrictDevice()
    c = _client(url, codec)
    try:
        target = make_pool(LAYOUT, 1024, 5 * CHUNK, ops=dev)
        with monkeypatch.context() as m:
            for owner, name in (
                (transform.TransformView, "dequant_into"),
                (transform.TransformView, "replayed"),
            ):
                m.setattr(owner, name, refuse)
            m.setattr(trellis, "replay", refuse)
            res = c.fetch("t", keys, CHUNK, target, timeout=60)
        assert res.hit_chunks == 5 and not res.failures
        assert dataplane_stage_items(c)["dequant"] == 0  # the data plane only inflated
        assert target.writer.stats["device_dequant"] == target.writer.stats["writes"] > 0
        for i in range(5):
            k, v = decode(blobs[i], FP)
            pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
            for a, b in ((k, pk), (v, pv)):
                a, b = _f32(a), _f32(b)
                assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max(), f"chunk {i} differs"
    finally:
        c.close()
        dev.close()


def _f32(a: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).float().numpy()


def test_data_plane_without_the_calibration_refuses_the_client(tmp_path, calibrated, monkeypatch):
    """It cannot build the codec, so it refuses the registration, naming the calibration (the server then
    decodes in-process or, without the calibration itself, writes another codec): nothing is fetched."""
    codec = get_codec("transform", calibration=calibrated.calib_id.hex())
    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "empty-cache"))  # the child finds no calibration
    with pytest.raises(RuntimeError, match=f"calibration '{calibrated.calib_id.hex()}' is not registered"):
        _client(f"file://{tmp_path}/store", codec)
