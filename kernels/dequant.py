"""Dequantization on the GPU path: codes + max-abs scales -> fp16 / bf16 / fp32 KV.

Semantics match ``sgl_remote_kv.codec.quant`` (and its numba CPU kernel, which the data plane uses on
CPU): ``x[t, c] = (codes[t, c] - m) * scales[t, c // (C // G)] / m * channel_scales[c]``.

``dequant_reference`` is plain torch; ``dequant_triton`` is one Triton launch (runs on CPU under
``TRITON_INTERPRET=1`` for tests). ``dequant`` picks Triton for CUDA tensors, else the reference.
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time (CPU-only installs)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None


def dequant_reference(
    codes: torch.Tensor,
    scales: torch.Tensor,
    m: int,
    channel_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """codes [T, C] uint8, scales [T, G] (fp16/fp32 max-abs), channel_scales [C] or None -> [T, C]."""
    t, c = codes.shape
    g = scales.shape[1]
    inv_m = torch.tensor(1.0 / m, dtype=torch.float32)  # same op order as the kernels: s * (1/m)
    s = (scales.float() * inv_m).repeat_interleave(c // g, dim=1)
    x = (codes.to(torch.int32) - m).float() * s
    if channel_scales is not None:
        x = x * channel_scales.float()[None, :]
    return x.to(out_dtype)


if triton is not None:

    @triton.jit
    def _dequant_kernel(
        codes_ptr,
        scales_ptr,
        cs_ptr,
        out_ptr,
        C,
        G,
        m,
        inv_m,
        HAS_CS: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        cb = tl.program_id(1)
        offs = cb * BLOCK + tl.arange(0, BLOCK)
        mask = offs < C
        q = tl.load(codes_ptr + t * C + offs, mask=mask, other=0).to(tl.int32)
        grp = offs // (C // G)
        s = tl.load(scales_ptr + t * G + grp, mask=mask, other=0.0).to(tl.float32) * inv_m
        x = (q - m).to(tl.float32) * s
        if HAS_CS:
            x = x * tl.load(cs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if OUT_BF16:
            # round to nearest even by hand so the (exact) cast agrees on GPU and in the interpreter,
            # whose fp32->bf16 cast truncates
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
        tl.store(out_ptr + t * C + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    m: int,
    channel_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
    block: int = 256,
) -> torch.Tensor:
    """Triton version of ``dequant_reference``; writes into ``out`` ([T, C], ``out_dtype``) if given."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, c = codes.shape
    g = scales.shape[1]
    if c % g:
        raise ValueError(f"channels {c} not divisible by scale groups {g}")
    codes, scales = codes.contiguous(), scales.contiguous()
    if out is None:
        out = torch.empty((t, c), dtype=out_dtype, device=codes.device)
    cs = channel_scales.contiguous() if channel_scales is not None else scales
    grid = (t, triton.cdiv(c, block))
    _dequant_kernel[grid](
        codes,
        scales,
        cs,
        out,
        c,
        g,
        m,
        1.0 / m,
        HAS_CS=channel_scales is not None,
        OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK=block,
    )
    return out
