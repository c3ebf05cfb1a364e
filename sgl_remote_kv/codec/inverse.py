"""The transform codec's decode stage on the CPU: an exact integer GEMM over the symbols, then the mean,
RoPE and the storage dtype in the same pass.

Per (layer, K/V, head group) a token's coefficients come back as ``x = (q * s) @ W`` (before the mean and
RoPE) with ``W[c, j] = step[c] * basis[j, c]``: q the integer code of component c, s the token's scale.
``InverseTables`` holds one layer's W quantized to 16 bits per output channel j,
``W ~= (hi * 256 + lo) * col[j]`` with int8 ``hi`` and ``lo`` (error <= ``col[j] / 2``, 2^-16 of the column's largest entry). ``weff``, that
quantized W in float32, is *the* decode matrix of the codec: the GPU kernel (``kernels.transform``) takes
it as its basis with unit steps and the calibration scores its steps through this module, so every decoder
computes the same real numbers up to float32 rounding. Per call (one layer, K or V, T tokens)::

    codes = symbol ^ 0x80 as int8   (q for ordinary symbols, -128 for the escape symbol 0)
    acc   = codes^T @ [hi | lo]     int8 x int8 -> exact int32 (a float32 BLAS GEMM: see ``_int_gemm``)
    tot   = acc_hi * 256 + acc_lo                                   int64
    escapes: tot[t, :] += (q + 128) * wi[c, :]                     (the true code minus the -128 used)
    x[t, j] = float32(tot[t, j]) * (col[j] * s[t])
    out[t, g, :] = storage dtype of RoPE_t(x[t, :] + mean)   (RoPE for K only, per head_dim block)

So x is a function of the codes alone: an escaped value decodes exactly as if it had been a symbol.
``_decode_group`` does everything after the GEMM in one call per head group (no float32 [T, C]
intermediate).

Threads: tables are immutable. ``decode`` works in per-thread arrays (no allocation once warm) and writes
only the caller's output. The GEMM (torch) and the kernel (numba) release the GIL. It never changes torch's
thread settings: the data-plane process runs torch on
one thread per caller; elsewhere the GEMM uses the process's torch threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from sgl_remote_kv.codec import quant

_BITS_HI = 256  # W ~= (hi * 256 + lo) * col
_WMAX = 127 * _BITS_HI  # |hi * 256 + lo| <= 32512 keeps hi in [-127, 127] and lo in [-128, 127]
_tls = threading.local()
_NO_ROPE = np.zeros((1, 1), np.float32)  # the cos/sin of a V decode (unused)
_EMPTY32 = np.empty((1, 1, 1), np.float32)  # the unused output of ``_decode_group``
_EMPTY16 = np.empty((1, 1, 1), np.uint16)
_F32_EXACT_K = 1024  # columns of int8 codes whose float32 GEMM is exact (1024 * 2^14 = 2^24)


@njit(nogil=True, cache=True)
def _decode_group(
    acc, wi, col, scale, sym, esc, n, tot, mean, cos, sin, style, rope, head_dim, mode, g, out32, out16
):
    """One head group ``g``: ``acc`` [T, 2 * gd] int32 (hi | lo sums), ``wi`` [gd, gd] int32 (the group's decode
    matrix as integers), ``sym`` [gd, T] (its symbols), escapes from ``esc[n]`` on (component-major), ``tot``
    [T, gd] int64 work, ``mean`` [gd] -> ``out32[:, g]`` (mode 0, float32) or ``out16[:, g]`` (1 fp16 / 2
    bf16 bits), both [T, G, gd]. Each escape's true code is added in integers, so a value decodes to the same
    float whether it was coded as a symbol or escaped. Returns the next escape index, or -1 when the escapes
    run out."""
    t_n, gd = tot.shape
    for t in range(t_n):
        for j in range(gd):
            tot[t, j] = np.int64(acc[t, j]) * _BITS_HI + acc[t, gd + j]
    for c in range(gd):
        srow = sym[c]
        zeros = 0
        for t in range(t_n):  # branch-free (vectorized): most rows hold no escape
            zeros += srow[t] == 0
        if zeros == 0:
            continue
        for t in range(t_n):
            if srow[t] == 0:
                if n >= esc.shape[0]:
                    return -1
                d = np.int64(esc[n]) + 128  # the true code minus the -128 the GEMM used
                n += 1
                for j in range(gd):
                    tot[t, j] += d * wi[c, j]
    row = np.empty(gd, np.float32)
    half = head_dim // 2
    for t in range(t_n):
        s = scale[t]
        for j in range(gd):
            x = np.float32(tot[t, j]) * (col[j] * s)  # rounded to float32 before the mean is added
            row[j] = x + mean[j]
        if rope and style == 0:  # the style test outside the loops keeps them vectorizable
            for o in range(0, gd, head_dim):
                for i in range(half):
                    c, sn = cos[t, i], sin[t, i]
                    a, b = row[o + i], row[o + i + half]
                    row[o + i], row[o + i + half] = a * c - b * sn, b * c + a * sn
        elif rope:
            for o in range(0, gd, head_dim):
                for i in range(half):
                    c, sn = cos[t, i], sin[t, i]
                    a, b = row[o + 2 * i], row[o + 2 * i + 1]
                    row[o + 2 * i], row[o + 2 * i + 1] = a * c - b * sn, b * c + a * sn
        if mode == 0:
            for j in range(gd):
                out32[t, g, j] = row[j]
        elif mode == 1:
            quant._f32_to_f16_bits(row, row.view(np.uint32), out16[t, g])
        else:
            quant._f32_to_bf16_bits(row.view(np.uint32), out16[t, g])
    return n


@dataclass(frozen=True)
class InverseTables:
    """One layer's decode matrices at one quality level: ``w2`` [2, G, gd, 2 * gd] int8 (torch; the GEMM's
    right operand ``[hi | lo]``), ``wi`` [2, G, gd, gd] int32 (``hi * 256 + lo``), ``col`` [2, G, gd] float32,
    ``weff`` [2, G, gd, gd] float32 (``wi * col``; rows are components c, columns output channels j)."""

    w2: torch.Tensor
    wi: np.ndarray
    col: np.ndarray
    weff: np.ndarray

    @classmethod
    def build(cls, steps: np.ndarray, basis: np.ndarray) -> InverseTables:
        """``steps`` [2, G, gd]; ``basis`` [2, G, gd, gd] with component c in ``basis[..., :, c]``."""
        w = steps[..., :, None].astype(np.float64) * np.swapaxes(basis, -1, -2).astype(np.float64)
        peak = np.abs(w).max(axis=-2)
        col = np.where(peak > 0, peak / _WMAX, 1.0).astype(np.float32)
        wi = np.clip(np.rint(w / col[..., None, :]), -_WMAX, _WMAX).astype(np.int64)
        hi = np.floor_divide(wi + _BITS_HI // 2, _BITS_HI)
        lo = wi - _BITS_HI * hi
        w2 = torch.from_numpy(np.ascontiguousarray(np.concatenate([hi, lo], axis=-1).astype(np.int8)))
        weff = (wi.astype(np.float32) * col[..., None, :]).astype(np.float32)
        wi = np.ascontiguousarray(wi, np.int32)
        for a in (wi, col, weff):
            a.setflags(write=False)
        return cls(w2, wi, col, weff)

    def decode(
        self,
        kv: int,
        group: int,
        sym: np.ndarray,
        esc: np.ndarray,
        scale: np.ndarray,
        mean: np.ndarray,
        rope: tuple[np.ndarray, np.ndarray, int] | None,
        head_dim: int,
        mode: int,
        out: np.ndarray,
    ) -> int:
        """``sym`` [n_g * gd, T] uint8 (component-major), ``esc`` int16 escape values, ``scale`` [T] float32,
        ``mean`` [n_g, gd] float32, ``rope`` (cos, sin, style) of the T positions or ``None`` (V) -> ``out``
        [T, n_g, gd]: float32 (``mode`` 0) or uint16 holding fp16 (1) / bf16 (2) bits. Returns the escapes
        consumed, or -1 when they ran out (``out`` is then partly written)."""
        gd = self.col.shape[-1]
        c_n, t_n = sym.shape
        n_g = c_n // gd
        codes, codes_t, acc, acc_np, tot, floats = _work(t_n, gd)
        cos, sin, style = rope if rope is not None else (_NO_ROPE, _NO_ROPE, 0)
        out32, out16 = (out, _EMPTY16) if mode == 0 else (_EMPTY32, out)
        used = 0
        for g in range(n_g):
            gsym = sym[g * gd : (g + 1) * gd]
            np.bitwise_xor(gsym, 0x80, out=codes)
            _int_gemm(codes_t, self.w2[kv, group + g], acc, *floats)
            used = _decode_group(
                acc_np,
                self.wi[kv, group + g],
                self.col[kv, group + g],
                scale,
                gsym,
                esc,
                used,
                tot,
                mean[g],
                cos,
                sin,
                style,
                rope is not None,
                head_dim,
                mode,
                g,
                out32,
                out16,
            )
            if used < 0:
                break
        return used


def _int_gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, af: torch.Tensor, bf: torch.Tensor, of: torch.Tensor
) -> None:
    """``out = a @ b`` (int8 x int8 -> int32, exact) through a float GEMM in the work buffers ``af``, ``bf``,
    ``of`` (float32 while ``a`` has at most ``_F32_EXACT_K`` columns, else float64). Exact: every product is
    an integer of magnitude <= 2^14, so every partial sum of <= 1024 of them is an integer below 2^24, which
    float32 holds exactly in any summation order (float64 holds any ``gd`` here). Not torch's CPU
    ``_int_mm``: far slower than BLAS on CPUs without its fast path (docs/CODEC.md), wrong for one row."""
    np.copyto(af.numpy(), a.numpy(), casting="unsafe")
    np.copyto(bf.numpy(), b.numpy(), casting="unsafe")
    torch.matmul(af, bf, out=of)
    np.copyto(out.numpy(), of.numpy(), casting="unsafe")


def _work(t_n: int, gd: int):
    """This thread's work arrays for (T, gd): codes [gd, T] uint8 and its int8 transpose as a tensor, acc
    [T, 2 * gd] int32 (tensor and array), tot [T, gd] int64, and the GEMM's float buffers (``_int_gemm``)."""
    cache = getattr(_tls, "work", None)
    if cache is None:
        cache = _tls.work = {}
    key = (t_n, gd)
    w = cache.get(key)
    if w is None:
        if len(cache) >= 8:
            cache.clear()
        codes = np.empty((gd, t_n), np.uint8)
        acc = torch.empty((t_n, 2 * gd), dtype=torch.int32)
        tot = np.empty((t_n, gd), np.int64)
        ft = torch.float32 if gd <= _F32_EXACT_K else torch.float64
        floats = (torch.empty((t_n, gd), dtype=ft), torch.empty((gd, 2 * gd), dtype=ft))
        floats += (torch.empty((t_n, 2 * gd), dtype=ft),)
        w = cache[key] = (codes, torch.from_numpy(codes).view(torch.int8).t(), acc, acc.numpy(), tot, floats)
    return w
