"""The transform codec's CPU decode, bit for bit, against a plain-numpy reference of its pinned arithmetic.

The reference replays the trellis from the ``NEXT`` table, sums the integer codes times the 16-bit decode
matrix in int64 and then rounds exactly where ``codec.inverse`` documents it: ``float32(tot) * float32(col *
scale)``, ``+ mean``, RoPE as ``a * c - b * s`` / ``b * c + a * s`` in float32, then the storage dtype
(round to nearest even); sink tokens raw. Whatever the kernels do to go fast (the int8 or the float GEMM,
int32 or int64 sums, the trellis in closed form), a decoded bit that moves fails here. Parsing (the
decoded-layer buffer's layout) is the codec's own ``view`` with the scalar quantizer, which does not touch
the symbols."""

from __future__ import annotations

import numpy as np
import pytest
from calibration_helpers import make_calibration

from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec import inverse, trellis
from sgl_remote_kv.codec import transform_ops as ops
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.format import layer_section
from sgl_remote_kv.types import KVLayout, ModelFingerprint, RopeSpec

L, D = 2, 32


def _replay(sym: np.ndarray, esc: np.ndarray) -> np.ndarray:
    """k symbols [C, T] and their escapes -> the integer codes r [C, T] (int64), from the state table."""
    k = sym.astype(np.int64) - ops.ZERO
    at = sym == ops.ESC
    k[at] = esc  # boolean indexing is row-major: component-major, the escapes' order
    r = np.empty_like(k)
    for c in range(k.shape[0]):
        state = 0
        for t in range(k.shape[1]):
            kk = int(k[c, t])
            r[c, t] = 2 * kk - (state >> 1) * int(np.sign(kk))
            state = int(trellis.NEXT[state, kk & 1])
    return r


def _scalar_codes(sym: np.ndarray, esc: np.ndarray) -> np.ndarray:
    q = sym.astype(np.int64) - ops.ZERO
    q[sym == ops.ESC] = esc
    return q


def _to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    u = x.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _reference_layer(codec, scalar, hdr, layer, buf, fp):
    """(K, V) of one layer [T, H, D] in the storage dtype (uint16 bits for bf16)."""
    cal, lay = codec.cal, fp.layout
    vw = scalar.view(hdr, layer, buf)  # parsing only: the symbols as coded
    t_n, gd = vw.tokens, cal.group_dim
    tab = cal.inverse_tables(codec.quality, layer)
    cos, sin = ops.rope_tables(cal.rope, vw.start, t_n)
    half = cal.head_dim // 2
    outs = []
    for kv, esc in enumerate((vw.esc[: vw.nk], vw.esc[vw.nk :])):
        scale = vw.scales[kv]
        if codec.quantizer == "trellis":
            codes = _replay(vw.sym[kv], esc)
            scale = scale * np.float32(trellis.DELTA)
        else:
            codes = _scalar_codes(vw.sym[kv], esc)
        groups = []
        for g in range(vw.groups):
            wi = tab.wi[kv, vw.group + g].astype(np.int64)
            col = tab.col[kv, vw.group + g]
            tot = codes[g * gd : (g + 1) * gd].T @ wi  # exact
            x = tot.astype(np.float32) * (col[None, :] * scale[:, None])
            x = x + cal.mean[layer, kv, vw.group + g]
            if kv == 0:
                x = x.reshape(t_n, -1, cal.head_dim)
                if cal.rope.style == "neox":
                    a, b = x[..., :half], x[..., half:]
                else:
                    a, b = x[..., 0::2], x[..., 1::2]
                c, s = cos[:, None, :], sin[:, None, :]
                ra, rb = a * c - b * s, b * c + a * s
                x = np.concatenate([ra, rb], -1) if cal.rope.style == "neox" else np.stack([ra, rb], -1)
            groups.append(x.reshape(t_n, gd).astype(np.float32))
        out = _to_storage(np.concatenate(groups, axis=1), lay.dtype)
        out = np.ascontiguousarray(out).reshape(t_n, lay.num_kv_heads, lay.head_dim)
        flat = out.view(np.uint8).reshape(t_n, -1)
        flat[: vw.n_sink] = vw.sinks[kv]
        outs.append(out)
    return outs


def _cases():
    for quantizer in ("trellis", "scalar"):
        for dtype in ("bfloat16", "float16", "float32"):
            for style in ("neox", "gptj"):
                yield quantizer, dtype, style


@pytest.mark.parametrize("quantizer,dtype,style", list(_cases()))
def test_decode_is_the_reference_bit_for_bit(quantizer, dtype, style):
    heads, tp, rank, groups = (3, 1, 0, 1) if style == "neox" else (1, 3, 2, 3)
    fp = ModelFingerprint("Llama", KVLayout(L, heads, D, dtype), "w", rank, tp)
    rope = RopeSpec(10000.0 if style == "neox" else 500000.0, D, style)
    cal = make_calibration(fp, step=0.01, rope=rope, groups=groups, sinks=3, seed=5)
    try:
        codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.001", quantizer=quantizer)
        scalar = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.001", quantizer="scalar")
        rng = np.random.default_rng(len(quantizer) + len(dtype) + len(style))
        escapes = 0
        for t_n, start in ((64, 0), (37, 300), (1, 5), (2, 9000)):
            k = rng.standard_normal((L, t_n, heads, D)) * (1 + 3 * rng.random((L, t_n, 1, 1)))
            k[..., 3] *= 30  # outliers: escapes in and (trellis) out of the replay
            v = rng.standard_normal((L, t_n, heads, D))
            k, v = (_to_storage(a.astype(np.float32), dtype) for a in (k, v))
            blob = codec.encode(k, v, fp, start=start)
            got_k, got_v = codec.decode(blob, fp)
            hdr = codec.parse(blob, fp)
            scratch = np.empty(codec.max_scratch_bytes(hdr), np.uint8)
            for i in range(L):
                n = codec.lossless_stage(layer_section(blob, hdr, i), scratch)
                want_k, want_v = _reference_layer(codec, scalar, hdr, i, scratch[:n], fp)
                for got, want in ((got_k[i], want_k), (got_v[i], want_v)):  # as bytes: every bit
                    np.testing.assert_array_equal(
                        got.view(np.uint8), want.view(np.uint8), f"layer {i} T {t_n}"
                    )
                escapes += codec.view(hdr, i, scratch[:n]).esc.size
        assert escapes > 0
    finally:
        cm.unregister(cal.calib_id)


def test_both_gemms_and_both_sum_widths_decode_the_same_bits(monkeypatch):
    """The int8 GEMM (where this CPU's ``_int_mm`` is exact) and the float GEMM; int32 sums (where their
    bound allows them, as here) and int64 ones."""
    fp = ModelFingerprint("Llama", KVLayout(L, 2, D, "bfloat16"), "w")
    cal = make_calibration(fp, step=0.05, sinks=0, seed=6)
    try:
        codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.001")
        rng = np.random.default_rng(6)
        k = _to_storage((rng.standard_normal((L, 48, 2, D)) * 4).astype(np.float32), "bfloat16")
        blob = codec.encode(k, k, fp, start=100)
        int32_sums = inverse._int32_sums
        used = []  # the sum width of every decode call: True for int32
        outs = []
        for int_mm in (False, True) if inverse._int_mm_exact() else (False,):
            for int32 in (True, False):

                def sums(esc, gd, int32=int32):
                    used.append(int32 and int32_sums(esc, gd))
                    return used[-1]

                monkeypatch.setattr(inverse, "_use_int_mm", lambda t_n, v=int_mm: v and t_n > 1)
                monkeypatch.setattr(inverse, "_int32_sums", sums)
                outs.append(codec.decode(blob, fp))
        assert any(used) and not all(used)
        for o in outs[1:]:
            np.testing.assert_array_equal(o[0], outs[0][0])
            np.testing.assert_array_equal(o[1], outs[0][1])
    finally:
        cm.unregister(cal.calib_id)
