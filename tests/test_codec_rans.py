"""The rANS core: exact round trips over skewed/sparse distributions, table builders, corrupt streams."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_remote_kv.codec import rans


def _tables(rng, n_ctx, nsym, bits, zero_frac=0.3):
    counts = rng.gamma(0.3, 1.0, size=(n_ctx, nsym)) * (rng.random((n_ctx, nsym)) > zero_frac)
    counts[:, 0] += 1e-3  # every row has mass
    freq = rans.normalize_counts(counts, bits)
    return counts, freq


@pytest.mark.parametrize("bits", [10, 12, 15])
@pytest.mark.parametrize("nsym", [3, 31, 255, 256])
def test_roundtrip_skewed_and_sparse(bits, nsym):
    rng = np.random.default_rng(bits * 1000 + nsym)
    t_n, c_n, ctx0 = 53, 7, 2
    counts, freq = _tables(rng, ctx0 + c_n + 1, nsym, bits)
    assert (freq.sum(axis=1) == 1 << bits).all()
    assert ((counts > 0) <= (freq > 0)).all()  # every seen symbol stays encodable
    codes = np.empty((t_n, c_n), np.uint8)
    for c in range(c_n):  # draw from the context's own distribution
        p = freq[ctx0 + c] / freq[ctx0 + c].sum()
        codes[:, c] = rng.choice(nsym, size=t_n, p=p)
    cum, ok = rans.build_cum(freq, bits)
    cum16, bucket, ok2 = rans.build_decode_tables(freq, bits)
    assert ok and ok2
    words, ok = rans.encode(codes, ctx0, freq, cum, bits)
    assert ok
    out = np.zeros_like(codes)
    assert rans.decode(words, ctx0, cum16, bucket, bits, out) == 0
    assert np.array_equal(out, codes)


def test_bucket_points_at_the_symbol_holding_its_first_slot():
    rng = np.random.default_rng(1)
    _, freq = _tables(rng, 5, 40, 12)
    cum16, bucket, ok = rans.build_decode_tables(freq, 12)
    assert ok
    for r in range(5):
        for b in range(bucket.shape[1]):
            s = bucket[r, b]
            assert cum16[r, s] <= b << rans.BUCKET_SHIFT < cum16[r, s + 1]


def test_zero_frequency_symbol_refused_and_bad_tables_flagged():
    freq = np.zeros((1, 4), np.uint16)
    freq[0, :2] = 2048
    cum, _ = rans.build_cum(freq, 12)
    _, ok = rans.encode(np.full((3, 1), 3, np.uint8), 0, freq, cum, 12)
    assert not ok
    bad = freq.copy()
    bad[0, 0] = 100
    assert not rans.build_cum(bad, 12)[1] and not rans.build_decode_tables(bad, 12)[2]


def test_corrupt_streams_never_crash():
    rng = np.random.default_rng(2)
    _, freq = _tables(rng, 4, 64, 12)
    cum, _ = rans.build_cum(freq, 12)
    cum16, bucket, _ = rans.build_decode_tables(freq, 12)
    codes = rng.integers(0, 64, size=(40, 4)).astype(np.uint8)
    codes = np.where(freq[np.arange(4)[None, :], codes] > 0, codes, np.argmax(freq, axis=1)[None, :]).astype(
        np.uint8
    )
    words, ok = rans.encode(codes, 0, freq, cum, 12)
    assert ok
    out = np.zeros_like(codes)
    failures = 0
    for trial in range(500):
        w = words.copy()
        if trial % 3 == 0:
            w = w[: int(rng.integers(0, w.size))]
        elif trial % 3 == 1:
            w[rng.integers(w.size)] ^= np.uint16(1 << int(rng.integers(16)))
        else:
            w = np.concatenate([w, rng.integers(0, 65536, int(rng.integers(1, 5))).astype(np.uint16)])
        rc = rans.decode(w, 0, cum16, bucket, 12, out)
        failures += rc != 0
        assert out.max() < 64
    assert failures > 300
