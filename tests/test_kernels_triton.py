"""Triton kernels (run on CPU under TRITON_INTERPRET=1, in a subprocess) against torch references,
and the torch dequant reference against the numba CPU path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

_INTERPRETED = textwrap.dedent(
    """
    import torch
    from sgl_remote_kv.kernels.dequant import dequant_reference, dequant_triton
    from sgl_remote_kv.kernels.scatter import scatter_reference, scatter_triton

    g = torch.Generator().manual_seed(0)
    n = 0
    for groups, m, cs, dt in [(1, 127, False, torch.float16), (3, 31, True, torch.bfloat16),
                              (3, 7, False, torch.float32)]:
        codes = torch.randint(0, 2 * m + 1, (17, 192), dtype=torch.uint8, generator=g)
        scales = (torch.rand(17, groups, generator=g) * 4).to(torch.float16)
        chan = torch.rand(192, generator=g) + 0.5 if cs else None
        ref = dequant_reference(codes, scales, m, chan, dt)
        got = dequant_triton(codes, scales, m, chan, dt, block=64)
        assert got.dtype == dt and torch.equal(got, ref), (groups, m, dt, (got.float() - ref.float()).abs().max())
        n += 1
    for dt in (torch.float16, torch.bfloat16):
        src = torch.randn(4, 9, 3, 64, generator=g).to(dt)
        slots = torch.randperm(40, generator=g)[:9]
        pool_a = [torch.zeros(40, 3, 64, dtype=dt) for _ in range(4)]
        pool_b = [p.clone() for p in pool_a]
        scatter_reference(src, pool_a, slots)
        scatter_triton(src, pool_b, slots, block=64)
        assert all(torch.equal(a, b) for a, b in zip(pool_a, pool_b))
        assert all(torch.equal(pool_b[l][slots], src[l]) for l in range(4))
        n += 1
    print("OK", n)
    """
)


def test_triton_kernels_match_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "OK 5"


_TRELLIS = textwrap.dedent(
    """
    import torch
    from sgl_remote_kv.kernels.transform_encode import trellis_rates, trellis_search_reference, trellis_search_triton

    g = torch.Generator().manual_seed(0)
    u = torch.randn(70, 40, generator=g, dtype=torch.float64) * torch.rand(70, 1, generator=g, dtype=torch.float64) * 200
    u[5, 3] = 5e3  # a k beyond the symbols: an escape
    live = torch.rand(70, 40, generator=g) > 0.05  # tokens of scale 0 (exact sinks)
    u = torch.where(live, u, 0.0)
    bits, esc_bits = trellis_rates(u)
    ref = trellis_search_reference(u, live, bits, esc_bits)
    got = trellis_search_triton(u, live, bits, esc_bits, block=32)
    assert torch.equal(ref, got), (ref != got).sum()
    assert ref.abs().max() > 127 and (ref[~live] == 0).all()
    print("OK")
    """
)


def test_triton_trellis_search_matches_its_reference_under_interpreter():
    """The write-back's device trellis search (one launch on a GPU) picks the torch reference's codes, which the
    strict double checks against the host's numba search (``test_writeback_transform_device_encode.py``)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _TRELLIS], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "OK"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_reference_matches_numba_cpu_path(dtype):
    from sgl_remote_kv.kernels.dequant import dequant_reference

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec import quant
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.codec.format import layer_section, parse_header

    fp = synthetic.fingerprint(num_layers=2, dtype=dtype)
    k, v = synthetic.kv(fp.layout, 33, seed=1)
    codec = get_codec("quant_deflate", k_bins="64", granularity="head", k_channel_scale=True)
    blob = codec.encode(k, v, fp)
    hdr = parse_header(blob, fp)
    scratch = np.empty(codec.scratch_bytes(hdr, 1), np.uint8)
    n = codec.lossless_stage(layer_section(blob, hdr, 1), scratch)
    view = quant.split_layer(codec.spec, scratch[:n], 1, 33, 3, 64)
    out_k, out_v = np.empty((33, 3, 64), k.dtype), np.empty((33, 3, 64), k.dtype)
    codec.dequant_stage(hdr, 1, scratch[:n], out_k, out_v)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    ref = dequant_reference(
        torch.from_numpy(view.k_codes.copy()),
        torch.from_numpy(view.k_scales.copy()),
        view.mk,
        torch.from_numpy(view.k_cs.astype(np.float32)),
        tdt,
    )
    got = torch.from_numpy(out_k.reshape(33, -1).copy())
    if dtype == "bfloat16":
        got = got.view(torch.bfloat16)
    assert torch.equal(got, ref)


_INTERPRETED_TRANSFORM = textwrap.dedent(
    """
    import numpy as np, torch
    from sgl_remote_kv.kernels.transform import GPTJ, NEOX, TransformConsts, inverse_reference, inverse_triton

    rng = np.random.default_rng(0)
    n = 0
    # (groups, group width, head_dim, tokens, style, dtype): a 192-wide group (padded blocks), per-head groups,
    # a token count that is not a multiple of the block
    for n_g, gd, hd, t, style, dt in [(1, 192, 64, 40, NEOX, torch.bfloat16), (3, 64, 64, 17, GPTJ, torch.float16),
                                      (2, 32, 32, 33, NEOX, torch.float32)]:
        basis = np.linalg.qr(rng.standard_normal((2, n_g, gd, gd)))[0].astype(np.float32)
        steps = rng.uniform(0.01, 0.2, (2, n_g, gd)).astype(np.float32)
        mean = rng.standard_normal((2, n_g, gd)).astype(np.float32) * 0.1
        consts = TransformConsts.build(steps, basis, mean, hd, style).to(torch.from_numpy)
        q = torch.from_numpy(rng.integers(-300, 300, (2, n_g * gd, t)).astype(np.float32))
        scales = torch.from_numpy(rng.uniform(0.5, 3.0, (2, t)).astype(np.float32))
        ang = np.arange(5, 5 + t)[:, None] / 10000.0 ** (np.arange(hd // 2) * 2.0 / hd)
        cos, sin = (torch.from_numpy(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
        ref = torch.empty((2, t, n_g * gd), dtype=dt)
        inverse_reference(q, scales, cos, sin, consts, hd, style, True, ref)
        big = torch.zeros((2, t + 7, n_g * gd), dtype=dt)  # the kernel writes a token slice of a longer buffer
        inverse_triton(q, scales, cos, sin, consts, hd, style, True, big[:, 3 : 3 + t])
        got = big[:, 3 : 3 + t]
        d = (got.float() - ref.float()).abs()
        tol = ref.float().abs() * (2.0**-7 if dt == torch.bfloat16 else 2.0**-10 if dt == torch.float16 else 1e-5) + 1e-4
        assert torch.all(d <= tol), (n_g, gd, dt, float(d.max()))
        if dt != torch.float32:  # 16-bit outputs: the final rounding absorbs the GEMMs' fp32 differences, so
            # nearly all agree exactly; fp32 outputs keep each implementation's own summation order (BLAS
            # kernels differ by machine, e.g. OPENBLAS_CORETYPE), so only the tolerance above is a claim there
            assert float((got != ref).float().mean()) < 0.02, (n_g, gd, dt)
        assert torch.count_nonzero(big[:, :3]) == 0 and torch.count_nonzero(big[:, 3 + t :]) == 0
        n += 1
    print("OK", n)
    """
)


def test_transform_kernel_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_TRANSFORM], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "OK 3"


@pytest.mark.parametrize("dtype,style", [("bfloat16", "neox"), ("float16", "gptj"), ("float32", "neox")])
def test_transform_reference_matches_the_codec_cpu_stage(dtype, style):
    """``kernels.transform`` (escapes resolved on the device, RoPE as a second GEMM) against the codec's
    numba + BLAS dequant stage, on real chunk blobs with escapes and an exact sink token."""
    from calibration_helpers import make_calibration
    from sgl_remote_kv.kernels.transform import inverse_reference, resolve_escapes

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec import quant
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.codec.transform_ops import rope_tables
    from sgl_remote_kv.types import RopeSpec

    fp = synthetic.fingerprint(num_layers=2, dtype=dtype)
    lay = fp.layout
    cal = make_calibration(fp, step=0.02, seed=5, rope=RopeSpec(10000.0, lay.head_dim, style))
    codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.0005")
    for start in (0, 40):
        k, v = synthetic.kv(lay, 40, seed=start)
        blob = codec.encode(k, v, fp, start=start)
        hdr = codec.parse(blob, fp)
        want_k, want_v = np.empty_like(k[0]), np.empty_like(v[0])
        scratch = np.empty(codec.scratch_bytes(hdr, 1), np.uint8)
        vw = codec.codes_stage(blob, hdr, 1, scratch)
        assert vw.esc.size > 0 and vw.n_sink == (1 if start == 0 else 0)
        vw.dequant_into(dtype, want_k, want_v)  # the codec's CPU stage
        consts = codec.device_consts(1, vw.group, vw.groups).to(torch.from_numpy)  # fresh arrays
        cos, sin = (torch.from_numpy(a.copy()) for a in rope_tables(cal.rope, vw.start, vw.tokens))
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        out = torch.empty((2, 40, lay.num_kv_heads * lay.head_dim), dtype=tdt)
        q = resolve_escapes(torch.from_numpy(vw.sym.copy()), torch.from_numpy(vw.esc.copy()))
        inverse_reference(
            q, torch.from_numpy(vw.scales.copy()), cos, sin, consts, lay.head_dim, codec.rope_style, True, out
        )
        raw = out.view(torch.int16 if dtype == "bfloat16" else tdt).numpy()
        for kv, want in enumerate((want_k, want_v)):
            got = raw[kv].reshape(want.shape).view(want.dtype)
            if vw.n_sink:  # the sink rows are raw bytes on both paths
                got = got.copy()
                got[: vw.n_sink] = want[: vw.n_sink]
            g, w = quant.to_f32(got, dtype), quant.to_f32(want, dtype)
            step = 2.0**-7 if dtype == "bfloat16" else 2.0**-10 if dtype == "float16" else 1e-5
            assert np.all(np.abs(g - w) <= np.abs(w) * step + 1e-4), (start, kv, float(np.abs(g - w).max()))
            if dtype != "float32":  # float32 keeps each side's own rounding (the CPU sums exactly in int32)
                assert np.mean(got != want) < 0.02


def test_resolve_escapes_takes_values_in_order_and_never_faults_on_a_mismatch():
    from sgl_remote_kv.kernels.transform import resolve_escapes

    sym = torch.tensor([[[0, 130], [0, 128]], [[127, 0], [1, 255]]], dtype=torch.uint8)  # 3 escapes
    q = resolve_escapes(sym, torch.tensor([-300, 400, 999], dtype=torch.int16))
    assert q.tolist() == [[[-300.0, 2.0], [400.0, 0.0]], [[-1.0, 999.0], [-127.0, 127.0]]]
    for esc in ([5], [5, 6, 7, 8, 9]):  # too few / too many values (a late write's reused staging)
        got = resolve_escapes(sym, torch.tensor(esc, dtype=torch.int16))
        assert got.shape == sym.shape and torch.isfinite(got).all()


@pytest.mark.parametrize("quantizer", ["scalar", "trellis"])
def test_inverse_chunks_of_a_layer_in_one_call_equal_one_call_per_chunk(quantizer):
    """``inverse_chunks`` over 4 consecutive chunks (escapes in each, an exact sink token in the first, the
    trellis replayed per chunk) writes the same bits as 4 calls of one chunk each, whether the RoPE tables
    come per chunk or as one table of all the tokens."""
    from calibration_helpers import layer_views, make_calibration
    from sgl_remote_kv.kernels.transform import inverse_chunks, inverse_reference

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.codec.transform_ops import rope_tables
    from sgl_remote_kv.kvpool.sinks import put_sinks

    fp = synthetic.fingerprint(num_layers=2, dtype="bfloat16")
    lay, t = fp.layout, 24
    cal = make_calibration(fp, step=0.02, seed=5)
    codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.0005", quantizer=quantizer)
    views = layer_views(
        codec, fp, [codec.encode(*synthetic.kv(lay, t, seed=i), fp, start=i * t) for i in range(4)], 1
    )
    assert (
        all(vw.esc.size for vw in views)
        and views[0].n_sink == 1
        and views[0].trellis == (quantizer == "trellis")
    )
    consts = codec.device_consts(1, views[0].group, views[0].groups).to(torch.from_numpy)
    arrays = [[torch.from_numpy(a.copy()) for a in (vw.sym, vw.esc, vw.scales, vw.sinks)] for vw in views]
    sym, esc, scales, sinks = (list(f) for f in zip(*arrays, strict=True))
    tables = [[torch.from_numpy(a.copy()) for a in rope_tables(cal.rope, vw.start, t)] for vw in views]
    c = lay.num_kv_heads * lay.head_dim
    args = (consts, lay.head_dim, codec.rope_style)
    one = torch.empty((2, 4 * t, c), dtype=torch.bfloat16)
    for i in range(4):
        part = one[:, i * t : (i + 1) * t]
        inverse_chunks(
            sym[i : i + 1], esc[i : i + 1], scales[i : i + 1], [tables[i][0]], [tables[i][1]], *args, part,
            views[0].trellis, inverse_reference,
        )  # fmt: skip
        put_sinks(sinks[i : i + 1], part)
    together = torch.empty_like(one)
    coss, sins = [tb[0] for tb in tables], [tb[1] for tb in tables]
    inverse_chunks(sym, esc, scales, coss, sins, *args, together, views[0].trellis, inverse_reference)
    put_sinks(sinks, together)
    assert torch.equal(together.view(torch.int16), one.view(torch.int16))
    whole = [torch.from_numpy(a.copy()) for a in rope_tables(cal.rope, 0, 4 * t)]
    together.zero_()
    inverse_chunks(
        sym, esc, scales, [whole[0]], [whole[1]], *args, together, views[0].trellis, inverse_reference
    )
    put_sinks(sinks, together)
    assert torch.equal(together.view(torch.int16), one.view(torch.int16))
