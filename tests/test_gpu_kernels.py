"""GPU suite: the Triton scatter and dequant kernels on CUDA tensors against their torch references.

``pytest.mark.gpu``: deselected by default; run with ``pytest -m gpu`` or, on a bare GPU machine,
``scripts/gpu_check.sh``. Every test is skipped, with the reason, where torch sees no CUDA device or Triton
is missing (``tests/gpu_gate.py``). (``tests/test_kernels_triton.py`` runs the same kernels under Triton's CPU
interpreter; here they are compiled for and run on the GPU.)

Checks, for float32 / float16 / bfloat16 and odd sizes (tokens not a multiple of anything, rows of 3x64
and 5x128 values, i.e. not a multiple of the kernels' 256-value block, 1 to 7 layers):

* ``scatter_triton(src, pool, slots)`` writes exactly what ``scatter_reference`` writes, bit for bit,
  with slots in random order; pool rows that are not in ``slots`` keep their bytes, and so do guard rows
  laid out between and around the layers' buffers (catches writes past a buffer's ends);
* ``dequant_triton`` equals ``dequant_reference`` bit for bit (the reference computed on the CPU and on
  CUDA), also when writing into a caller's ``out`` between guard rows (the KV writer's use);
* ``inverse_triton`` (the transform codec's dequant stage) equals ``inverse_reference`` computed on the CPU
  up to float32 summation order (at most one step of the output dtype), for a 192-wide group, per-head
  groups and both RoPE pairings, writing a token slice of a longer buffer and nothing around it;
* the scatter into a real SGLang ``MHATokenToKVPool`` on CUDA (K and V planes in one launch), skipped with
  the reason when SGLang cannot be imported.
"""

from __future__ import annotations

import pytest
import torch
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)
from sgl_remote_kv.kernels.dequant import dequant_reference, dequant_triton
from sgl_remote_kv.kernels.scatter import scatter_reference, scatter_triton

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_needs("triton")]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GUARD = 5  # guard rows before, between and after the layers' buffers

# (layers, tokens, heads, head_dim); rows = heads * head_dim = 64, 192, 640, 1024, 128 values
SCATTER_SHAPES = [(1, 1, 1, 64), (3, 37, 3, 64), (5, 300, 5, 128), (2, 257, 8, 128), (7, 1000, 1, 128)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # CPU generator: the same data on every machine


def _guarded_pool(layers: int, size: int, heads: int, dim: int, dtype: torch.dtype, seed: int):
    """One random buffer; each layer's pool is a contiguous view with GUARD rows around it."""
    buf = torch.randn(GUARD + layers * (size + GUARD), heads, dim, generator=_gen(seed)).to(dtype)
    buf = buf.to(DEVICE)
    pool = [buf[GUARD + i * (size + GUARD) : GUARD + i * (size + GUARD) + size] for i in range(layers)]
    guards = torch.ones(buf.shape[0], dtype=torch.bool, device=DEVICE)
    for i in range(layers):
        guards[GUARD + i * (size + GUARD) : GUARD + i * (size + GUARD) + size] = False
    return buf, pool, guards


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:  # bitwise: -0.0 vs 0.0 and NaN payloads count as different
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(view), b.view(view)
    return torch.equal(a, b)


def _check_scatter(src: torch.Tensor, pool_dtype: torch.dtype, size: int, seed: int) -> None:
    layers, t, heads, dim = src.shape
    slots = torch.randperm(size, generator=_gen(seed + 1))[:t].to(DEVICE)  # random order, unique
    buf, pool, guards = _guarded_pool(layers, size, heads, dim, pool_dtype, seed + 2)
    before = buf.clone()
    ref = [p.clone() for p in pool]

    scatter_triton(src, pool, slots)
    scatter_reference(src, ref, slots)
    torch.cuda.synchronize()

    untouched = torch.ones(size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    for i in range(layers):
        assert _same_bits(pool[i], ref[i]), f"layer {i}: Triton scatter differs from the torch reference"
        assert _same_bits(pool[i][slots], src[i].to(pool_dtype)), f"layer {i}: slots hold other values"
        assert _same_bits(pool[i][untouched], before[GUARD + i * (size + GUARD) :][:size][untouched]), (
            f"layer {i}: a row outside slots changed"
        )
    assert _same_bits(buf[guards], before[guards]), "a guard row around the pool buffers changed"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SCATTER_SHAPES, ids=lambda s: "L{}-T{}-H{}-D{}".format(*s))
def test_scatter_triton_matches_reference(dtype, shape):
    layers, t, heads, dim = shape
    src = torch.randn(layers, t, heads, dim, generator=_gen(t)).to(DTYPES[dtype]).to(DEVICE)
    _check_scatter(src, DTYPES[dtype], size=3 * t + 11, seed=t)


@pytest.mark.parametrize("pool_dtype", ["float16", "bfloat16"])
def test_scatter_triton_converts_like_torch(pool_dtype):
    """float32 source into a 16-bit pool: the kernel's cast rounds like torch's ``.to()`` (nearest even)."""
    src = (torch.randn(3, 37, 3, 64, generator=_gen(7)) * 3).to(DEVICE)
    _check_scatter(src, DTYPES[pool_dtype], size=200, seed=7)


# (tokens, channels, scale groups, m, channel scales); channels = heads * head_dim (3x64, 5x128, 8x128)
DEQUANT_CASES = [
    (1, 192, 1, 127, False),
    (37, 192, 3, 31, True),
    (300, 640, 5, 7, False),
    (257, 640, 1, 127, True),
    (1000, 1024, 8, 15, True),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scales_dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: "T{}-C{}-G{}-m{}-cs{:d}".format(*c))
def test_dequant_triton_matches_reference(dtype, scales_dtype, case):
    t, c, groups, m, with_cs = case
    g = _gen(t + c)
    codes = torch.randint(0, 2 * m + 1, (t, c), dtype=torch.uint8, generator=g)
    scales = (torch.rand(t, groups, generator=g) * 4).to(DTYPES[scales_dtype])
    chan = torch.rand(c, generator=g) + 0.5 if with_cs else None
    # the reference on the CPU is the definition; on CUDA it must agree with itself and the kernel
    want = dequant_reference(codes, scales, m, chan, DTYPES[dtype]).to(DEVICE)
    ref_gpu = dequant_reference(
        codes.to(DEVICE), scales.to(DEVICE), m, None if chan is None else chan.to(DEVICE), DTYPES[dtype]
    )
    got = dequant_triton(
        codes.to(DEVICE), scales.to(DEVICE), m, None if chan is None else chan.to(DEVICE), DTYPES[dtype]
    )
    torch.cuda.synchronize()
    assert got.dtype == DTYPES[dtype] and got.shape == (t, c) and got.device.type == "cuda"
    assert _same_bits(ref_gpu, want), "the torch reference differs between CPU and CUDA"
    if not _same_bits(got, want):
        diff = (got.float() - want.float()).abs()
        pytest.fail(
            f"Triton dequant differs from the reference in {int((diff > 0).sum())} values, max {diff.max()}"
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dequant_triton_writes_only_its_out_rows(dtype):
    t, c, groups, m = 33, 640, 5, 31
    g = _gen(5)
    codes = torch.randint(0, 2 * m + 1, (t, c), dtype=torch.uint8, generator=g).to(DEVICE)
    scales = (torch.rand(t, groups, generator=g) * 4).to(DEVICE)  # float32, as the KV writer passes them
    chan = (torch.rand(c, generator=g) + 0.5).to(DEVICE)
    buf = torch.randn(t + 2 * GUARD, c, generator=g).to(DTYPES[dtype]).to(DEVICE)
    before = buf.clone()
    out = buf[GUARD : GUARD + t]
    ret = dequant_triton(codes, scales, m, chan, DTYPES[dtype], out=out)
    torch.cuda.synchronize()
    assert ret.data_ptr() == out.data_ptr()
    assert _same_bits(
        out, dequant_reference(codes.cpu(), scales.cpu(), m, chan.cpu(), DTYPES[dtype]).to(DEVICE)
    )
    assert _same_bits(buf[:GUARD], before[:GUARD]) and _same_bits(buf[GUARD + t :], before[GUARD + t :])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.gpu_needs("sglang.srt.mem_cache.memory_pool")
def test_scatter_into_real_sglang_pool(dtype):
    """K and V planes of 3 layers in one launch into SGLang's own ``MHATokenToKVPool`` buffers."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layers, heads, dim, size, t = 3, 5, 128, 400, 61
    pool = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=DTYPES[dtype],
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device=DEVICE,
        enable_memory_saver=False,
    )
    planes = [pool.get_key_buffer(i) for i in range(layers)] + [
        pool.get_value_buffer(i) for i in range(layers)
    ]
    for i, p in enumerate(planes):  # SGLang zero-fills; random bytes make "untouched" meaningful
        p.copy_(torch.randn(p.shape, generator=_gen(100 + i)).to(p.dtype))
    before = [p.clone() for p in planes]
    src = torch.randn(2 * layers, t, heads, dim, generator=_gen(3)).to(DTYPES[dtype]).to(DEVICE)
    slots = (torch.randperm(size, generator=_gen(4))[:t] + 1).to(DEVICE)  # slot 0 is SGLang's padding slot
    ref = [p.clone() for p in planes]

    scatter_triton(src, planes, slots)
    scatter_reference(src, ref, slots)
    torch.cuda.synchronize()

    untouched = torch.ones(planes[0].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    for i in range(layers):
        assert _same_bits(pool.get_key_buffer(i)[slots], src[i])
        assert _same_bits(pool.get_value_buffer(i)[slots], src[layers + i])
    for i, (p, r, b) in enumerate(zip(planes, ref, before, strict=True)):
        assert _same_bits(p, r), f"plane {i}: Triton scatter differs from the torch reference"
        assert _same_bits(p[untouched], b[untouched]), f"plane {i}: a row outside slots changed"


@pytest.mark.parametrize(
    "n_g,gd,hd,t,style,dtype",
    [
        (1, 192, 64, 257, 0, torch.bfloat16),
        (3, 64, 64, 100, 1, torch.float16),
        (2, 128, 128, 33, 0, torch.float32),
    ],
)
def test_inverse_transform_triton_matches_reference(n_g, gd, hd, t, style, dtype):
    import numpy as np
    from sgl_remote_kv.kernels.transform import (
        TransformConsts,
        inverse_reference,
        inverse_triton,
        resolve_escapes,
    )

    rng = np.random.default_rng(t)
    basis = np.linalg.qr(rng.standard_normal((2, n_g, gd, gd)))[0].astype(np.float32)
    consts = TransformConsts.build(
        rng.uniform(0.01, 0.2, (2, n_g, gd)), basis, rng.standard_normal((2, n_g, gd)) * 0.1, hd, style
    )
    sym = torch.from_numpy(rng.integers(0, 256, (2, n_g * gd, t)).astype(np.uint8))
    esc = torch.from_numpy(rng.integers(-2000, 2000, int((sym == 0).sum())).astype(np.int16))
    scales = torch.from_numpy(rng.uniform(0.5, 3.0, (2, t)).astype(np.float32))
    ang = np.arange(1000, 1000 + t)[:, None] / 10000.0 ** (np.arange(hd // 2) * 2.0 / hd)
    cos, sin = (torch.from_numpy(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    ref = torch.empty((2, t, n_g * gd), dtype=dtype)
    inverse_reference(
        resolve_escapes(sym, esc), scales, cos, sin, consts.to(torch.from_numpy), hd, style, True, ref
    )
    big = torch.zeros((2, t + 9, n_g * gd), dtype=dtype, device=DEVICE)
    dev = consts.to(lambda a: torch.from_numpy(a).to(DEVICE))
    q = resolve_escapes(sym.to(DEVICE), esc.to(DEVICE))
    inverse_triton(
        q, scales.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), dev, hd, style, True, big[:, 4 : 4 + t]
    )
    torch.cuda.synchronize()
    got = big[:, 4 : 4 + t].cpu()
    step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}[dtype]
    d = (got.float() - ref.float()).abs()
    assert torch.all(d <= ref.float().abs() * step + 1e-3), float(d.max())
    assert torch.count_nonzero(big[:, :4]) == 0 and torch.count_nonzero(big[:, 4 + t :]) == 0
