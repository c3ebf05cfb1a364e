"""The transform codec's numerics, shared by its encoder/decoder (``transform.py``), the calibration and the
benchmarks: RoPE undo/redo, the forward transform, per-token scales, quantization to symbols (numba
kernels, GIL released; the decode's kernel is ``codec.inverse``), plus ``roundtrip`` / ``symbols``, which
run one layer through the codec's own kernels for the calibration.

Symbols: ``q + ZERO`` for an ordinary code, ``ESC`` for an escape (the value goes to the escape list).
Stateless: every function writes only the arrays it is given or returns new ones; ``rope_tables`` caches
read-only tables.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from sgl_remote_kv.codec import calibration as calib_mod
from sgl_remote_kv.types import RopeSpec

ESC = 0
ZERO = 128


# ---- kernels (numba, GIL released) ----------------------------------------------------------
@njit(nogil=True, cache=True)
def rotate(x, cos, sin, style, sign):
    """RoPE on ``x`` [T, H, D] float32 in place; ``sign`` +1 applies it, -1 undoes it."""
    t_n, h_n, d = x.shape
    half = d // 2
    for t in range(t_n):
        for h in range(h_n):
            for i in range(half):
                c = cos[t, i]
                s = sin[t, i] * sign
                if style == 0:
                    a, b = x[t, h, i], x[t, h, i + half]
                    x[t, h, i] = a * c - b * s
                    x[t, h, i + half] = b * c + a * s
                else:
                    a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                    x[t, h, 2 * i] = a * c - b * s
                    x[t, h, 2 * i + 1] = b * c + a * s


@njit(nogil=True, cache=True)
def quantize(y, steps, scale, freq, ctx0, sym, esc):
    """y [H, T, D], steps [H, D], scale [T] -> sym [H*D, T] uint8 and escapes; returns the escape count,
    -1 when more than ``esc`` holds, -2 when a value does not fit int16. ``freq`` [N, 256] (rANS: a
    symbol with zero frequency is escaped) or an empty array (Deflate)."""
    h_n, t_n, d = y.shape
    use_freq = freq.shape[0] > 0
    n = 0
    for h in range(h_n):
        for j in range(d):
            c = h * d + j
            inv = np.float32(1.0) / steps[h, j]
            for t in range(t_n):
                q = np.int64(0)
                if scale[t] > 0:
                    q = np.int64(np.rint(y[h, t, j] * inv / scale[t]))
                s = q + ZERO
                if s < 1 or s > 255 or (use_freq and freq[ctx0 + c, s] == 0):
                    if n >= esc.shape[0]:
                        return -1
                    if q < -32768 or q > 32767:
                        return -2
                    esc[n] = q
                    n += 1
                    s = ESC
                sym[c, t] = s
    return n


# Trellis-coded ("dependent") quantization, as in H.266/VVC: two scalar quantizers on a grid of DELTA (in
# units of a value's step): Q0 reconstructs k as 2k DELTA, Q1 as (2k - sign(k)) DELTA; a 4-state machine,
# driven by the parity of each k along a component's tokens, says which one codes the next value (states
# 0-1: Q0, 2-3: Q1). The encoder picks the k sequence by a Viterbi search minimizing squared error +
# TRELLIS_LAMBDA x bits (a per-component rate model from the chunk's own values); the decoder only replays
# the state machine, so a symbol is still one k and the decoded value is an integer code r times a scale.
TRELLIS_NEXT = np.array([[0, 2], [2, 0], [1, 3], [3, 1]], np.int64)  # next state by (state, k & 1)
TRELLIS_DELTA = 0.6  # the grid, in units of the step (KL at or under rint's at the same steps: docs/CODEC.md)
TRELLIS_LAMBDA = 0.1  # squared error (in steps^2) one bit is worth
TRELLIS_MAX_K = 16383  # |r| = |2k - sign(k)| <= 32767 fits an int16 escape
# per state: the two (previous state, parity of k) that lead to it
_PRED = np.array(
    [[(st, p) for st in range(4) for p in range(2) if TRELLIS_NEXT[st, p] == ns] for ns in range(4)], np.int64
)
_NEXT_BITS = sum(int(s) << (4 * i) for i, s in enumerate(TRELLIS_NEXT.reshape(-1)))  # the table as nibbles


@njit(nogil=True, cache=True)
def quantize_trellis(y, steps, scale, delta, lam, sym, esc):
    """``quantize``'s contract (Deflate: no tables) with trellis-coded k in place of rint: ``sym`` [H*D, T]
    holds k + ZERO or ESC (k to ``esc``); returns the escape count, -1 when ``esc`` is too small, -2 when
    a value is beyond what TRELLIS_MAX_K codes (or not finite). Tokens of scale 0 (exact sinks) get k = 0.

    Per component: a rate model (bits of each k from a histogram of rint(u / 2 DELTA) over the chunk's
    tokens, where u = y / (step x scale)), then a Viterbi search over the 4 states with 3 candidates per
    quantizer (its two levels around u, and 0): the cheaper of each parity, then per state the cheaper of its
    two ways in."""
    h_n, t_n, d = y.shape
    inf = np.float64(1e300)
    inv2d, invd = 1.0 / (2.0 * delta), 1.0 / delta
    u = np.empty(t_n, np.float64)
    cnt = np.empty(256, np.float64)
    bits = np.empty(256, np.float64)
    cost = np.empty(4, np.float64)
    nxt = np.empty(4, np.float64)
    back_s = np.empty((t_n, 4), np.int8)
    back_k = np.empty((t_n, 4), np.int32)
    ks = np.empty(t_n, np.int64)
    bc = np.empty((2, 2), np.float64)  # per quantizer and parity: the cheapest candidate's cost
    bk = np.empty((2, 2), np.int64)  # and its k
    n = 0
    for h in range(h_n):
        for j in range(d):
            c = h * d + j
            inv = 1.0 / np.float64(steps[h, j])
            cnt[:] = 0.5
            for t in range(t_n):
                u[t] = 0.0
                if scale[t] > 0:
                    u[t] = np.float64(y[h, t, j]) * inv / np.float64(scale[t])
                if not abs(u[t]) * inv2d < TRELLIS_MAX_K - 1:  # (NaN too) no k can code it
                    return -2
                k0 = np.int64(np.rint(u[t] * inv2d))
                if -127 <= k0 <= 127:
                    cnt[k0 + ZERO] += 1.0
            tot = cnt.sum()
            unseen = -np.log2(0.5 / tot)
            for i in range(256):
                bits[i] = unseen if cnt[i] == 0.5 else -np.log2(cnt[i] / tot)
            esc_bits = 16.0 + bits[ESC]
            cost[:] = inf
            cost[0] = 0.0
            for t in range(t_n):
                x = u[t]
                # per quantizer q and parity p: the cheapest candidate k (of the levels below and above u,
                # one is even and one odd; 0 is even)
                zc = x * x + lam * bits[ZERO]
                for q in range(2):
                    bc[q, 0], bk[q, 0], bc[q, 1], bk[q, 1] = zc, 0, inf, 0
                    if scale[t] <= 0:
                        continue
                    if q == 0:
                        b = np.int64(np.floor(x * inv2d))
                    else:
                        b = np.int64(np.floor((abs(x) * invd + 1.0) * 0.5))
                        if x < 0:
                            b = -b - 1  # levels -b-1 (below) and -b (above)
                    for k in range(b, b + 2):
                        if k == 0:
                            continue
                        r = 2 * k - (q if k > 0 else -q)
                        e = x - r * delta
                        cc = e * e + lam * (bits[k + ZERO] if -127 <= k <= 127 else esc_bits)
                        p = k & 1
                        if p == 1 or cc < bc[q, 0]:
                            bc[q, p] = cc
                            bk[q, p] = k
                # each state has two ways in (``_PRED``): keep the cheaper
                for ns in range(4):
                    s0, p0 = _PRED[ns, 0, 0], _PRED[ns, 0, 1]
                    s1, p1 = _PRED[ns, 1, 0], _PRED[ns, 1, 1]
                    c0 = cost[s0] + bc[s0 >> 1, p0]
                    c1 = cost[s1] + bc[s1 >> 1, p1]
                    if c1 < c0:
                        nxt[ns] = c1
                        back_s[t, ns] = s1
                        back_k[t, ns] = bk[s1 >> 1, p1]
                    else:
                        nxt[ns] = c0
                        back_s[t, ns] = s0
                        back_k[t, ns] = bk[s0 >> 1, p0]
                cost[:] = nxt
            st = 0
            for i in range(1, 4):
                if cost[i] < cost[st]:
                    st = i
            for t in range(t_n - 1, -1, -1):
                ks[t] = back_k[t, st]
                st = back_s[t, st]
            for t in range(t_n):
                k = ks[t]
                if -127 <= k <= 127:
                    sym[c, t] = k + ZERO
                else:
                    if n >= esc.shape[0]:
                        return -1
                    esc[n] = k
                    n += 1
                    sym[c, t] = ESC
    return n


@njit(nogil=True, cache=True)
def trellis_codes(sym, esc, out_sym, out_esc):
    """Replay the trellis: ``sym`` [C, T] (k + ZERO or ESC, k from ``esc`` in order) -> ``out_sym`` /
    ``out_esc`` in ``quantize``'s form of the integer codes r (a value = r x DELTA x step x scale).
    Returns the escapes written (``out_esc`` int16, as many as ``sym`` has values), -1 when ``esc`` does not
    hold exactly the escaped values, -2 when an r does not fit int16 (not written by ``quantize_trellis``).
    Three passes: the k (component-major, where the escapes are in order), the state machine with tokens
    outer (the components' chains are independent, so they overlap), the codes."""
    c_n, t_n = sym.shape
    k = np.empty((c_n, t_n), np.int32)
    e_in = 0
    for c in range(c_n):
        for t in range(t_n):
            s = np.int32(sym[c, t])
            if s == ESC:
                if e_in >= esc.shape[0]:
                    return -1
                k[c, t] = esc[e_in]
                e_in += 1
            else:
                k[c, t] = s - ZERO
    if e_in != esc.shape[0]:
        return -1
    st = np.zeros(c_n, np.int32)
    for t in range(t_n):
        for c in range(c_n):
            kk = k[c, t]
            s0 = st[c]
            k[c, t] = 2 * kk - (s0 >> 1) * (np.int32(kk > 0) - np.int32(kk < 0))
            st[c] = (_NEXT_BITS >> (4 * (2 * s0 + (kk & 1)))) & 3
    n = 0
    for c in range(c_n):
        for t in range(t_n):
            r = k[c, t]
            if -127 <= r <= 127:
                out_sym[c, t] = r + ZERO
            else:
                if r < -32768 or r > 32767:
                    return -2
                out_esc[n] = r
                n += 1
                out_sym[c, t] = ESC
    return n


@functools.lru_cache(maxsize=64)
def rope_tables(rope: RopeSpec, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [tokens, rotary_dim/2] float32 of positions ``start..start+tokens-1`` (angles in float64)."""
    half = rope.rotary_dim // 2
    inv_freq = 1.0 / (rope.theta ** (np.arange(half, dtype=np.float64) * 2.0 / rope.rotary_dim))
    ang = np.arange(start, start + tokens, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    cos.setflags(write=False)
    sin.setflags(write=False)
    return cos, sin


def rope_style(rope: RopeSpec) -> int:
    return 0 if rope.style == "neox" else 1


def apply_rope(x: np.ndarray, rope: RopeSpec, start: int, sign: float) -> None:
    """RoPE of positions ``start..`` on ``x`` [T, H, D] float32 in place: ``sign`` +1 applies it, -1 undoes it."""
    cos, sin = rope_tables(rope, start, x.shape[0])
    rotate(x, cos, sin, rope_style(rope), np.float32(sign))


def forward(
    cal: calib_mod.Calibration, layer: int, kv: int, group: int, x: np.ndarray, start: int
) -> np.ndarray:
    """Position-free, centred, transformed ``x`` ([T, H, D] float32 of the head groups from ``group`` on,
    modified in place for K): [groups, T, C] coefficients. Shared by the encoder and the calibration."""
    if kv == 0:
        apply_rope(x, cal.rope, start, -1.0)
    g = x.shape[1] * x.shape[2] // cal.group_dim
    xc = (
        x.reshape(x.shape[0], g, cal.group_dim).transpose(1, 0, 2)
        - cal.mean[layer, kv, group : group + g, None]
    )
    return np.matmul(xc, cal.basis[layer, kv, group : group + g])


def sink_count(cal: calib_mod.Calibration, start: int, tokens: int) -> int:
    """How many leading tokens of a chunk at ``start`` are stored exactly."""
    return max(0, min(cal.sinks - start, tokens))


SCALE_FP16, SCALE_FP32, SCALE_LOG8 = 0, 1, 2  # how a layer section stores its token scales
LOG8_STEPS = 32  # SCALE_LOG8: codes per octave; a stored scale is within 1.1% of the token's RMS
_LOG8 = (2.0 ** ((np.arange(256) - 1) / LOG8_STEPS)).astype(np.float32)  # code e >= 1 -> base * 2^((e-1)/32)
_LOG8[0] = 0.0  # code 0: scale 0 (an exact sink token)
_LOG8.setflags(write=False)


def token_rms(y: np.ndarray, sinks: int = 0) -> np.ndarray:
    """Per-token RMS [T] float32 of ``y`` [G, T, C]; the first ``sinks`` tokens (stored exactly) get 0, which
    codes them as all-zero symbols."""
    rms = np.sqrt(np.mean(np.square(y, dtype=np.float32), axis=(0, 2)))
    rms[:sinks] = 0.0
    return rms


def _log8(rms: np.ndarray) -> tuple[np.float32, np.ndarray] | None:
    """(base, codes) of ``rms`` on the log grid, or ``None`` when its range or values do not fit it."""
    if not np.all(np.isfinite(rms)) or np.any(rms < 0):
        return None
    nz = rms > 0
    base = np.float32(rms[nz].min()) if nz.any() else np.float32(1.0)
    with np.errstate(divide="ignore"):
        e = np.where(nz, np.rint(np.log2(rms.astype(np.float64) / base) * LOG8_STEPS) + 1, 0)
    if e.max() > 255:
        return None
    return base, e.astype(np.uint8)


def code_scales(rms: list[np.ndarray]) -> tuple[int, bytes, list[np.ndarray]]:
    """The stored form of a layer section's token scales (K's, then V's): (``SCALE_*`` format, bytes, the
    float32 scales a decoder reads back, which the encoder must quantize with). ``SCALE_LOG8`` (a float32
    base per array, then a byte per token) when every array fits it, else fp16, else fp32."""
    logs = [_log8(r) for r in rms]
    if all(lg is not None for lg in logs):
        back = [base * _LOG8[e] for base, e in logs]
        return (
            SCALE_LOG8,
            b"".join(
                [np.asarray([b for b, _ in logs], np.float32).tobytes(), *(e.tobytes() for _, e in logs)]
            ),
            back,
        )
    fmt, dt = (SCALE_FP16, np.float16) if all(np.all(r <= 65504.0) for r in rms) else (SCALE_FP32, np.float32)
    stored = [r.astype(dt) for r in rms]
    return fmt, b"".join(a.tobytes() for a in stored), [a.astype(np.float32) for a in stored]


def scale_bytes(fmt: int, tokens: int, arrays: int = 2) -> int:
    """Bytes of ``arrays`` stored token-scale arrays in format ``fmt``."""
    return arrays * ({SCALE_FP16: 2 * tokens, SCALE_FP32: 4 * tokens}.get(fmt, 4 + tokens))


def read_scales(buf: np.ndarray, offset: int, fmt: int, tokens: int) -> np.ndarray:
    """The two stored token-scale arrays at ``buf[offset:]`` as float32 [2, T] (a copy)."""
    if fmt == SCALE_LOG8:
        base = np.frombuffer(buf, np.float32, 2, offset)
        codes = np.frombuffer(buf, np.uint8, 2 * tokens, offset + 8).reshape(2, tokens)
        return base[:, None] * _LOG8[codes]
    return (
        np.frombuffer(buf, np.float32 if fmt == SCALE_FP32 else np.float16, 2 * tokens, offset)
        .astype(np.float32)
        .reshape(2, tokens)
    )


def roundtrip(
    cal: calib_mod.Calibration, level: str, layer: int, kv: int, x: np.ndarray, start: int = 0, group: int = 0
) -> np.ndarray:
    """What encoding then decoding ``x`` ([T, H, D] float32 of one layer's K (kv=0) or V of one head group)
    gives back, in float32 (before the storage dtype's rounding), through the codec's own kernels
    (escapes unbounded). For the calibration, which scores candidate steps with the model."""
    t_n = x.shape[0]
    c_n = x.shape[1] * x.shape[2]
    gs = slice(group, group + c_n // cal.group_dim)
    n_sink = sink_count(cal, start, t_n)
    y = forward(cal, layer, kv, group, np.array(x, np.float32), start)
    s = code_scales([token_rms(y, n_sink)])[2][0]
    steps = cal.steps[level][layer, kv, gs]
    sym, esc = np.empty((c_n, t_n), np.uint8), np.empty(t_n * c_n, np.int16)
    n = quantize(y, steps, s, np.empty((0, calib_mod.SYMBOLS), np.uint16), 0, sym, esc)
    if n < 0:
        raise ValueError(f"layer {layer}: values do not fit the escape format ({n})")
    out = np.empty((t_n, y.shape[0], cal.group_dim), np.float32)
    cos, sin = rope_tables(cal.rope, start, t_n)
    rope = (cos, sin, rope_style(cal.rope)) if kv == 0 else None
    cal.inverse_tables(level, layer).decode(
        kv, group, sym, esc[:n], s, cal.mean[layer, kv, gs], rope, cal.head_dim, 0, out
    )
    out = out.reshape(x.shape)
    out[:n_sink] = x[:n_sink]
    return out


def symbols(
    cal: calib_mod.Calibration, level: str, layer: int, kv: int, x: np.ndarray, start: int = 0, group: int = 0
) -> np.ndarray:
    """The symbols [C, T] the Deflate variant would code for ``x``; for fitting rANS tables."""
    t_n, c_n = x.shape[0], x.shape[1] * x.shape[2]
    y = forward(cal, layer, kv, group, np.array(x, np.float32), start)
    s = code_scales([token_rms(y, sink_count(cal, start, t_n))])[2][0]
    sym, esc = np.empty((c_n, t_n), np.uint8), np.empty(t_n * c_n, np.int16)
    steps = cal.steps[level][layer, kv, group : group + y.shape[0]]
    if quantize(y, steps, s, np.empty((0, calib_mod.SYMBOLS), np.uint16), 0, sym, esc) < 0:
        raise ValueError(f"layer {layer}: values do not fit the escape format")
    return sym
