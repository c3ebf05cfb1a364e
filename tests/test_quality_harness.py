"""The codec benchmark's quality harness on the real model: identity KV is exact, corrupted KV is not."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import kvdata, quality
from benchmarks.kvdata import TextKV
from sgl_remote_kv.codec.calibration import texts as ct

PREFIX, CONT = 128, 16


def test_bf16_bits_round_trip():
    x = np.array([0.0, -0.0, 1.0, -2.5, 3.14159, 1e-30, 6.5e4, np.inf], np.float32)
    b = kvdata.f32_to_bf16(x)
    back = kvdata.bf16_to_f32(b)
    assert np.array_equal(kvdata.f32_to_bf16(back), b)
    finite = np.isfinite(x) & (x != 0)
    assert np.all(np.abs(back[finite] - x[finite]) <= np.abs(x[finite]) * 2**-8)
    assert kvdata.f32_to_bf16(np.float32(1.0 + 2**-8)) == kvdata.f32_to_bf16(np.float32(1.0))  # ties to even


@pytest.fixture(scope="module")
def short_text():
    model, tok = kvdata.load_model(threads=2)
    path = next(
        ct.SOURCES[name].path for name, _, _ in kvdata.TEXT_SOURCES if ct.SOURCES[name].path.is_file()
    )
    ids = np.asarray(tok(path.read_text(errors="replace"))["input_ids"][: PREFIX + CONT], np.int64)
    k, v = kvdata.extract_kv(model, ids[:PREFIX])
    text = TextKV("test", "tune", "prose", str(path), len(ids), ids[:PREFIX], ids[PREFIX:], k, v)
    return model, text, quality.compute_baseline(model, text.prefix_ids, text.cont_ids)


def test_identity_kv_matches_recompute(short_text):
    model, text, base = short_text
    assert text.k.shape == (30, PREFIX, 3, 64) and text.k.dtype == np.float32
    res = quality.evaluate(model, text, base, text.k, text.v)
    assert res["kl"] < 1e-5
    assert res["top1"] == 1.0 and res["greedy_match"] == 1.0


def test_bf16_rounding_is_near_lossless(short_text):
    model, text, base = short_text
    res = quality.evaluate(
        model, text, base, kvdata.f32_to_bf16(text.k), kvdata.f32_to_bf16(text.v), greedy=False
    )
    assert res["kl"] < 1e-3 and res["top1"] >= 0.9 and res["greedy_match"] is None


def test_corrupted_kv_is_detected(short_text):
    model, text, base = short_text
    rng = np.random.default_rng(0)
    k = text.k + rng.normal(0, 3.0, text.k.shape).astype(np.float32) * np.abs(text.k).mean()
    v = np.roll(text.v, 7, axis=1)  # values of the wrong tokens
    res = quality.evaluate(model, text, base, k, v, greedy=False)
    assert res["kl"] > 0.5
    assert res["top1"] < 0.8
