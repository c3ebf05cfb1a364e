"""The transform codec's quantized stage on the device, for the write-back: one layer of whole chunks of KV ->
symbols, escapes and token scales; the host is left with the lossless stage (``codec.transform_coded``).

The device half of ``TransformCodec.encode_layer`` (``codec.transform_ops``, ``codec.trellis``), in plain torch
ops that run on whatever device the pool is on (CUDA in production, the strict CPU double in CI), per chunk
and K/V as the host encoder does it:

- keys: RoPE undone at the chunk's positions; ``y = (x - mean) @ basis`` per head group;
- token scales: the RMS of ``y`` over the token's components (0 for an exact sink position), stored on the
  log grid (``SCALE_LOG8``) when both K's and V's fit it, else fp16, else fp32, and read back as the
  decoder reads them;
- ``scalar``: ``q = rint(y * (1 / step) / scale)``; ``trellis``: the same Viterbi search over the 4 states as
  ``codec.trellis.quantize`` (its rate model from the chunk's own values), run over every component of the
  layer's chunks at once, one token at a time;
- symbols ``q + 128`` (``|q| <= 127``), else ``ESC`` with ``q`` in the chunk's escape list (component-major,
  compacted on the device without a host sync, at most ``cap`` per chunk and K/V).

The float32 GEMM and reductions run in the device's order, not numpy's, so symbols can differ from a host
encode of the same KV by a last-bit rounding at a quantizer's decision boundary: the blobs decode with the
same decoder to KV within the codec's tolerance, not bit-identically (docs/CODEC.md). A chunk whose values
cannot be coded (not finite, beyond the escape format, more than ``cap`` escapes) is flagged ``bad``; the
host does not store it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton is optional at import time (CPU-only installs)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

ESC, ZERO = 0, 128  # codec.transform_ops
SCALE_FP16, SCALE_FP32, SCALE_LOG8 = 0, 1, 2  # codec.transform_ops
LOG8_STEPS = 32
FP16_MAX = 65504.0
DELTA, LAMBDA, MAX_K = 0.6, 0.1, 16383  # codec.trellis
NEOX = 0
NEXT = ((0, 2), (2, 0), (1, 3), (3, 1))  # codec.trellis: next state by (state, parity of k)
# per next state, its two ways in: (previous state, parity of k)
_PRED = tuple(tuple((st, p) for st in range(4) for p in range(2) if NEXT[st][p] == ns) for ns in range(4))


@dataclass(frozen=True)
class EncodeConsts:
    """Per (layer, first head group), float32 on the device (host arrays from ``TransformCodec.encode_consts``;
    ``to(fn)`` maps them): ``mean`` [2, G, gd], ``basis`` [2, G, gd, gd]
    (rows = components), ``inv_steps`` [2, G, gd] (``1 / step`` in float32, as the scalar quantizer uses it),
    ``steps`` [2, G, gd], ``log8`` [256]."""

    mean: torch.Tensor
    basis: torch.Tensor
    inv_steps: torch.Tensor
    steps: torch.Tensor
    log8: torch.Tensor  # [256] float32: the log grid's scale per code (``transform_ops._LOG8``)

    def to(self, fn) -> EncodeConsts:
        return EncodeConsts(*(fn(a) for a in (self.mean, self.basis, self.inv_steps, self.steps, self.log8)))


@dataclass(frozen=True)
class CodedLayer:
    """One layer of ``n`` chunks of ``T`` tokens (``C = H * D``) on the device (or pinned host, once copied)."""

    sym: torch.Tensor  # [2, n, C, T] uint8, K then V, component-major per chunk
    esc: torch.Tensor  # [2, n, cap] int16: the escaped values, in symbol order
    nesc: torch.Tensor  # [2, n] int32: escapes per chunk and K/V
    rms: (
        torch.Tensor
    )  # [2, n, T] float32 token RMS (0 at sink positions): fp16 / fp32 scales are stored from it
    e: torch.Tensor  # [2, n, T] uint8 log-grid codes
    base: torch.Tensor  # [2, n] float32 log-grid bases
    fmt: torch.Tensor  # [n] uint8 SCALE_*
    bad: torch.Tensor  # [n] bool: the chunk cannot be coded


def _undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: int) -> torch.Tensor:
    """``transform_ops.rotate`` with sign -1 on ``x`` [T, H, D] float32 (``cos``/``sin`` [T, D/2])."""
    c, s = cos[:, None, :], sin[:, None, :] * -1.0
    if style == NEOX:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)


def _scales(rms: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``rms`` [2, n, T] -> (stored-and-read-back scales [2, n, T], e, base, fmt): ``transform_ops.code_scales``."""
    nz = rms > 0
    fin = (torch.isfinite(rms) & (rms >= 0)).all(-1)  # [2, n]
    base = torch.where(nz, rms, torch.full_like(rms, float("inf"))).amin(-1)
    base = torch.where(nz.any(-1), base, torch.ones_like(base))
    ratio = torch.where(
        nz & fin[..., None], rms.double() / base.double()[..., None], torch.ones_like(rms).double()
    )
    e = torch.where(nz, torch.round(torch.log2(ratio) * LOG8_STEPS) + 1, torch.zeros_like(ratio))
    log8 = (fin & (e.amax(-1) <= 255)).all(0)  # [n]: both K's and V's fit
    e8 = e.clamp(0, 255).to(torch.uint8)
    back_log8 = base[..., None] * grid[e8.long()]
    fp16 = (rms <= FP16_MAX).all(-1).all(0)  # NaN compares False: fp32
    back = torch.where(fp16[None, :, None], rms.half().float(), rms)
    back = torch.where(log8[None, :, None], back_log8, back)
    fmt = torch.where(log8, SCALE_LOG8, torch.where(fp16, SCALE_FP16, SCALE_FP32)).to(torch.uint8)
    return back, e8, base, fmt


def trellis_rates(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The trellis search's rate model per stream (``codec.trellis.quantize``): ``u`` [N, T] float64 -> bits of
    each symbol [N, 256] and of an escape [N], from the histogram of ``rint(u / 2 DELTA)`` over the stream."""
    k0 = torch.round(u * (1.0 / (2.0 * DELTA)))
    inr = (k0 >= -127) & (k0 <= 127)
    cnt = torch.full((u.shape[0], 256), 0.5, dtype=torch.float64, device=u.device)
    cnt.scatter_add_(1, torch.where(inr, k0 + ZERO, 0.0).long(), inr.double())
    tot = cnt.sum(1, keepdim=True)
    bits = torch.where(cnt == 0.5, -torch.log2(0.5 / tot), -torch.log2(cnt / tot)).contiguous()
    return bits, (16.0 + bits[:, ESC]).contiguous()


def trellis_search_reference(
    u: torch.Tensor, live: torch.Tensor, bits: torch.Tensor, esc_bits: torch.Tensor
) -> torch.Tensor:
    """``codec.trellis.quantize``'s Viterbi search over every stream at once, one token at a time (torch ops:
    the strict double runs it; ``trellis_search_triton`` is the GPU's). ``u`` [N, T] float64 (values in units of
    step x scale), ``live`` [N, T] (scale > 0). Returns k [N, T] int64."""
    n_s, t_n = u.shape
    dev = u.device
    inv2d, invd = 1.0 / (2.0 * DELTA), 1.0 / DELTA
    inf = torch.tensor(1e300, dtype=torch.float64, device=dev)
    cost = torch.full((n_s, 4), 1e300, dtype=torch.float64, device=dev)
    cost[:, 0] = 0.0
    back_s = torch.empty((t_n, n_s, 4), dtype=torch.int8, device=dev)
    back_k = torch.empty((t_n, n_s, 4), dtype=torch.int64, device=dev)
    zero = torch.zeros(n_s, dtype=torch.int64, device=dev)
    for t in range(t_n):
        x, ok = u[:, t], live[:, t]
        zc = x * x + LAMBDA * bits[:, ZERO]
        bc, bk = {}, {}  # (quantizer, parity) -> cheapest cost / its k
        for q in range(2):
            c0, k0_, c1, k1_ = zc, zero, inf.expand(n_s), zero
            if q == 0:
                b = torch.floor(x * inv2d)
            else:
                b = torch.floor((x.abs() * invd + 1.0) * 0.5)
                b = torch.where(x < 0, -b - 1, b)
            b = b.long()
            for kk in (b, b + 1):
                valid = ok & (kk != 0)
                r = 2 * kk - torch.where(kk > 0, q, -q)
                err = x - r * DELTA
                inr_k = (kk >= -127) & (kk <= 127)
                kb = torch.where(inr_k, bits.gather(1, (kk.clamp(-127, 127) + ZERO)[:, None])[:, 0], esc_bits)
                cc = err * err + LAMBDA * kb
                odd = (kk & 1) == 1
                up1 = valid & odd
                up0 = valid & ~odd & (cc < c0)
                c1, k1_ = torch.where(up1, cc, c1), torch.where(up1, kk, k1_)
                c0, k0_ = torch.where(up0, cc, c0), torch.where(up0, kk, k0_)
            bc[q, 0], bk[q, 0], bc[q, 1], bk[q, 1] = c0, k0_, c1, k1_
        nxt = []
        for ns, ((s0, p0), (s1, p1)) in enumerate(_PRED):
            a = cost[:, s0] + bc[s0 >> 1, p0]
            c = cost[:, s1] + bc[s1 >> 1, p1]
            take1 = c < a
            nxt.append(torch.where(take1, c, a))
            back_s[t, :, ns] = torch.where(take1, s1, s0).to(torch.int8)
            back_k[t, :, ns] = torch.where(take1, bk[s1 >> 1, p1], bk[s0 >> 1, p0])
        cost = torch.stack(nxt, dim=1)
    st = cost.argmin(1, keepdim=True)  # the first of equal costs, as the host's strict <
    ks = torch.empty((n_s, t_n), dtype=torch.int64, device=dev)
    for t in range(t_n - 1, -1, -1):
        ks[:, t] = back_k[t].gather(1, st)[:, 0]
        st = back_s[t].long().gather(1, st)
    return ks


if triton is not None:

    @triton.jit
    def _cand(x, ok, kk, q: tl.constexpr, bits_row, esc_bits, delta, lam, c0, k0, c1, k1):
        """One candidate ``kk`` of quantizer ``q``: the cheaper even / the odd (``codec.trellis.quantize``)."""
        valid = ok & (kk != 0)
        r = 2 * kk - tl.where(kk > 0, q, -q)
        err = x - r.to(tl.float64) * delta
        inr = (kk >= -127) & (kk <= 127)
        kb = tl.load(bits_row + tl.minimum(tl.maximum(kk, -127), 127) + 128, mask=inr, other=0.0)
        cc = err * err + lam * tl.where(inr, kb, esc_bits)
        odd = (kk & 1) == 1
        up1 = valid & odd
        up0 = valid & (~odd) & (cc < c0)
        return tl.where(up0, cc, c0), tl.where(up0, kk, k0), tl.where(up1, cc, c1), tl.where(up1, kk, k1)

    @triton.jit
    def _trellis_kernel(
        u_ptr, live_ptr, bits_ptr, esc_ptr, f_ptr, bs_ptr, bk_ptr, out_ptr, N, T, BLOCK: tl.constexpr
    ):
        """One program per BLOCK streams: the forward pass over T tokens (back pointers to global memory,
        [T, 4, N]), then each stream's backtrack. ``u``/``live``/``out`` are [T, N] (coalesced per token); ``f``
        the float64 constants (1 / 2 DELTA, 1 / DELTA, DELTA, LAMBDA, a huge cost: a literal would be fp32)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        inv2d, invd = tl.load(f_ptr), tl.load(f_ptr + 1)
        delta, lam, big = tl.load(f_ptr + 2), tl.load(f_ptr + 3), tl.load(f_ptr + 4)
        bits_row = bits_ptr + offs.to(tl.int64) * 256
        esc_bits = tl.load(esc_ptr + offs, mask=m, other=0.0)
        zbits = tl.load(bits_row + 128, mask=m, other=0.0)
        c_0 = tl.zeros([BLOCK], tl.float64)
        huge = c_0 + big
        c_1, c_2, c_3 = huge, huge, huge
        zk = tl.zeros([BLOCK], tl.int64)
        for t in range(T):
            x = tl.load(u_ptr + t * N + offs, mask=m, other=0.0)
            ok = tl.load(live_ptr + t * N + offs, mask=m, other=0) != 0
            zc = x * x + lam * zbits
            b0 = tl.floor(x * inv2d).to(tl.int64)
            b1 = tl.floor((tl.abs(x) * invd + 1.0) * 0.5).to(tl.int64)
            b1 = tl.where(x < 0, -b1 - 1, b1)
            e00, k00, e01, k01 = _cand(x, ok, b0, 0, bits_row, esc_bits, delta, lam, zc, zk, huge, zk)
            e00, k00, e01, k01 = _cand(x, ok, b0 + 1, 0, bits_row, esc_bits, delta, lam, e00, k00, e01, k01)
            e10, k10, e11, k11 = _cand(x, ok, b1, 1, bits_row, esc_bits, delta, lam, zc, zk, huge, zk)
            e10, k10, e11, k11 = _cand(x, ok, b1 + 1, 1, bits_row, esc_bits, delta, lam, e10, k10, e11, k11)
            base_s = bs_ptr + t * 4 * N + offs
            base_k = bk_ptr + t * 4 * N + offs
            # _PRED: 0 <- (0,0),(1,1); 1 <- (2,0),(3,1); 2 <- (0,1),(1,0); 3 <- (2,1),(3,0); quantizer = state >> 1
            a, c = c_0 + e00, c_1 + e01
            n0 = tl.where(c < a, c, a)
            tl.store(base_s, tl.where(c < a, 1, 0).to(tl.int8), mask=m)
            tl.store(base_k, tl.where(c < a, k01, k00).to(tl.int16), mask=m)
            a, c = c_2 + e10, c_3 + e11
            n1 = tl.where(c < a, c, a)
            tl.store(base_s + N, tl.where(c < a, 3, 2).to(tl.int8), mask=m)
            tl.store(base_k + N, tl.where(c < a, k11, k10).to(tl.int16), mask=m)
            a, c = c_0 + e01, c_1 + e00
            n2 = tl.where(c < a, c, a)
            tl.store(base_s + 2 * N, tl.where(c < a, 1, 0).to(tl.int8), mask=m)
            tl.store(base_k + 2 * N, tl.where(c < a, k00, k01).to(tl.int16), mask=m)
            a, c = c_2 + e11, c_3 + e10
            n3 = tl.where(c < a, c, a)
            tl.store(base_s + 3 * N, tl.where(c < a, 3, 2).to(tl.int8), mask=m)
            tl.store(base_k + 3 * N, tl.where(c < a, k10, k11).to(tl.int16), mask=m)
            c_0, c_1, c_2, c_3 = n0, n1, n2, n3
        st = tl.zeros([BLOCK], tl.int32)
        best = c_0
        st = tl.where(c_1 < best, 1, st)
        best = tl.minimum(best, c_1)
        st = tl.where(c_2 < best, 2, st)
        best = tl.minimum(best, c_2)
        st = tl.where(c_3 < best, 3, st)
        for i in range(T):
            t = T - 1 - i
            at = t * 4 * N + st * N + offs
            kk = tl.load(bk_ptr + at, mask=m, other=0)
            tl.store(out_ptr + t * N + offs, kk, mask=m)
            st = tl.load(bs_ptr + at, mask=m, other=0).to(tl.int32)


def trellis_search_triton(
    u: torch.Tensor, live: torch.Tensor, bits: torch.Tensor, esc_bits: torch.Tensor, block: int = 128
) -> torch.Tensor:
    """``trellis_search_reference`` in one Triton launch (one program per ``block`` streams, a loop over the
    tokens in each). Back pointers take 6 bytes per stream, token and state of device memory. Returns k [N, T]
    int64."""
    n_s, t_n = u.shape
    ut = u.t().contiguous()
    lt = live.t().to(torch.int8).contiguous()
    back_s = torch.empty((t_n, 4, n_s), dtype=torch.int8, device=u.device)
    back_k = torch.empty((t_n, 4, n_s), dtype=torch.int16, device=u.device)
    out = torch.empty((t_n, n_s), dtype=torch.int16, device=u.device)
    f = torch.tensor(
        [1.0 / (2.0 * DELTA), 1.0 / DELTA, DELTA, LAMBDA, 1e300], dtype=torch.float64, device=u.device
    )
    grid = (triton.cdiv(n_s, block),)
    _trellis_kernel[grid](ut, lt, bits, esc_bits, f, back_s, back_k, out, n_s, t_n, BLOCK=block)
    return out.t().long()


def encode_layer_device(
    k: torch.Tensor,
    v: torch.Tensor,
    consts: EncodeConsts,
    cos: torch.Tensor,
    sin: torch.Tensor,
    style: int,
    first_pos: int,
    sinks: int,
    chunk: int,
    trellis: bool,
    cap: int,
    search=trellis_search_reference,
) -> CodedLayer:
    """``k``, ``v``: ``[T, H, D]`` in the KV dtype (T a multiple of ``chunk``) at positions ``first_pos..``;
    ``cos``/``sin`` [T, D/2] of those positions. See module docstring."""
    t_all, h, d = k.shape
    n = t_all // chunk
    if n * chunk != t_all or t_all == 0:
        raise ValueError(f"{t_all} tokens are not whole chunks of {chunk}")
    g, gd = consts.mean.shape[1], consts.mean.shape[2]
    ys = []
    for kv, x in enumerate((k, v)):
        xf = x.float()
        if kv == 0:
            xf = _undo_rope(xf, cos, sin, style)
        xc = xf.reshape(t_all, g, gd).transpose(0, 1) - consts.mean[kv][:, None]
        ys.append(
            torch.matmul(xc, consts.basis[kv]).reshape(g, n, chunk, gd).permute(1, 0, 2, 3)
        )  # [n, g, T, gd]
    y = torch.stack(ys)  # [2, n, g, T, gd]
    rms = y.square().mean(dim=(2, 4)).sqrt()  # [2, n, T]
    pos = first_pos + torch.arange(t_all, device=k.device).reshape(n, chunk)
    rms = torch.where(pos[None] < sinks, torch.zeros_like(rms), rms)
    scale, e8, base, fmt = _scales(rms, consts.log8)
    live = scale > 0  # [2, n, T]
    if trellis:
        u = (
            y.double()
            * (1.0 / consts.steps.double())[:, None, :, None, :]
            / scale.double()[:, :, None, :, None]
        )
        u = torch.where(live[:, :, None, :, None], u, torch.zeros_like(u))
        bad = ~(u.abs() * (1.0 / (2.0 * DELTA)) < MAX_K - 1).flatten(2).all(-1)  # NaN too
        flat = torch.nan_to_num(u, 0.0, 0.0, 0.0).permute(0, 1, 2, 4, 3).reshape(-1, chunk)  # [2 n g gd, T]
        lv = live[:, :, None, None, :].expand(2, n, g, gd, chunk).reshape(-1, chunk)
        q = search(flat, lv, *trellis_rates(flat))
        q = q.reshape(2, n, g * gd, chunk)
    else:
        qf = torch.round(y * consts.inv_steps[:, None, :, None, :] / scale[:, :, None, :, None])
        qf = torch.where(live[:, :, None, :, None], qf, torch.zeros_like(qf))
        bad = ~(qf.abs() <= 32767).flatten(2).all(-1)  # NaN too
        q = torch.nan_to_num(qf, 0.0, 0.0, 0.0).permute(0, 1, 2, 4, 3).reshape(2, n, g * gd, chunk).long()
    esc_m = (q < -127) | (q > 127)
    sym = torch.where(esc_m, ESC, q + ZERO).to(torch.uint8)
    flat_m = esc_m.reshape(2, n, -1)
    nesc = flat_m.sum(-1, dtype=torch.int32)
    slot = torch.where(flat_m & (flat_m.cumsum(-1) <= cap), flat_m.cumsum(-1) - 1, cap)
    esc = torch.zeros((2, n, cap + 1), dtype=torch.int16, device=k.device).scatter(
        2, slot, q.reshape(2, n, -1).clamp(-32768, 32767).to(torch.int16)
    )  # out of place: slot ``cap`` collects the non-escapes and is cut off
    bad = bad.any(0) | (nesc > cap).any(0) | ~torch.isfinite(y).flatten(2).all(-1).all(0)
    return CodedLayer(sym, esc[..., :cap].contiguous(), nesc, rms, e8, base, fmt, bad)
