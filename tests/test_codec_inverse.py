"""The transform codec's CPU decode (``codec.inverse``): 16-bit decode matrices and the exact integer GEMM,
against a float64 reference of the same math; the mean, RoPE and storage dtype applied in the same pass."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from sgl_remote_kv.codec.inverse import InverseTables


def _tables(groups=2, gd=24, seed=0):
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((2, groups, gd, gd)))[0].astype(np.float32)
    steps = rng.uniform(0.005, 0.3, (2, groups, gd)).astype(np.float32)  # spanning 60x, like a real level
    return steps, basis, InverseTables.build(steps, basis)


def _inverse(tab, kv, group, sym, esc, scale):
    """(x [n_g, T, gd] float32, escapes used): ``decode`` with no mean, no RoPE, float32 out."""
    gd = tab.col.shape[-1]
    n_g, t_n = sym.shape[0] // gd, sym.shape[1]
    out = np.full((t_n, n_g, gd), np.nan, np.float32)
    used = tab.decode(kv, group, sym, esc, scale, np.zeros((n_g, gd), np.float32), None, 8, 0, out)
    return out.transpose(1, 0, 2), used


def _symbols(rng, c_n, t_n, escape_rate=0.02):
    """Symbols [C, T] with escape symbols (0) at ``escape_rate``, their values (component-major), the q."""
    q = rng.integers(-127, 128, (c_n, t_n))
    esc_at = rng.random((c_n, t_n)) < escape_rate
    big = rng.integers(128, 32768, (c_n, t_n)) * rng.choice([-1, 1], (c_n, t_n))
    q = np.where(esc_at, big, q)
    sym = np.where(esc_at, 0, q + 128).astype(np.uint8)
    return sym, q[esc_at].astype(np.int16), q  # boolean indexing is row-major = component-major


def test_decode_matrix_is_w_to_sixteen_bits_and_splits_into_int8_halves():
    steps, basis, tab = _tables()
    w = steps[..., :, None].astype(np.float64) * np.swapaxes(basis, -1, -2)  # W[c, j] = step_c * basis[j, c]
    gd = w.shape[-1]
    hi, lo = (tab.w2.numpy()[..., :gd].astype(np.int64), tab.w2.numpy()[..., gd:].astype(np.int64))
    assert tab.w2.numpy().dtype == np.int8 and lo.min() >= -128 and hi.min() >= -127 and hi.max() <= 127
    wi = hi * 256 + lo
    np.testing.assert_array_equal(tab.weff, (wi * tab.col[..., None, :]).astype(np.float32))
    peak = np.abs(w).max(axis=-2)
    assert np.all(np.abs(tab.weff - w) <= peak[..., None, :] * 2.0**-16 * 1.01)
    assert np.abs(wi).max() == 127 * 256  # each column's largest entry uses the full range


@pytest.mark.parametrize("t_n", [1, 17, 256])
def test_inverse_equals_the_float64_reference_with_escapes_and_a_group_offset(t_n):
    steps, basis, tab = _tables(groups=3, gd=16, seed=t_n)
    rng = np.random.default_rng(t_n)
    sym, esc, q = _symbols(rng, 2 * 16, t_n)  # a rank holding groups 1 and 2
    scale = rng.uniform(0.1, 3.0, t_n).astype(np.float32)
    for kv in (0, 1):
        x, used = _inverse(tab, kv, 1, sym, esc, scale)
        assert used == esc.size and x.shape == (2, t_n, 16)
        for g in range(2):
            w = tab.weff[kv, 1 + g].astype(np.float64)
            want = (q[g * 16 : (g + 1) * 16].T * scale[:, None].astype(np.float64)) @ w
            np.testing.assert_allclose(x[g], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("style", [0, 1])
def test_decode_adds_the_mean_applies_rope_and_rounds_to_the_storage_dtype(style):
    """Mean and RoPE (K) per head_dim block as ``transform_ops.apply_rope`` does them; fp16 / bf16 output is
    the float32 output rounded, bit for bit."""
    from sgl_remote_kv.codec import transform_ops as ops
    from sgl_remote_kv.types import RopeSpec

    _, _, tab = _tables(groups=2, gd=32, seed=7)
    rng = np.random.default_rng(7)
    t_n, start = 40, 300
    sym, esc, _ = _symbols(rng, 64, t_n)
    scale = rng.uniform(0.1, 3.0, t_n).astype(np.float32)
    mean = rng.standard_normal((2, 32)).astype(np.float32)
    rope = RopeSpec(theta=10000.0, rotary_dim=16, style="neox" if style == 0 else "gptj")
    cos, sin = ops.rope_tables(rope, start, t_n)
    x, _ = _inverse(tab, 0, 0, sym, esc, scale)
    want = (x.transpose(1, 0, 2) + mean).reshape(t_n, 4, 16).copy()  # [T, heads of 16, 16]
    ops.apply_rope(want, rope, start, 1.0)
    out = np.empty((t_n, 2, 32), np.float32)
    assert tab.decode(0, 0, sym, esc, scale, mean, (cos, sin, style), 16, 0, out) == esc.size
    np.testing.assert_allclose(out.reshape(want.shape), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    half = torch.from_numpy(out)
    for mode, dt in ((1, torch.float16), (2, torch.bfloat16)):
        bits = np.empty((t_n, 2, 32), np.uint16)
        tab.decode(0, 0, sym, esc, scale, mean, (cos, sin, style), 16, mode, bits)
        np.testing.assert_array_equal(bits, half.to(dt).view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("int_mm", [False, True])
@pytest.mark.parametrize("gd", [16, 64, 192, 1024, 1040])
def test_the_integer_gemm_is_exact_for_every_token_count(gd, int_mm):
    """Both GEMMs: the float one (float32 up to 1024 columns, float64 beyond) is exact for every T a chunk can
    have, also at the extremes (every product 2^14: a float32 sum of 1024 of them is exactly 2^24); torch's
    ``_int_mm`` where it is taken (from 2 rows, where its probe found it exact: it sums one row wrongly)."""
    from sgl_remote_kv.codec.inverse import _int_gemm, _int_mm_exact, _work

    if int_mm and not _int_mm_exact():
        pytest.skip("torch's _int_mm is not exact on this CPU (the float GEMM serves)")
    rng = np.random.default_rng(gd)
    counts = [*range(1, 20), 63, 64, 65, 255, 256] if gd <= 192 else [1, 2, 17, 256]
    if int_mm:  # from 2 rows; the wide ones cost seconds of int64 reference, once is enough
        counts = counts[1:] if gd <= 192 else [2, 17]
    for t_n in counts:
        for extreme in (False, True):
            if extreme:
                w = np.full((gd, 2 * gd), -128, np.int8)
                codes = np.full((gd, t_n), -128, np.int8)
            else:
                w = rng.integers(-128, 128, (gd, 2 * gd)).astype(np.int8)
                codes = rng.integers(-128, 128, (gd, t_n)).astype(np.int8)
            out = torch.empty((t_n, 2 * gd), dtype=torch.int32)
            _int_gemm(
                torch.from_numpy(codes).t(), torch.from_numpy(w), out, *_work(t_n, gd)[-1], int_mm=int_mm
            )
            np.testing.assert_array_equal(
                out.numpy(), codes.T.astype(np.int64) @ w.astype(np.int64), err_msg=f"{t_n} {extreme}"
            )


def test_the_int8_gemm_is_taken_only_where_it_is_exact(monkeypatch):
    """The probe rejects an ``_int_mm`` that saturates 16-bit pair sums (oneDNN without VNNI, or under
    ``ONEDNN_MAX_CPU_ISA=AVX2``); with more than one torch thread, or one row, the float GEMM runs."""
    from sgl_remote_kv.codec import inverse

    real = torch._int_mm

    def saturating(a, b, out):
        pairs = a.numpy().astype(np.int64)[:, :, None] * b.numpy().astype(np.int64)[None]  # [T, K, N]
        k = pairs.shape[1] - pairs.shape[1] % 2
        sat = np.clip(pairs[:, 0:k:2] + pairs[:, 1:k:2], -32768, 32767).sum(1) + pairs[:, k:].sum(1)
        out.copy_(torch.from_numpy(sat.astype(np.int32)))

    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not inverse._probe_int_mm()
    monkeypatch.setattr(torch, "_int_mm", real)
    monkeypatch.setattr(inverse, "_INT_MM_EXACT", [True])
    monkeypatch.setattr(inverse, "_INT_MM_FAST", [True])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert inverse._use_int_mm(2) and not inverse._use_int_mm(1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not inverse._use_int_mm(256)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(inverse, "_INT_MM_EXACT", [False])
    assert not inverse._use_int_mm(256)


def test_the_int8_gemm_is_taken_only_where_it_is_faster(monkeypatch):
    """Where torch's ``_int_mm`` is exact but slower than the float GEMM (torch's fallback where oneDNN has no
    int8 kernel for the CPU: 35-45x the float GEMM on an AVX2-only EPYC), the decode takes the float GEMM; where
    it is faster, ``_int_mm``. Timed once per process, on this thread's CPU time."""
    from sgl_remote_kv.codec import inverse

    def busy(a, b, out):  # exact or not does not matter to the timing: only the CPU it takes
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:
            pass

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(inverse, "_INT_MM_EXACT", [True])
    monkeypatch.setattr(inverse, "_INT_MM_FAST", [])
    monkeypatch.setattr(torch, "_int_mm", busy)
    assert not inverse._use_int_mm(256) and inverse._INT_MM_FAST == [False]
    monkeypatch.setattr(torch, "_int_mm", lambda a, b, out: out.zero_())  # no work: faster than any GEMM
    assert not inverse._use_int_mm(256)  # the answer is kept for the process
    monkeypatch.setattr(inverse, "_INT_MM_FAST", [])
    assert inverse._use_int_mm(256) and inverse._INT_MM_FAST == [True]


def test_int32_sums_are_exact_up_to_their_bound():
    """``decode`` sums in int32 when every partial sum fits it (``_int32_sums``): at the bound, every code the
    largest escape and every entry of a column the largest integer, the sum is still exact; one more, and
    it takes int64 (the same result)."""
    from sgl_remote_kv.codec import inverse

    gd, t_n = 192, 3
    biggest = (2**31 - 1) // (gd * inverse._WMAX)  # 344
    assert inverse._int32_sums(np.array([biggest, -5], np.int16), gd)
    assert not inverse._int32_sums(np.array([-biggest - 1], np.int16), gd)
    wi = np.full((2, 1, gd, gd), inverse._WMAX, np.int64)
    hi = np.floor_divide(wi + 128, 256)
    w2 = torch.from_numpy(np.concatenate([hi, wi - 256 * hi], -1).astype(np.int8))
    col = np.ones((2, 1, gd), np.float32)
    tab = inverse.InverseTables(w2, wi.astype(np.int32), col, wi.astype(np.float32))
    sym = np.zeros((gd, t_n), np.uint8)  # every value escaped
    for value in (biggest, biggest + 1):
        esc = np.full(gd * t_n, value, np.int16)
        out = np.empty((t_n, 1, gd), np.float32)
        zero = np.zeros((1, gd), np.float32)
        assert tab.decode(0, 0, sym, esc, np.ones(t_n, np.float32), zero, None, 32, 0, out) == esc.size
        assert np.all(out == np.float32(gd * value * inverse._WMAX))


def test_an_escaped_code_decodes_to_the_same_float_as_the_symbol():
    """The escape correction is added in integers: escaping a code that has a symbol changes nothing, bit for
    bit (the rANS variant escapes symbols its tables cannot code; the Deflate variant codes them)."""
    _, _, tab = _tables(groups=2, gd=16, seed=4)
    rng = np.random.default_rng(4)
    sym, esc, q = _symbols(rng, 32, 50, escape_rate=0.0)
    scale = rng.uniform(0.1, 3.0, 50).astype(np.float32)
    want = _inverse(tab, 1, 0, sym, esc, scale)[0].copy()
    at = rng.random(sym.shape) < 0.1
    sym2 = np.where(at, 0, sym).astype(np.uint8)
    x, used = _inverse(tab, 1, 0, sym2, q[at].astype(np.int16), scale)
    assert used == at.sum() > 10
    np.testing.assert_array_equal(x, want)


def test_escapes_that_run_out_or_are_left_over_are_reported():
    _, _, tab = _tables(groups=1, gd=16)
    rng = np.random.default_rng(3)
    sym, esc, _ = _symbols(rng, 16, 40, escape_rate=0.1)
    assert esc.size > 2
    scale = np.ones(40, np.float32)
    assert _inverse(tab, 0, 0, sym, esc[:-1], scale)[1] == -1  # one escape symbol without its value
    assert _inverse(tab, 0, 0, sym, np.concatenate([esc, esc[:1]]), scale)[1] == esc.size  # a value left over


def test_concurrent_threads_each_get_their_own_work_arrays():
    _, _, tab = _tables(groups=1, gd=32)
    rng = np.random.default_rng(9)
    cases = [_symbols(rng, 32, t, 0.01) + (rng.uniform(0.5, 2, t).astype(np.float32),) for t in (64, 64, 33)]
    want = [_inverse(tab, 0, 0, s, e, sc)[0].copy() for s, e, _, sc in cases]
    bad = []

    def run(i):
        s, e, _, sc = cases[i]
        for _ in range(200):
            x, _ = _inverse(tab, 0, 0, s, e, sc)
            if not np.array_equal(x, want[i]):
                bad.append(i)
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
