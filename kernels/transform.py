"""The transform codec's dequant stage on the GPU path: symbols -> coefficients -> inverse transform ->
mean, RoPE (keys) -> fp16 / bf16 / fp32 KV.

Semantics match ``sgl_remote_kv.codec.transform``'s CPU stage (numba + an integer GEMM), per layer of one chunk and
per head group ``g`` of width ``gd``::

    y[t, j] = (q[c, t] * step[j]) * s[t]            c = g*gd + j, q = symbol - 128 or the escape value
    x[t, j] = sum_i y[t, i] * bt[i, j] + mean[j]     bt = basis^T (x = y @ basis^T)
    keys:  x = x * cos[t, f(c)] + (y @ btr + meanr)[t, j] * sin[t, f(c)]

where ``btr = bt @ R`` and ``meanr = mean @ R`` for the signed permutation ``R`` with ``x @ R =
rotate_half(x)`` (per head; NeoX or GPT-J pairing): RoPE becomes a second GEMM on the same tile, no
shuffles. ``TransformConsts`` holds these per (layer, first group), built once per calibration on the host;
the codec (``device_consts``) passes its decode matrix as ``bt`` with unit steps (``codec.inverse``: the
steps folded into a 16-bit W, the matrix the CPU stage's integer GEMM multiplies by). Results differ
from the CPU stage only by float32 rounding (a rare last-bit difference after the cast); the transform
codec is lossy, so nothing downstream relies on bit equality with it.

``inverse_reference`` is plain torch (the strict CPU device of the test suite runs it);
``inverse_triton`` is one Triton launch (runs on CPU under ``TRITON_INTERPRET=1``); ``inverse_chunks`` runs
a layer's chunks of equal length through either in one set of launches.
Escapes are resolved before either (``resolve_escapes``: the i-th escape symbol takes the i-th value, as
in the CPU stage; clamped indices, so a mismatch can never fault the device), and a trellis-coded chunk's
k become its integer codes r on the device too (``trellis_codes``: the state machine's replay as a prefix
XOR, the host's ``codec.trellis.codes`` without the escape form).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:  # Triton is optional at import time (CPU-only installs)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

NEOX, GPTJ = 0, 1  # RoPE pairing (sgl_remote_kv.codec.transform_ops.rope_style)


@dataclass(frozen=True)
class TransformConsts:
    """Per (layer, first head group) constants, float32: ``steps`` [2, G, gd], ``bt`` [2, G, gd, gd]
    (basis^T), ``btr`` [G, gd, gd] (keys' bt @ R), ``mean`` [2, G, gd], ``meanr`` [G, gd]. Host (numpy)
    arrays from ``build``; ``to(fn)`` maps them (e.g. onto a device)."""

    steps: object
    bt: object
    btr: object
    mean: object
    meanr: object

    @staticmethod
    def build(
        steps: np.ndarray, basis: np.ndarray, mean: np.ndarray, head_dim: int, style: int
    ) -> TransformConsts:
        """``steps`` [2, G, gd], ``basis`` [2, G, gd, gd] (rows = components), ``mean`` [2, G, gd]."""
        gd = basis.shape[-1]
        perm, sign = rotation(gd, head_dim, style)
        bt = np.array(basis.transpose(0, 1, 3, 2), dtype=np.float32, order="C")  # fresh, writable arrays
        btr = np.array(
            bt[0][:, :, perm] * sign, dtype=np.float32, order="C"
        )  # (bt @ R)[:, j] = sign_j * bt[:, perm_j]
        meanr = np.array(mean[0][:, perm] * sign, dtype=np.float32, order="C")
        f32 = lambda a: np.array(a, dtype=np.float32, order="C")  # noqa: E731
        return TransformConsts(f32(steps), bt, btr, f32(mean), meanr)

    def to(self, fn) -> TransformConsts:
        return TransformConsts(*(fn(a) for a in (self.steps, self.bt, self.btr, self.mean, self.meanr)))


def rotation(gd: int, head_dim: int, style: int) -> tuple[np.ndarray, np.ndarray]:
    """``rotate_half(x)[j] = sign[j] * x[perm[j]]`` over ``gd`` channels of whole heads."""
    j = np.arange(gd)
    d, base = j % head_dim, j - j % head_dim
    half = head_dim // 2
    if style == NEOX:
        perm = np.where(d < half, base + d + half, base + d - half)
        sign = np.where(d < half, -1.0, 1.0)
    else:
        perm = np.where(d % 2 == 0, j + 1, j - 1)
        sign = np.where(d % 2 == 0, -1.0, 1.0)
    return perm, sign.astype(np.float32)


def freq_index(gd: int, head_dim: int, style: int) -> np.ndarray:
    """Column -> RoPE frequency index (the column of the ``[T, head_dim/2]`` cos/sin tables)."""
    d = np.arange(gd) % head_dim
    return d % (head_dim // 2) if style == NEOX else d // 2


def resolve_escapes(sym: torch.Tensor, esc: torch.Tensor) -> torch.Tensor:
    """``sym`` [2, C, T] uint8 (or [N, 2, C, T]: N chunks), ``esc`` [n] int16 (K's then V's, each in
    component-major order; chunk after chunk) -> float32 q of ``sym``'s shape: the i-th escape symbol (0) in
    that order takes ``esc[i]``. The host checked ``n`` equals the
    number of escape symbols; on the device nothing may fault even when it does not (a timed-out write's
    late upload can read a reused staging buffer), so indices are clamped instead of checked: a
    mismatch gives wrong values, which only such a failed write can see, never a device error. No host sync."""
    q = sym.to(torch.float32) - 128.0
    if esc.numel():
        m = sym.reshape(-1) == 0
        idx = (torch.cumsum(m, 0) - 1).clamp_(0, esc.numel() - 1)
        q = torch.where(m, esc.to(torch.float32)[idx], q.reshape(-1)).view(q.shape)
    return q


def trellis_codes(k: torch.Tensor) -> torch.Tensor:
    """A trellis-coded chunk's resolved ``k`` [2, C, T] float32 (exact integers, ``resolve_escapes``; any
    leading axes, e.g. chunks, each replayed from its own first token) -> its integer codes r = 2k - q sign(k)
    of the same shape, the values ``codec.trellis.codes`` replays on the
    host. The quantizer q_t of each component (from state 0 at the chunk's first token) is, in
    ``codec.trellis``'s closed form, q_t = parity(k_(t-1)) ^ q_(t-2) with q_0 = q_(-1) = 0: the XOR of the
    parities of tokens t-1, t-3, ..., i.e. a cumulative sum mod 2 over every other token. Plain torch
    (a handful of elementwise launches and one cumsum on a GPU); no host sync."""
    t = k.shape[-1]
    ki = k.to(torch.int32)
    y = torch.zeros((*k.shape[:-1], t + (t & 1)), dtype=torch.int32, device=k.device)
    y[..., 1:t] = ki[..., : t - 1] & 1  # y_t = parity(k_(t-1)), y_0 = 0 (padded to an even length)
    q = (torch.cumsum(y.view(*k.shape[:-1], -1, 2), dim=-2) & 1).view(y.shape)[..., :t]
    return 2.0 * k - q.to(torch.float32) * torch.sign(k)


def inverse_chunks(
    syms: list,
    escs: list,
    scales: list,
    coss: list,
    sins: list,
    consts: TransformConsts,
    head_dim: int,
    style: int,
    out: torch.Tensor,
    trellis: bool,
    inverse,
) -> None:
    """N chunks of one layer, each of the same T tokens, in one set of launches: ``syms`` [2, C, T] uint8,
    ``escs`` their escapes (each chunk's K's then V's), ``scales`` [2, T] float32; ``coss``/``sins``: RoPE
    tables of the N*T tokens in order (one [T, head_dim/2] per chunk, or one [N*T, head_dim/2]) -> ``out``
    [2, N*T, C] (the caller then puts each chunk's exact sink tokens over their rows). The
    escapes resolve over the stacked chunks in order (``resolve_escapes``: chunk-major, as ``escs``
    concatenate), a trellis chunk's codes replay from its own first token (``trellis_codes`` on the chunk
    axis), and ONE inverse transform covers every token (it is token-wise): ``inverse`` is
    ``inverse_triton`` or ``inverse_reference``. No host sync."""
    n = len(syms)
    sym = syms[0][None] if n == 1 else torch.stack(syms)  # [N, 2, C, T]
    q = resolve_escapes(sym, escs[0] if n == 1 else torch.cat(escs))
    if trellis:
        q = trellis_codes(q)
    _, _, c, t = q.shape
    q = q[0] if n == 1 else q.permute(1, 2, 0, 3).reshape(2, c, n * t)  # component-major over all tokens
    s = scales[0] if n == 1 else torch.cat(scales, dim=1)
    cos, sin = (coss[0], sins[0]) if len(coss) == 1 else (torch.cat(coss), torch.cat(sins))
    inverse(q, s, cos, sin, consts, head_dim, style, True, out)


def inverse_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    consts: TransformConsts,
    head_dim: int,
    style: int,
    rope: bool,
    out: torch.Tensor,
) -> None:
    """``q`` [2, C, T] float32, ``scales`` [2, T] float32, ``cos``/``sin`` [T, head_dim/2] float32 ->
    ``out`` [2, T, C] (the KV dtype), in place."""
    _, c, t = q.shape
    n_g, gd = consts.steps.shape[1], consts.steps.shape[2]
    fi = torch.from_numpy(freq_index(gd, head_dim, style)).to(q.device)
    for kv in range(2):
        for g in range(n_g):
            y = (q[kv, g * gd : (g + 1) * gd].T * consts.steps[kv, g]) * scales[kv][:, None]
            x = y @ consts.bt[kv, g] + consts.mean[kv, g]
            if kv == 0 and rope:
                xr = y @ consts.btr[g] + consts.meanr[g]
                x = x * cos[:, fi] + xr * sin[:, fi]
            out[kv, :, g * gd : (g + 1) * gd] = x.to(out.dtype)


if triton is not None:

    @triton.jit
    def _inverse_kernel(
        q_ptr,
        s_ptr,
        cos_ptr,
        sin_ptr,
        steps_ptr,
        bt_ptr,
        btr_ptr,
        mean_ptr,
        meanr_ptr,
        out_ptr,
        T,
        C,
        GD,
        HALF,
        HEAD_DIM,
        N_G,
        OUT_KV_STRIDE,
        ROPE: tl.constexpr,
        GPTJ_STYLE: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid_kg = tl.program_id(0)  # kv * N_G + g
        kv = pid_kg // N_G
        g = pid_kg % N_G
        rows = tl.program_id(1) * BT + tl.arange(0, BT)  # tokens
        cols = tl.program_id(2) * BN + tl.arange(0, BN)  # columns within the group
        rmask, cmask = rows < T, cols < GD
        s = tl.load(s_ptr + kv * T + rows, mask=rmask, other=0.0)
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        acc_r = tl.zeros((BT, BN), dtype=tl.float32)
        do_rope = ROPE and kv == 0
        for k0 in range(0, GD, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < GD
            # q is component-major [2, C, T]: element (t, i) of the group's tile at (kv*C + g*GD + i)*T + t
            qt = tl.load(
                q_ptr + (kv * C + g * GD + ks[None, :]) * T + rows[:, None],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            )
            st = tl.load(steps_ptr + pid_kg * GD + ks, mask=kmask, other=0.0)
            y = (qt * st[None, :]) * s[:, None]
            b = tl.load(
                bt_ptr + (pid_kg * GD + ks[:, None]) * GD + cols[None, :],
                mask=kmask[:, None] & cmask[None, :],
                other=0.0,
            )
            acc += tl.dot(y, b, input_precision="ieee")
            if do_rope:
                br = tl.load(
                    btr_ptr + (g * GD + ks[:, None]) * GD + cols[None, :],
                    mask=kmask[:, None] & cmask[None, :],
                    other=0.0,
                )
                acc_r += tl.dot(y, br, input_precision="ieee")
        x = acc + tl.load(mean_ptr + pid_kg * GD + cols, mask=cmask, other=0.0)[None, :]
        if do_rope:
            xr = acc_r + tl.load(meanr_ptr + g * GD + cols, mask=cmask, other=0.0)[None, :]
            d = (g * GD + cols) % HEAD_DIM
            if GPTJ_STYLE:
                f = d // 2
            else:
                f = d % HALF
            m2 = rmask[:, None] & cmask[None, :]
            cs = tl.load(cos_ptr + rows[:, None] * HALF + f[None, :], mask=m2, other=0.0)
            sn = tl.load(sin_ptr + rows[:, None] * HALF + f[None, :], mask=m2, other=0.0)
            x = x * cs + xr * sn
        if OUT_BF16:
            # round to nearest even by hand (the interpreter's fp32->bf16 cast truncates; see dequant.py)
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        o = out_ptr + kv * OUT_KV_STRIDE + rows[:, None] * C + g * GD + cols[None, :]
        tl.store(o, x.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def inverse_triton(
    q: torch.Tensor,
    scales: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    consts: TransformConsts,
    head_dim: int,
    style: int,
    rope: bool,
    out: torch.Tensor,
    bt_block: int = 32,
    bn: int = 64,
    bk: int = 32,
) -> None:
    """Triton version of ``inverse_reference`` (same arguments; every tensor contiguous, on one device, but
    ``out`` may be a token slice ``[2, t, C]`` of a longer ``[2, T, C]`` buffer)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _, c, t = q.shape
    n_g, gd = consts.steps.shape[1], consts.steps.shape[2]
    if n_g * gd != c or out.shape != (2, t, c) or out.stride()[1:] != (c, 1):
        raise ValueError(f"q {tuple(q.shape)}, {n_g} groups of {gd}, out {tuple(out.shape)} disagree")
    grid = (2 * n_g, triton.cdiv(t, bt_block), triton.cdiv(gd, bn))
    _inverse_kernel[grid](
        q,
        scales,
        cos,
        sin,
        consts.steps,
        consts.bt,
        consts.btr,
        consts.mean,
        consts.meanr,
        out,
        t,
        c,
        gd,
        head_dim // 2,
        head_dim,
        n_g,
        out.stride(0),
        ROPE=rope,
        GPTJ_STYLE=style == GPTJ,
        OUT_BF16=out.dtype == torch.bfloat16,
        BT=bt_block,
        BN=bn,
        BK=bk,
    )
