"""The re-implemented peers of the RD benchmark: TurboQuant (benchmarks/turboquant_peer.py) and the
lossless nvCOMP-style ANS (benchmarks/ans_peer.py). Synthetic data only; cheap."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import ans_peer, kvdata, synthetic_kv
from benchmarks import turboquant_peer as tq
from sgl_remote_kv.types import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64, dtype="bfloat16")
# TurboQuant_mse distortion of unit vectors at b = 1..4 bits (the paper's Theorem 1 discussion)
PAPER_DMSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


def _kv(tokens: int = 32, seed: int = 0):
    return synthetic_kv.kv(LAYOUT, tokens, seed)


def _rel_mse(a: np.ndarray, b: np.ndarray) -> float:
    fa, fb = kvdata.to_f32(a).astype(np.float64), kvdata.to_f32(b).astype(np.float64)
    return float(np.mean((fa - fb) ** 2) / np.mean(fa**2))


@pytest.mark.parametrize("d", [32, 64])
def test_rotations_are_orthogonal(d):
    for rot in (tq.haar_rotation(d, 1), tq.hadamard(d)):
        np.testing.assert_allclose(rot @ rot.T, np.eye(d), atol=1e-12)
    np.testing.assert_array_equal(tq.haar_rotation(d, 5), tq.haar_rotation(d, 5))  # seeded
    assert not np.allclose(tq.haar_rotation(d, 5), tq.haar_rotation(d, 6))
    with pytest.raises(ValueError, match="power-of-two"):
        tq.hadamard(48)


def test_lloyd_max_codebook():
    c, b = tq.lloyd_max(64, 1)
    np.testing.assert_allclose(c, [-math.sqrt(2 / (math.pi * 64)), math.sqrt(2 / (math.pi * 64))], rtol=0.01)
    for bits in (2, 3, 4):
        c, b = tq.lloyd_max(64, bits)
        assert c.size == 1 << bits and np.all(np.diff(c) > 0)
        np.testing.assert_allclose(c, -c[::-1], atol=1e-9)  # symmetric density
        assert np.all((b > c[:-1]) & (b < c[1:]))


def test_mse_distortion_matches_the_paper():
    """On Gaussian vectors (any direction is as good as the rotation makes it): D_mse falls ~4x per bit,
    is within 15% of the paper's values and under its bound sqrt(3) pi / 2 * 4^-b."""
    x = np.random.default_rng(0).standard_normal((4000, 64))
    unit, _ = tq._norms(x)
    prev = 4.0  # 4^-b from b = 0 (D_mse = 1: everything lost)
    for bits, paper in PAPER_DMSE.items():
        q = tq.MSE(64, bits, tq.haar_rotation(64, bits))
        dmse = float(np.mean(np.sum((unit - q.unit_of(q.indices(unit))) ** 2, axis=1)))
        assert dmse == pytest.approx(paper, rel=0.15)
        assert dmse <= math.sqrt(3) * math.pi / 2 / 4**bits
        assert dmse < prev / 3
        prev = dmse


def test_prod_is_unbiased_for_inner_products():
    """TurboQuant_prod: E <y, x~> = <y, x> (the QJL stage's purpose); _mse at the same bits is biased low."""
    rng = np.random.default_rng(1)
    d, n = 64, 3000
    x = rng.standard_normal(d)
    x /= np.linalg.norm(x)
    y = x + 0.5 * rng.standard_normal(d)
    est = []
    for i in range(n // 100):  # fresh randomness (rotation and S) per trial
        p = tq.Prod(d, 2, tq.haar_rotation(d, 100 + i), rng.standard_normal((d, d)))
        r = tq.Reader(b"".join(p.encode(np.repeat(x[None], 100, 0))))
        est.append(p.decode(r, 100)[0] @ y)
    assert np.mean(est) == pytest.approx(x @ y, rel=0.05)


@pytest.mark.parametrize("bits", ["2", "2.5", "3", "4", "5"])
@pytest.mark.parametrize("variant", ["mse", "prod"])
def test_turboquant_round_trip_and_bytes(variant, bits):
    k, v = _kv()
    codec = tq.make({"variant": variant, "bits": bits})
    blob = codec.encode(k, v, 0)
    dk, dv = codec.decode(blob)
    assert dk.shape == k.shape and dk.dtype == np.uint16 and dv.shape == v.shape
    n_vec = LAYOUT.num_layers * 32 * LAYOUT.num_kv_heads  # head vectors per tensor
    b = float(bits)
    groups = 2 if b % 1 else 1
    key_bits = 64 * b + 16 * groups * (2 if variant == "prod" else 1)  # indices (+ QJL signs) + norms
    val_bits = 64 * b + 16 * groups
    masks = 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads * 64 // 8 if groups == 2 else 0
    assert len(blob) == 16 + masks + n_vec * (key_bits + val_bits) / 8
    assert _rel_mse(v, dv) < 1.5 * PAPER_DMSE.get(int(b), 0.003)  # values are _mse in both variants
    if variant == "mse":
        assert _rel_mse(k, dk) < 1.5 * PAPER_DMSE.get(int(b), 0.003)


def test_turboquant_distortion_falls_with_budget():
    k, v = _kv()
    errs = []
    for bits in tq.PAPER_BITS:
        dk, dv = tq.make({"variant": "mse", "bits": bits}).decode(
            tq.make({"variant": "mse", "bits": bits}).encode(k, v, 0)
        )
        errs.append(_rel_mse(k, dk) + _rel_mse(v, dv))
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False))


@pytest.mark.parametrize("preset", list(tq.VLLM_PRESETS))
def test_vllm_presets_round_trip_and_bytes(preset):
    k, v = _kv()
    codec = tq.make({"variant": "vllm", "preset": preset})
    blob = codec.encode(k, v, 0)
    dk, dv = codec.decode(blob)
    # boundary layers (first/last 2 of 4 here: all) stay exact
    np.testing.assert_array_equal(dk[[0, 1, 2, 3]], k[[0, 1, 2, 3]])
    lay = KVLayout(num_layers=6, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    k6, v6 = synthetic_kv.kv(lay, 16, 2)
    blob = codec.encode(k6, v6, 0)
    dk6, dv6 = codec.decode(blob)
    np.testing.assert_array_equal(dk6[[0, 1, 4, 5]], k6[[0, 1, 4, 5]])
    kb, vb, _ = tq.VLLM_PRESETS[preset]
    n = 2 * 16 * 3  # quantized head vectors per tensor (layers 2, 3)
    key = n * 64 if kb == 8 else n * (64 * kb // 8 + 2)
    assert len(blob) == 16 + 2 * 4 * 16 * 3 * 64 * 2 + key + n * (64 * vb // 8 + 4)
    assert _rel_mse(k6[2:4], dk6[2:4]) < (0.002 if kb == 8 else 0.05)
    assert _rel_mse(v6[2:4], dv6[2:4]) < 0.05


def test_turboquant_bad_params():
    with pytest.raises(ValueError):
        tq.TurboQuant(2.25)
    with pytest.raises(ValueError):
        tq.TurboQuant(3, keys="qjl")
    with pytest.raises(ValueError):
        tq.TurboQuantVLLM("2bit")


@pytest.mark.parametrize("mode", ans_peer.MODES)
def test_ans_exact_round_trip(mode):
    rng = np.random.default_rng(3)
    cases = [
        _kv(64, 4),  # KV-like bf16: outlier channels, drift
        tuple(rng.integers(0, 1 << 16, (2, 3, 40, 3, 64), dtype=np.uint16)),  # random bits: stored raw
        (np.zeros((2, 8, 3, 64), np.uint16), np.full((2, 8, 3, 64), 0x3F80, np.uint16)),  # one symbol
        tuple(rng.integers(0, 1 << 16, (2, 1, 5, 1, 3), dtype=np.uint16)),  # tiny, odd sizes
    ]
    for k, v in cases:
        codec = ans_peer.ANS(mode, chunk_bytes=4096)
        dk, dv = codec.decode(codec.encode(k, v, 0))
        np.testing.assert_array_equal(dk, k)
        np.testing.assert_array_equal(dv, v)


def test_ans_bytes():
    k, v = _kv(128, 5)
    raw = k.nbytes + v.nbytes
    f16 = len(ans_peer.ANS("float16").encode(k, v, 0))
    char = len(ans_peer.ANS("char").encode(k, v, 0))
    assert f16 < char < raw  # byte planes model the exponent byte better than interleaved bytes
    # random bits do not shrink: each piece stored raw behind its 9-byte record header
    r = np.random.default_rng(6).integers(0, 1 << 16, k.shape, dtype=np.uint16)
    pieces = 2 * math.ceil(r.nbytes / ans_peer.CHUNK_BYTES)
    assert len(ans_peer.ANS().encode(r, r, 0)) == 20 + 2 * r.nbytes + 9 * pieces
    with pytest.raises(ValueError):
        ans_peer.ANS("float32")
    with pytest.raises(ValueError):
        ans_peer.ANS().encode(k.astype(np.float32), v, 0)
