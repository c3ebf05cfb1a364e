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
