"""The transform codec's inverse transform on the CPU: an exact integer GEMM over the symbols.

Per (layer, K/V, head group) a token's coefficients come back as ``x = (q * s) @ W`` (before the mean and
RoPE) with ``W[c, j] = step[c] * basis[j, c]``: q the integer code of component c, s the token's scale.
``InverseTables`` holds one layer's W quantized to 16 bits per output channel j,
``W ~= (hi * 256 + lo) * col[j]`` with int8 ``hi`` and ``lo`` (error <= ``col[j] / 2``, 2^-16 of the column's largest entry). ``weff``, that
quantized W in float32, is *the* decode matrix of the codec: the GPU kernel (``kernels.transform``) takes
it as its basis with unit steps and the calibration scores its steps through this module, so every decoder
computes the same real numbers up to float32 rounding. Per call (one layer, K or V, T tokens)::

    codes = symbol ^ 0x80 as int8   (q for ordinary symbols, -128 for the escape symbol 0)
    acc   = codes^T @ [hi | lo]     torch._int_mm, int8 x int8 -> exact int32 (VNNI on x86)
    tot   = acc_hi * 256 + acc_lo                                   int64
    escapes: tot[t, :] += (q + 128) * wi[c, :]                     (the true code minus the -128 used)
    x[t, j] = float32(tot[t, j]) * (col[j] * s[t])

So x is a function of the codes alone: an escaped value decodes exactly as if it had been a symbol.

Threads: tables are immutable. ``inverse`` works in per-thread arrays (no allocation once warm); what it
returns is that thread's work array, valid until the thread's next call. The GEMM (torch) and the kernels
(numba) release the GIL. It never changes torch's thread settings: the data-plane process runs torch on
one thread per caller; elsewhere the GEMM uses the process's torch threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

_BITS_HI = 256  # W ~= (hi * 256 + lo) * col
_WMAX = 127 * _BITS_HI  # |hi * 256 + lo| <= 32512 keeps hi in [-127, 127] and lo in [-128, 127]
_tls = threading.local()


@njit(nogil=True, cache=True)
def _combine(acc, wi, col, scale, sym, esc, n, tot, x):
    """One head group: ``acc`` [T, 2 * gd] int32 (hi | lo sums), ``wi`` [gd, gd] int32 (the group's decode
    matrix as integers), ``sym`` [gd, T] (its symbols), escapes from ``esc[n]`` on (component-major), ``tot``
    [T, gd] int64 work -> ``x`` [T, gd] float32. Each escape's true code is added in integers, so a value
    decodes to the same float whether it was coded as a symbol or escaped. Returns the next escape index,
    or -1 when the escapes run out."""
    t_n, gd = x.shape
    for t in range(t_n):
        for j in range(gd):
            tot[t, j] = np.int64(acc[t, j]) * _BITS_HI + acc[t, gd + j]
    for c in range(gd):
        row = sym[c]
        zeros = 0
        for t in range(t_n):  # branch-free (vectorized): most rows hold no escape
            zeros += row[t] == 0
        if zeros == 0:
            continue
        for t in range(t_n):
            if row[t] == 0:
                if n >= esc.shape[0]:
                    return -1
                d = np.int64(esc[n]) + 128  # the true code minus the -128 the GEMM used
                n += 1
                for j in range(gd):
                    tot[t, j] += d * wi[c, j]
    for t in range(t_n):
        s = scale[t]
        for j in range(gd):
            x[t, j] = np.float32(tot[t, j]) * (col[j] * s)
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

    def inverse(self, kv: int, group: int, sym: np.ndarray, esc: np.ndarray,
                scale: np.ndarray) -> tuple[np.ndarray, int]:  # fmt: skip
        """``sym`` [n_g * gd, T] uint8 (component-major), ``esc`` int16 escape values, ``scale`` [T] float32
        -> (x [n_g, T, gd] float32, escapes consumed or -1). x is this thread's work array."""
        gd = self.col.shape[-1]
        c_n, t_n = sym.shape
        n_g = c_n // gd
        codes, codes_t, acc, acc_np, tot, x = _work(t_n, gd, n_g)
        used = 0
        for g in range(n_g):
            gsym = sym[g * gd : (g + 1) * gd]
            np.bitwise_xor(gsym, 0x80, out=codes)
            _int_gemm(codes_t, self.w2[kv, group + g], acc)
            used = _combine(acc_np, self.wi[kv, group + g], self.col[kv, group + g], scale, gsym, esc, used, tot, x[g])
            if used < 0:
                break
        return x, used


def _int_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` (int8 x int8 -> int32, exact). torch's CPU ``_int_mm`` returns wrong sums for a
    single row (torch 2.14, every width); one token goes through numpy's integer matmul instead."""
    if a.shape[0] == 1:
        np.matmul(a.numpy().astype(np.int32), b.numpy().astype(np.int32), out=out.numpy())
    else:
        torch._int_mm(a, b, out=out)


def _work(t_n: int, gd: int, n_g: int):
    """This thread's work arrays for (T, gd, groups): codes [gd, T] uint8 and its int8 transpose as a
    tensor, acc [T, 2 * gd] int32 (tensor and array), tot [T, gd] int64, x [n_g, T, gd] float32."""
    cache = getattr(_tls, "work", None)
    if cache is None:
        cache = _tls.work = {}
    key = (t_n, gd, n_g)
    w = cache.get(key)
    if w is None:
        if len(cache) >= 8:
            cache.clear()
        codes = np.empty((gd, t_n), np.uint8)
        acc = torch.empty((t_n, 2 * gd), dtype=torch.int32)
        x = np.empty((n_g, t_n, gd), np.float32)
        tot = np.empty((t_n, gd), np.int64)
        w = cache[key] = (codes, torch.from_numpy(codes).view(torch.int8).t(), acc, acc.numpy(), tot, x)
    return w
