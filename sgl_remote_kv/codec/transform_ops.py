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
def count_escapes(sym) -> int:
    """How many ``ESC`` symbols ``sym`` (2-D uint8, any strides) holds: one pass, no temporary."""
    n = 0
    for c in range(sym.shape[0]):
        for t in range(sym.shape[1]):
            n += sym[c, t] == ESC
    return n


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
LOG8 = _LOG8  # the scale of each log-grid code (the device encode uploads it)


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
