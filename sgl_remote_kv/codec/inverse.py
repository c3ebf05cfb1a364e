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
    acc   = codes^T @ [hi | lo]     int8 x int8 -> exact int32 (``_int_gemm``: torch's int8 GEMM or a float one)
    tot   = acc_hi * 256 + acc_lo                 int64 (int32 where no partial sum can overflow it)
    escapes: tot[t, :] += (q + 128) * wi[c, :]                     (the true code minus the -128 used)
    x[t, j] = float32(tot[t, j]) * (col[j] * s[t])
    out[t, g, :] = storage dtype of RoPE_t(x[t, :] + mean)   (RoPE for K only, per head_dim block)

So x is a function of the codes alone: an escaped value decodes exactly as if it had been a symbol.
``_decode_group`` does everything after the GEMM in one call per head group (no float32 [T, C]
intermediate).

Threads: tables are immutable (their per-group views and the float copy of ``w2`` the float GEMM reads are
made once, on first use). ``decode`` works in per-thread arrays (no allocation once warm) and writes only
the caller's output. The GEMM (torch) and the kernel (numba) release the GIL. It never changes torch's
thread settings: the data-plane process runs torch on one thread per caller (where the int8 GEMM runs if
this CPU's is exact and faster, probed and timed once per process); elsewhere the float GEMM uses the
process's torch threads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from numba import njit

from sgl_remote_kv.codec import quant

_BITS_HI = 256  # W ~= (hi * 256 + lo) * col
_WMAX = 127 * _BITS_HI  # |hi * 256 + lo| <= 32512 keeps hi in [-127, 127] and lo in [-128, 127]
_tls = threading.local()
logger = logging.getLogger(__name__)
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
    [T, gd] work (int64, or int32 where the caller has bounded every partial sum: ``InverseTables.decode``),
    ``mean`` [gd] -> ``out32[:, g]`` (mode 0, float32) or ``out16[:, g]`` (1 fp16 / 2 bf16 bits), both
    [T, G, gd]. Each escape's true code is added in integers, so a value decodes to the same float whether it
    was coded as a symbol or escaped. Returns the next escape index, or -1 when the escapes run out.
    (Rows and head blocks are sliced before the inner loops: plain ``range`` indices, so they vectorize.)"""
    t_n, gd = tot.shape
    for t in range(t_n):
        hi, lo, trow = acc[t, :gd], acc[t, gd:], tot[t]
        for j in range(gd):
            trow[j] = np.int64(hi[j]) * _BITS_HI + lo[j]
    for c in range(gd):
        srow = sym[c]
        zeros = 0
        for t in range(t_n):  # branch-free (vectorized): most rows hold no escape
            zeros += srow[t] == 0
        if zeros == 0:
            continue
        wrow = wi[c]
        for t in range(t_n):
            if srow[t] == 0:
                if n >= esc.shape[0]:
                    return -1
                d = np.int64(esc[n]) + 128  # the true code minus the -128 the GEMM used
                n += 1
                trow = tot[t]
                for j in range(gd):
                    trow[j] += d * wrow[j]
    row = np.empty(gd, np.float32)
    rot = np.empty(gd, np.float32)  # RoPE reads ``row`` and writes here (two arrays: the loops vectorize)
    half = head_dim // 2
    res = rot if rope else row
    res_bits = res.view(np.uint32)
    for t in range(t_n):
        s = scale[t]
        trow = tot[t]
        for j in range(gd):
            x = np.float32(trow[j]) * (col[j] * s)  # rounded to float32 before the mean is added
            row[j] = x + mean[j]
        if rope:
            ct, st = cos[t], sin[t]
            for o in range(0, gd, head_dim):
                if style == 0:  # NeoX: pairs (i, i + half)
                    ra, rb = row[o : o + half], row[o + half : o + head_dim]
                    wa, wb = rot[o : o + half], rot[o + half : o + head_dim]
                    for i in range(half):
                        a, b, c, sn = ra[i], rb[i], ct[i], st[i]
                        wa[i] = a * c - b * sn
                        wb[i] = b * c + a * sn
                else:  # GPT-J: pairs (2i, 2i + 1)
                    rr, ww = row[o : o + head_dim], rot[o : o + head_dim]
                    for i in range(half):
                        a, b, c, sn = rr[2 * i], rr[2 * i + 1], ct[i], st[i]
                        ww[2 * i] = a * c - b * sn
                        ww[2 * i + 1] = b * c + a * sn
        if mode == 0:
            o32 = out32[t, g]
            for j in range(gd):
                o32[j] = res[j]
        elif mode == 1:
            quant._f32_to_f16_bits(res, res_bits, out16[t, g])
        else:
            quant._f32_to_bf16_bits(res_bits, out16[t, g])
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

    # Made once on first use, not per call (two threads may both make one; either is the same):
    @cached_property
    def _blocks(self) -> tuple:
        """Per K/V and head group: (``w2``, ``wi``, ``col``) views (indexing a tensor costs ~2 us a call)."""
        return tuple(
            tuple((self.w2[kv, g], self.wi[kv, g], self.col[kv, g]) for g in range(self.col.shape[1]))
            for kv in range(2)
        )

    @cached_property
    def _float_blocks(self) -> tuple:
        """Per K/V and head group: ``w2`` as the float GEMM's right operand (``_int_gemm``): float32, float64
        beyond ``_F32_EXACT_K`` columns."""
        w2f = self.w2.to(_float_type(self.w2.shape[-2]))
        return tuple(tuple(w2f[kv, g] for g in range(w2f.shape[1])) for kv in range(2))

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
        codes, codes_t, acc, acc_np, tot32, tot64, floats = _work(t_n, gd)
        tot = tot32 if _int32_sums(esc, gd) else tot64
        int_mm = _use_int_mm(t_n)
        cos, sin, style = rope if rope is not None else (_NO_ROPE, _NO_ROPE, 0)
        out32, out16 = (out, _EMPTY16) if mode == 0 else (_EMPTY32, out)
        used = 0
        for g in range(n_g):
            w2, wi, col = self._blocks[kv][group + g]
            gsym = sym[g * gd : (g + 1) * gd]
            np.bitwise_xor(gsym, 0x80, out=codes)
            bf = None if int_mm else self._float_blocks[kv][group + g]
            _int_gemm(codes_t, w2, acc, *floats, bf, int_mm)
            used = _decode_group(
                acc_np,
                wi,
                col,
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
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    af: torch.Tensor,
    of: torch.Tensor,
    bf: torch.Tensor | None = None,
    int_mm: bool | None = None,
) -> None:
    """``out = a @ b`` (int8 x int8 -> int32, exact), by either of two exact GEMMs (the same integers, so the
    choice never changes a decoded bit); ``int_mm`` None: ``_use_int_mm``.

    - torch's CPU ``_int_mm`` (int8 VNNI: ~0.1 ms for 256 x 192 x 384 on one core here, 4x the float32 GEMM)
      where ``_use_int_mm`` allows it: ``a`` of at least 2 rows (it sums a single row wrongly, torch 2.14),
      torch on one thread in this caller (the data plane, the benchmarks: with more, its OpenMP team stalled
      for milliseconds a call whenever another process held a core of this 2-core box, the "~1 G MAC/s" of
      docs/CODEC.md), its sums checked exact on this CPU (``_int_mm_exact``) and a decode-shaped product
      timed faster than the float GEMM's (``_int_mm_fast``).
    - else a float GEMM in the work buffers ``af``, ``of`` (float32 while ``a`` has at most ``_F32_EXACT_K``
      columns, else float64) with ``bf`` = ``b`` in their type (the layer's cached copy,
      ``InverseTables._float_blocks``; converted here when not given). Exact: every product is an integer of
      magnitude <= 2^14, so every partial sum of <= 1024 of them is an integer below 2^24, which float32
      holds exactly in any summation order (float64 holds any ``gd`` here)."""
    if int_mm is None:
        int_mm = _use_int_mm(a.shape[0])
    if int_mm:
        torch._int_mm(a, b, out=out)
        return
    if bf is None:
        bf = b.to(af.dtype)
    np.copyto(af.numpy(), a.numpy(), casting="unsafe")
    torch.matmul(af, bf, out=of)
    np.copyto(out.numpy(), of.numpy(), casting="unsafe")


def _use_int_mm(t_n: int) -> bool:
    """Whether ``_int_gemm`` takes torch's ``_int_mm`` for ``t_n`` rows on this thread (see there)."""
    return t_n > 1 and torch.get_num_threads() == 1 and _int_mm_exact() and _int_mm_fast()


_INT_MM_EXACT: list[bool] = []  # the probe's answer, once per process
_INT_MM_FAST: list[bool] = []  # the timing's answer, once per process


def _int_mm_exact() -> bool:
    """Whether torch's CPU ``_int_mm`` returns exact sums on this CPU, probed once per process on full-range
    and extreme int8 operands laid out as ``decode`` passes them. oneDNN's int8 kernels for CPUs without
    VNNI (and for any CPU under ``ONEDNN_MAX_CPU_ISA=AVX2``, which the pinned-numerics calibration sets)
    saturate 16-bit pair sums: measured wrong on random operands at every width. (Two threads may both
    probe; the answer is the same.)"""
    if not _INT_MM_EXACT:
        _INT_MM_EXACT.append(_probe_int_mm())
    return _INT_MM_EXACT[0]


def _probe_int_mm() -> bool:
    rng = np.random.default_rng(0)
    for t_n, k in ((2, 16), (17, 64), (64, 192)):
        cases = [rng.integers(-128, 128, (k, t_n + 2 * k)).astype(np.int8) for _ in range(2)]
        cases += [np.full((k, t_n + 2 * k), v, np.int8) for v in (-128, 127)]
        cases.append(
            np.concatenate([np.full((k, t_n), 127), np.full((k, 2 * k), -128)], axis=1).astype(np.int8)
        )
        for m in cases:
            codes, w = np.ascontiguousarray(m[:, :t_n]), np.ascontiguousarray(m[:, t_n:])
            out = torch.empty((t_n, 2 * k), dtype=torch.int32)
            try:
                torch._int_mm(torch.from_numpy(codes).t(), torch.from_numpy(w), out=out)
            except RuntimeError:
                return False
            if not np.array_equal(out.numpy(), codes.T.astype(np.int64) @ w.astype(np.int64)):
                return False
    return True


def _int_mm_fast() -> bool:
    """Whether torch's CPU ``_int_mm`` beats the float GEMM on this CPU, timed once per process (on the
    calling thread, which runs torch on one thread: ``_use_int_mm``). Where oneDNN has no int8 kernel for the
    CPU's ISA, torch falls back to a path that is exact but slow: measured 17-23 ms for one 256 x 192 x 384
    product on an AVX2-only EPYC, 35-45x the float32 GEMM; with VNNI it is ~4x faster than the float GEMM."""
    if not _INT_MM_FAST:
        t_int, t_float = _time_gemms()
        fast = t_int <= t_float
        logger.info(
            "transform decode GEMM: %s (int8 _int_mm %.3f ms, float %.3f ms per 256-token product)",
            "int8 _int_mm" if fast else "float", t_int * 1e3, t_float * 1e3,
        )  # fmt: skip
        _INT_MM_FAST.append(fast)
    return _INT_MM_FAST[0]


def _time_gemms(t_n: int = 256, gd: int = 192, reps: int = 3) -> tuple[float, float]:
    """This thread's CPU seconds for one decode-shaped product (a chunk of ``t_n`` tokens, a head group of
    ``gd`` components) by ``_int_mm`` and by the float GEMM: the best of ``reps`` after a warm-up call, in
    this thread's decode work arrays (``_work``; a decode fills them before each use)."""
    rng = np.random.default_rng(1)
    codes, a, out, _, _, _, (af, of) = _work(t_n, gd)
    codes[...] = rng.integers(0, 256, codes.shape, dtype=np.uint8)
    b = torch.from_numpy(rng.integers(-128, 128, (gd, 2 * gd)).astype(np.int8))
    bf = b.to(af.dtype)

    def best(int_mm: bool) -> float:
        _int_gemm(a, b, out, af, of, bf, int_mm)
        times = []
        for _ in range(reps):
            t0 = time.thread_time()
            _int_gemm(a, b, out, af, of, bf, int_mm)
            times.append(time.thread_time() - t0)
        return min(times)

    return best(True), best(False)


@njit(nogil=True, cache=True)
def _int32_sums(esc, gd):
    """Whether every partial sum of a decode of ``gd`` components with these escapes fits int32: each is a
    sum of gd codes (escapes, or the -128 the GEMM used for them, or |q| <= 127) times |wi| <= _WMAX."""
    big = 128
    for i in range(esc.shape[0]):
        big = max(big, abs(np.int64(esc[i])))
    return gd * big * _WMAX < 2**31


def _float_type(k: int) -> torch.dtype:
    """The float GEMM's type for ``k`` columns of int8 codes (exact: ``_int_gemm``)."""
    return torch.float32 if k <= _F32_EXACT_K else torch.float64


def _work(t_n: int, gd: int):
    """This thread's work arrays for (T, gd): codes [gd, T] uint8 and its int8 transpose as a tensor, acc
    [T, 2 * gd] int32 (tensor and array), tot [T, gd] int32 and int64, and the float GEMM's buffers ``af``,
    ``of`` (``_int_gemm``)."""
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
        tot32, tot64 = np.empty((t_n, gd), np.int32), np.empty((t_n, gd), np.int64)
        ft = _float_type(gd)
        floats = (torch.empty((t_n, gd), dtype=ft), torch.empty((t_n, 2 * gd), dtype=ft))
        codes_t = torch.from_numpy(codes).view(torch.int8).t()
        w = cache[key] = (codes, codes_t, acc, acc.numpy(), tot32, tot64, floats)
    return w
