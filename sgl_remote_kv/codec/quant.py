"""Shared quantization for the quantized codecs (vector-wise max-abs, bins per layer group).

A value ``x`` of a vector with max-abs ``a`` quantized with ``bins`` bins uses ``m = (bins - 1) // 2``
levels per side: ``code = clip(rint(x / a * m), -m, m) + m`` (so ``2m + 1 <= bins`` symbols, uint8) and
decodes to ``(code - m) * a / m``. The error is at most ``a / (2m)`` plus the rounding of the stored
scale (fp16: relative 2^-11) and of the output dtype. All-zero vectors store ``a = 0`` and decode to 0.

Scale granularity: ``token`` = one scale per (layer, token) over all heads (CacheGen); ``head`` = one
per (token, head). ``k_channel_scale`` additionally divides keys by a per-(layer, channel) max-abs over
the chunk's tokens before the vector scaling (keys have outlier channels). ``k_outliers = n`` keeps the
``n`` key channels with the largest max-abs in the chunk (per layer) exact, in the KV dtype, and
quantizes the rest without them: outlier key channels dominate q·k, and this is what KL rewards most.

The decoded-layer buffer (what the lossless stage produces, what ``dequant_stage`` reads)::

    prelude  <BBBBI  scale dtype (0 fp16, 1 fp32), has channel scales, m_k, m_v, reserved
    k scales [T * G] , v scales [T * G]          (G = 1 or num_kv_heads), scale dtype
    k channel scales [H * D]                      (only if has channel scales), scale dtype
    k outlier channel ids [n] uint32, k outlier values [T, n] KV storage dtype   (only if k_outliers)
    k codes  [T, H * D] uint8, v codes [T, H * D] uint8
"""

from __future__ import annotations

import struct
from abc import abstractmethod
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from sgl_remote_kv.codec.base import Codec
from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.codec.format import ChunkHeader, pack
from sgl_remote_kv.types import ModelFingerprint

PRELUDE = struct.Struct("<BBBBI")
FP16_MAX = 65504.0
GRANULARITIES = ("token", "head")


def parse_bins(spec: str | int) -> tuple[tuple[int, int], ...]:
    """``"32@0,16@10"`` -> ((0, 32), (10, 16)): from layer 0 use 32 bins, from layer 10 use 16."""
    groups = []
    for part in str(spec).split(","):
        bins, _, start = part.strip().partition("@")
        groups.append((int(start or 0), int(bins)))
    if groups[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(groups, groups[1:], strict=False)):
        raise ValueError(f"bin groups must start at layer 0 and increase: {spec!r}")
    if any(not 3 <= b <= 256 for _, b in groups):
        raise ValueError(f"bins must be in [3, 256]: {spec!r}")
    return tuple(groups)


def bins_spec(groups: tuple[tuple[int, int], ...]) -> str:
    return ",".join(f"{b}@{s}" for s, b in groups)


def per_layer_spec(bins: list[int]) -> str:
    """[192, 192, 256, ...] (bins of every layer) -> "192@0,256@2,..." (runs merged)."""
    groups = [(i, b) for i, b in enumerate(bins) if i == 0 or bins[i - 1] != b]
    return bins_spec(tuple(groups))


@dataclass(frozen=True)
class QuantSpec:
    k_bins: tuple[tuple[int, int], ...]
    v_bins: tuple[tuple[int, int], ...]
    granularity: str = "token"
    k_channel_scale: bool = False
    k_outliers: int = 0

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}")
        if not 0 <= self.k_outliers <= 4096:
            raise ValueError("k_outliers must be in [0, 4096]")

    @classmethod
    def make(
        cls, k_bins="256", v_bins="256", granularity="token", k_channel_scale=False, k_outliers=0
    ) -> QuantSpec:
        return cls(
            parse_bins(k_bins), parse_bins(v_bins), granularity, bool(k_channel_scale), int(k_outliers)
        )

    def params(self) -> dict:
        p = {
            "k_bins": bins_spec(self.k_bins),
            "v_bins": bins_spec(self.v_bins),
            "granularity": self.granularity,
            "k_channel_scale": self.k_channel_scale,
        }
        if self.k_outliers:  # only when used, so existing params (and blobs) keep their canonical form
            p["k_outliers"] = self.k_outliers
        return p

    def outliers(self, channels: int) -> int:
        return min(self.k_outliers, channels)

    def levels(self, layer: int) -> tuple[int, int]:
        """(m_k, m_v): levels per side for ``layer``."""
        mk = [b for s, b in self.k_bins if s <= layer][-1]
        mv = [b for s, b in self.v_bins if s <= layer][-1]
        return (mk - 1) // 2, (mv - 1) // 2

    def groups(self, heads: int) -> int:
        return heads if self.granularity == "head" else 1

    @property
    def device_encodable(self) -> bool:
        """``kernels/quantize.py`` does this spec on the device (it keeps no outlier channels)."""
        return self.k_outliers == 0


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Storage-dtype array -> float32 (bf16 raw bits widened)."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def _quantize(x: np.ndarray, g: int, m: int, sdt) -> tuple[np.ndarray, np.ndarray]:
    """x [T, H, D] f32 -> (scales [T*g] of sdt, codes [T, H*D] uint8)."""
    t = x.shape[0]
    xv = x.reshape(t, g, -1)
    amax = np.abs(xv).max(axis=2).astype(sdt)
    a32 = amax.astype(np.float32)
    inv = np.divide(np.float32(m), a32, out=np.zeros_like(a32), where=a32 > 0)
    q = np.rint(xv * inv[:, :, None])
    np.clip(q, -m, m, out=q)
    codes = (q + m).astype(np.uint8).reshape(t, -1)
    return amax.reshape(-1), codes


def quantize_layer(spec: QuantSpec, k: np.ndarray, v: np.ndarray, layer: int, dtype: str) -> np.ndarray:
    """Quantize one layer (storage-dtype ``[T, H, D]``) into the decoded-layer buffer (uint8)."""
    kf, vf = to_f32(k, dtype), to_f32(v, dtype)
    if not (np.isfinite(kf).all() and np.isfinite(vf).all()):
        raise ValueError(f"layer {layer}: non-finite KV values")
    mk, mv = spec.levels(layer)
    big = max(float(np.abs(kf).max(initial=0.0)), float(np.abs(vf).max(initial=0.0)))
    sdt = np.float16 if big <= FP16_MAX / 2 else np.float32
    parts = [
        np.frombuffer(PRELUDE.pack(int(sdt == np.float32), int(spec.k_channel_scale), mk, mv, 0), np.uint8)
    ]
    outl = _split_outliers(spec, k, kf)
    if outl is not None:
        kf = outl[2]
    cs = None
    if spec.k_channel_scale:
        cs = np.abs(kf).max(axis=0).reshape(-1).astype(sdt)
        c32 = cs.astype(np.float32)
        kf = kf * np.divide(1.0, c32, out=np.zeros_like(c32), where=c32 > 0).reshape(kf.shape[1:])
    g = spec.groups(k.shape[1])
    ks, kc = _quantize(kf, g, mk, sdt)
    vs, vc = _quantize(vf, g, mv, sdt)
    parts += [ks.view(np.uint8), vs.view(np.uint8)]
    if cs is not None:
        parts.append(cs.view(np.uint8))
    if outl is not None:
        parts += [outl[0].view(np.uint8), outl[1].reshape(-1).view(np.uint8)]
    parts += [kc.reshape(-1), vc.reshape(-1)]
    return np.concatenate(parts)


def _split_outliers(spec: QuantSpec, k: np.ndarray, kf: np.ndarray):
    """(channel ids uint32 [n], exact values [T, n] storage dtype, kf with those channels zeroed)."""
    t = k.shape[0]
    n = spec.outliers(k[0].size)
    if n == 0:
        return None
    flat = kf.reshape(t, -1)
    idx = np.sort(np.argsort(-np.abs(flat).max(axis=0), kind="stable")[:n]).astype(np.uint32)
    vals = np.ascontiguousarray(k.reshape(t, -1)[:, idx])
    rest = flat.copy()
    rest[:, idx] = 0
    return idx, vals, rest.reshape(kf.shape)


def max_decoded_bytes(spec: QuantSpec, t: int, h: int, d: int) -> int:
    """Upper bound of the decoded-layer buffer size (fp32 scales and values)."""
    g = spec.groups(h)
    n = spec.outliers(h * d)
    return PRELUDE.size + 4 * (2 * t * g + (h * d if spec.k_channel_scale else 0) + n + t * n) + 2 * t * h * d


_NO_IDX = np.empty(0, np.uint32)


@dataclass(frozen=True)
class LayerView:
    """Zero-copy views into a decoded-layer buffer."""

    mk: int
    mv: int
    k_scales: np.ndarray  # [T, G] f16/f32
    v_scales: np.ndarray
    k_cs: np.ndarray  # [H*D] or empty
    k_codes: np.ndarray  # [T, H*D] uint8
    v_codes: np.ndarray
    k_out_idx: np.ndarray = field(default_factory=lambda: _NO_IDX)  # [n] uint32 exact key channels
    k_out_vals: np.ndarray = field(
        default_factory=lambda: _NO_IDX
    )  # [T, n] raw bits (u16 fp16/bf16, u32 fp32)

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[0]

    def dequant_into(self, dtype: str, out_k: np.ndarray, out_v: np.ndarray) -> None:
        """``dequant_layer`` of this view (the CPU stage)."""
        dequant_layer(self, dtype, out_k, out_v)


def split_layer(
    spec: QuantSpec, buf: np.ndarray, layer: int, t: int, h: int, d: int, itemsize: int = 2
) -> LayerView:
    """Validate and slice a decoded-layer buffer; ``CorruptChunk`` on any inconsistency.

    ``itemsize`` is the KV dtype's (only matters with ``k_outliers``)."""
    if buf.size < PRELUDE.size:
        raise CorruptChunk("decoded layer shorter than its prelude")
    sdt_code, has_cs, mk, mv, _ = PRELUDE.unpack_from(buf, 0)
    if sdt_code > 1 or has_cs != int(spec.k_channel_scale) or (mk, mv) != spec.levels(layer):
        raise CorruptChunk("decoded layer prelude does not match codec params")
    sdt = np.dtype(np.float32 if sdt_code else np.float16)
    g, c = spec.groups(h), h * d
    n_s = t * g * sdt.itemsize
    n_cs = c * sdt.itemsize if has_cs else 0
    n_out = spec.outliers(c)
    n_ob = n_out * 4 + t * n_out * itemsize
    want = PRELUDE.size + 2 * n_s + n_cs + n_ob + 2 * t * c
    if buf.size != want:
        raise CorruptChunk(f"decoded layer is {buf.size} bytes, expected {want}")
    o = PRELUDE.size
    ks = buf[o : o + n_s].view(sdt).reshape(t, g)
    vs = buf[o + n_s : o + 2 * n_s].view(sdt).reshape(t, g)
    o += 2 * n_s
    cs = buf[o : o + n_cs].view(sdt)
    o += n_cs
    idx, vals = _NO_IDX, _NO_IDX
    if n_out:
        idx = buf[o : o + 4 * n_out].view(np.uint32)
        if idx.max() >= c:
            raise CorruptChunk("outlier channel id out of range")
        vals = buf[o + 4 * n_out : o + n_ob].view(np.uint32 if itemsize == 4 else np.uint16).reshape(t, n_out)
        o += n_ob
    kc = buf[o : o + t * c].reshape(t, c)
    vc = buf[o + t * c :].reshape(t, c)
    return LayerView(mk, mv, ks, vs, cs, kc, vc, idx, vals)


# ---- numba dequantization (the CPU hot path; releases the GIL) --------------------------------


@njit(nogil=True, cache=True)
def _f32_to_f16_bits(src, bits, dst):
    """float32 row (and its uint32 view ``bits``) -> fp16 bits, round to nearest even."""
    for i in range(src.shape[0]):
        u = bits[i]
        sign = (u >> 16) & 0x8000
        a = u & 0x7FFFFFFF
        if a >= 0x47800000:  # overflow, inf, nan
            h = 0x7E00 if a > 0x7F800000 else 0x7C00
        elif a < 0x38800000:  # fp16 subnormal or zero: k * 2^-24
            h = np.uint32(np.rint(abs(src[i]) * np.float32(16777216.0)))
        else:
            a = a + np.uint32(0xC8000FFF) + ((a >> 13) & 1)  # rebias exponent (-112 << 23) + round
            h = (a >> 13) & 0xFFFF
        dst[i] = np.uint16(h | sign)


@njit(nogil=True, cache=True)
def _f32_to_bf16_bits(bits, dst):
    for i in range(bits.shape[0]):
        u = bits[i]
        if (u & 0x7FFFFFFF) > 0x7F800000:
            dst[i] = np.uint16((u >> 16) | 0x40)
        else:
            dst[i] = np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@njit(nogil=True, cache=True)
def dequant_rows(codes, scales, cs, m, mode, out32, out16):
    """codes [T, C] uint8, scales [T, G] f32 (max-abs), cs [C] f32 or empty -> out.

    ``mode`` 0 writes float32 into ``out32`` [T, C]; 1 (fp16) / 2 (bf16) write bits into ``out16``.
    """
    t_n, c_n = codes.shape
    g_n = scales.shape[1]
    dg = c_n // g_n
    row = np.empty(c_n, np.float32)
    rbits = row.view(np.uint32)
    inv_m = np.float32(1.0) / np.float32(m)
    use_cs = cs.shape[0] == c_n
    for t in range(t_n):
        dst = out32[t] if mode == 0 else row
        for g in range(g_n):
            s = scales[t, g] * inv_m
            base = g * dg
            if use_cs:
                for j in range(base, base + dg):
                    dst[j] = np.float32(np.int32(codes[t, j]) - m) * s * cs[j]
            else:
                for j in range(base, base + dg):
                    dst[j] = np.float32(np.int32(codes[t, j]) - m) * s
        if mode == 1:
            _f32_to_f16_bits(row, rbits, out16[t])
        elif mode == 2:
            _f32_to_bf16_bits(rbits, out16[t])


_MODES = {"float32": 0, "float16": 1, "bfloat16": 2}
_EMPTY32 = np.empty((1, 1), np.float32)
_EMPTY16 = np.empty((1, 1), np.uint16)


def dequant_layer(view: LayerView, dtype: str, out_k: np.ndarray, out_v: np.ndarray) -> None:
    """Write dequantized K and V of one layer into ``out_k``/``out_v`` ([T, H, D], storage dtype)."""
    mode = _MODES[dtype]
    cs = view.k_cs.astype(np.float32) if view.k_cs.size else np.empty(0, np.float32)
    empty_cs = np.empty(0, np.float32)
    for codes, sc, c, m, out in (
        (view.k_codes, view.k_scales, cs, view.mk, out_k),
        (view.v_codes, view.v_scales, empty_cs, view.mv, out_v),
    ):
        o2 = out.reshape(codes.shape[0], -1)
        s32 = sc.astype(np.float32)
        if mode == 0:
            dequant_rows(codes, s32, c, m, 0, o2, _EMPTY16)
        else:
            dequant_rows(codes, s32, c, m, mode, _EMPTY32, o2.view(np.uint16))
    if view.k_out_idx.size:  # exact outlier key channels overwrite their (zero) dequantized values
        ok = out_k.reshape(view.k_codes.shape[0], -1)
        ok.view(view.k_out_vals.dtype)[:, view.k_out_idx] = view.k_out_vals


class QuantCodec(Codec):
    """The stages the per-layer quantized codecs share: their lossless stage yields this module's
    decoded-layer buffer, so its size bound and its dequantization are the same for all of them.
    Subclasses set ``self.spec`` (a ``QuantSpec``)."""

    spec: QuantSpec
    device_dequant = True

    @property
    def device_encode(self) -> bool:
        """A device pool's write-back quantizes on the device and brings back codes (``encode_quantized``)."""
        return self.spec.device_encodable

    def device_encode_spec(self, fingerprint: ModelFingerprint) -> QuantSpec:
        """What ``KVWriter.read_quantized_later`` quantizes by."""
        return self.spec

    def encode_layer(self, k: np.ndarray, v: np.ndarray, layer: int, fingerprint: ModelFingerprint) -> bytes:
        buf = quantize_layer(self.spec, k, v, layer, fingerprint.layout.dtype)
        n = k.size
        return self.encode_parts(buf[: buf.size - 2 * n], buf[-2 * n : -n], buf[-n:], layer, fingerprint)

    @abstractmethod
    def encode_parts(self, head, k_codes, v_codes, layer: int, fingerprint: ModelFingerprint) -> bytes:
        """The entropy stage of one layer's decoded-layer buffer, given as its three parts (their
        concatenation is the buffer: prelude and scales, K codes, V codes; uint8 arrays)."""

    def encode_quantized(self, q, j: int, fingerprint: ModelFingerprint) -> bytes:
        """Chunk ``j`` of a device-quantized read (``quantized.QuantizedChunks``) as a blob: the same bytes
        ``encode`` makes of its KV."""
        parts = (q.layer_parts(self.spec, i, j) for i in range(fingerprint.layout.num_layers))
        sections = [self.encode_parts(*p, i, fingerprint) for i, p in enumerate(parts)]
        return pack(
            self.codec_id,
            self.params_bytes(),
            fingerprint,
            q.chunk,
            sections,
            aux_id=self.aux_id(fingerprint),
        )

    def scratch_bytes(self, header: ChunkHeader, layer: int) -> int:
        lay = header.layout
        return max_decoded_bytes(self.spec, header.num_tokens, lay.num_kv_heads, lay.head_dim)

    def view(self, header: ChunkHeader, layer: int, decoded) -> LayerView:
        """Codes and scales of one decoded layer (views into ``decoded``); ``CorruptChunk`` if malformed."""
        lay = header.layout
        buf = np.asarray(decoded, dtype=np.uint8)
        return split_layer(
            self.spec, buf, layer, header.num_tokens, lay.num_kv_heads, lay.head_dim, lay.itemsize
        )

    def dequant_stage(
        self, header: ChunkHeader, layer: int, decoded, out_k: np.ndarray, out_v: np.ndarray
    ) -> None:
        self._check_out(header, out_k, out_v)
        self.view(header, layer, decoded).dequant_into(header.layout.dtype, out_k, out_v)
