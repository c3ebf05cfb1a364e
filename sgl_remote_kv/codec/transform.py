"""Transform codec: RoPE undone on keys, a per-model orthonormal transform, per-component steps, then
Deflate (what the DPU's engine speaks), zstd (a faster CPU entropy stage) or per-component static rANS.

Per layer and K/V separately (``calibration.Calibration`` holds everything fitted once per model)::

    x  = K with RoPE undone at positions start..start+T-1   (V as is)   [T, C = H*D] float32
    y  = (x - mean[g]) @ basis[g]   per head group g of the rank's heads (orthonormal, PCA)
    s  = RMS of y over the token's C components, on a log grid          a byte per token (``ops.code_scales``)
    q  = rint(y / (step[c] * s))           step from the calibration's quality level
    symbol = q + 128 for |q| <= 127 (and, under rANS, a symbol the table can code), else 0 = escape:
             q itself goes to the escape list (int16)

Decode inverts it: ``x = (q * s) @ W + mean`` with ``W = step * basis^T`` held as 16-bit integers per
output channel (``codec.inverse``: an exact integer GEMM on the CPU; the GPU kernel uses the same matrix),
RoPE re-applied for K, rounded to the storage dtype. Sequence positions below the calibration's ``sinks``
(attention sinks: a per-token scale serves their outsized values badly) are stored exactly instead. A
chunk's token offset ``start`` (its position in the sequence) is an encode argument and travels in each
layer section; the calibration's RoPE must be the model's (the server checks; the id of the calibration
is in the codec params, hence in every chunk key).

Decoded-layer buffer (lossless stage output, dequant stage input)::

    <IIHBBHHII  start, T, C (= H*D), scale format (0 fp16, 1 fp32, 2 log8), exact sink tokens S, layer,
                first head group, escapes K, escapes V
    scales K [T], scales V [T] (log8: float32 base K, base V, then a code byte per token and array:
                scale = base * 2^((code - 1) / 32), code 0 = 0); escapes K [n] int16, escapes V [n] int16
    exact K [S, H, D], exact V [S, H, D] (storage dtype)
    symbols K [C, T] uint8 (component-major), symbols V [C, T]

Section: ``deflate``: the three parts (prelude + scales + escapes + exact sinks, K symbols, V symbols) as
independent raw-Deflate streams (``lz.pack_streams``; the symbols Huffman-only, ``lz.compress_huffman``,
its blocks ending at component boundaries ``lz.plan_blocks`` chooses). ``zstd``: the same three parts as
zstd frames (``lz.compress_planned``: the symbols' blocks ending at the same planned boundaries).
``rans``: ``<III`` (prefix bytes, K words, V words), the prefix stored, then the two rANS word streams (one
context per (layer, K/V, channel)).

Threads: an instance is immutable; stages only write the caller's buffers, but unlike the ``quant`` codecs
they need work arrays (the rANS stage allocates a [T, C] symbol array per call; the dequant stage uses
``codec.inverse``'s per-thread arrays). Numba kernels and the torch GEMM release the GIL.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np

from sgl_remote_kv.codec import calibration as calib_mod
from sgl_remote_kv.codec import lz, quant, rans, trellis
from sgl_remote_kv.codec import transform_ops as ops
from sgl_remote_kv.codec.base import Codec
from sgl_remote_kv.codec.errors import CorruptChunk, ForeignChunk
from sgl_remote_kv.codec.format import ChunkHeader, pack
from sgl_remote_kv.codec.transform_device import PRE, TransformOnDevice
from sgl_remote_kv.types import QUANTIZERS, SCALAR_QUANTIZER, ModelFingerprint, RopeSpec

RANS_SUB = struct.Struct("<III")
MAX_ESCAPE_FRACTION = 4  # at most T*C/4 escapes per K or V of a layer (bounds the scratch size)
_MODES = {"float32": 0, "float16": 1, "bfloat16": 2}
# auto: each layer section is whichever of the two is smaller, behind a one-byte tag (AUTO_TAG): the static
# rANS tables win where the text resembles the calibration's, Deflate's per-block Huffman codes where not.
# zstd: the Deflate layout with zstd streams (the symbols' blocks planned alike): ~2% larger, its entropy
# stage about twice as fast on a CPU (docs/CODEC.md "Entropy stage").
ENTROPY = ("deflate", "rans", "auto", "zstd")
AUTO_TAG = {"deflate": 0, "rans": 1}
# quantizers (``types.QUANTIZERS``): scalar (rint) or trellis (``codec.trellis``; Deflate or zstd: the rANS
# tables fit scalar symbols)


class TransformCodec(TransformOnDevice, Codec):
    name = "transform"
    codec_id = 6
    device_dequant = True

    def __init__(
        self,
        calibration: str,
        quality: str = calib_mod.DEFAULT_LEVEL,
        entropy: str = "deflate",
        level: int = 1,
        quantizer: str = SCALAR_QUANTIZER,
    ) -> None:
        if entropy not in ENTROPY:
            raise ValueError(f"entropy must be one of {ENTROPY}")
        if quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}")
        if quantizer == "trellis" and entropy not in lz.PACKED:
            raise ValueError(f"the trellis quantizer codes with entropy in {tuple(lz.PACKED)} only")
        if quality not in calib_mod.LEVELS:
            raise ValueError(f"quality must be one of {calib_mod.LEVELS}")
        cal = calib_mod.lookup(bytes.fromhex(calibration)) if len(calibration) == 32 else None
        if cal is None:
            raise KeyError(f"calibration {calibration[:40]!r} is not registered here")
        cal.check_level(quality)
        self.cal, self.quality, self.entropy, self.level = cal, quality, entropy, int(level)
        self.quantizer = quantizer

    @classmethod
    def for_model(
        cls,
        fp: ModelFingerprint,
        quality: str = calib_mod.DEFAULT_LEVEL,
        entropy: str = "deflate",
        rope: RopeSpec | None = None,
        quantizer: str = SCALAR_QUANTIZER,
    ) -> TransformCodec:
        """The codec of ``fp``'s newest calibration; ``CalibrationError`` when there is none, it lacks
        ``quality``, or its RoPE is not ``rope`` (the model's)."""
        cal = calib_mod.find_for(fp, quality)
        if rope is not None and rope != cal.rope:
            raise calib_mod.CalibrationError(f"calibration RoPE {cal.rope} != the model's {rope}")
        calib_mod.group_of(fp, cal.groups, cal.group_dim)
        return cls(cal.calib_id.hex(), quality, entropy, quantizer=quantizer)

    def params(self) -> dict:
        p = {"calibration": self.cal.calib_id.hex(), "quality": self.quality, "entropy": self.entropy}
        if self.entropy != "rans":
            p["level"] = self.level
        if self.quantizer != SCALAR_QUANTIZER:  # absent for scalar: the keys of scalar chunks did not change
            p["quantizer"] = self.quantizer
        return p

    def aux_id(self, fingerprint: ModelFingerprint) -> bytes:
        return self.cal.calib_id

    def _check_aux(self, header: ChunkHeader, fingerprint: ModelFingerprint) -> None:
        if header.aux_id != self.cal.calib_id:
            raise ForeignChunk("chunk references another calibration")
        if calib_mod.model_key(fingerprint) != self.cal.model_key:
            raise ForeignChunk("the calibration belongs to another model")
        try:
            calib_mod.group_of(fingerprint, self.cal.groups, self.cal.group_dim)
        except calib_mod.CalibrationError as e:
            raise ForeignChunk(str(e)) from None

    # ---- encode -----------------------------------------------------------------------------
    def encode(self, k: np.ndarray, v: np.ndarray, fingerprint: ModelFingerprint, start: int = 0) -> bytes:
        from sgl_remote_kv.codec.base import check_chunk_arrays

        lay = fingerprint.layout
        check_chunk_arrays(k, v, lay)
        if calib_mod.model_key(fingerprint) != self.cal.model_key:
            raise ValueError("the calibration belongs to another model")
        if not 0 <= start < 1 << 31:
            raise ValueError(f"start {start} out of range")
        group = calib_mod.group_of(fingerprint, self.cal.groups, self.cal.group_dim)
        sections = [
            self.encode_layer(k[i], v[i], i, fingerprint, start, group) for i in range(lay.num_layers)
        ]
        return pack(
            self.codec_id, self.params_bytes(), fingerprint, k.shape[1], sections, aux_id=self.cal.calib_id
        )

    def encode_layer(self, k, v, layer, fingerprint, start: int = 0, group: int | None = None) -> bytes:
        lay = fingerprint.layout
        group = (
            calib_mod.group_of(fingerprint, self.cal.groups, self.cal.group_dim) if group is None else group
        )
        n_sink = ops.sink_count(self.cal, start, k.shape[0])
        ys = [
            ops.forward(self.cal, layer, kv, group, quant.to_f32(a, lay.dtype).copy(), start)
            for kv, a in enumerate((k, v))
        ]
        scaled = ops.code_scales([ops.token_rms(y, n_sink) for y in ys])
        args = (k, v, layer, group, start, n_sink, ys, scaled)
        if self.entropy != "auto":
            return self._section(self.entropy, *args)
        return min((self._section(e, *args) for e in AUTO_TAG), key=len)

    def _section(self, entropy, k, v, layer, group, start, n_sink, ys, scaled) -> bytes:
        """One layer section with ``entropy`` as its lossless stage (tagged when the codec's is auto)."""
        t_n, c_n = k.shape[0], k.shape[1] * k.shape[2]
        sfmt, sbytes, scales = scaled
        gs = slice(group, group + c_n // self.cal.group_dim)
        cap = max(1, t_n * c_n // MAX_ESCAPE_FRACTION)
        if entropy == "rans":
            freq, _ = self.cal.encode_tables(self.quality)
        else:
            freq = np.empty((0, calib_mod.SYMBOLS), np.uint16)
        tag = bytes([AUTO_TAG[entropy]]) if self.entropy == "auto" else b""
        syms, escs = [], []
        for kv, y in enumerate(ys):
            sym = np.empty((c_n, t_n), np.uint8)
            esc = np.empty(cap, np.int16)
            steps = self.cal.steps[self.quality][layer, kv, gs]
            if self.quantizer == "trellis":
                n = trellis.quantize(y, steps, scales[kv], trellis.DELTA, trellis.LAMBDA, sym, esc)
            else:
                n = ops.quantize(y, steps, scales[kv], freq, self.cal.ctx0(layer, kv, group), sym, esc)
            if n < 0:
                raise ValueError(f"layer {layer}: KV too far from the calibration to encode ({n})")
            syms.append(sym)
            escs.append(esc[:n])
        prefix = b"".join(
            [
                PRE.pack(start, t_n, c_n, sfmt, n_sink, layer, group, escs[0].size, escs[1].size),
                sbytes,
                *(e.tobytes() for e in escs),
                np.ascontiguousarray(k[:n_sink]).tobytes(),
                np.ascontiguousarray(v[:n_sink]).tobytes(),
            ]
        )
        if entropy in lz.PACKED:
            return tag + self._packed(lz.PACKED[entropy], prefix, syms, t_n)
        fl, cum = self.cal.encode_tables(self.quality)
        words = []
        for kv, sym in enumerate(syms):
            w, ok = rans.encode(
                np.ascontiguousarray(sym.T), self.cal.ctx0(layer, kv, group), fl, cum, self.cal.prob_bits
            )
            if not ok:
                raise ValueError(f"layer {layer}: a symbol has zero probability")
            words.append(w)
        head = RANS_SUB.pack(len(prefix), words[0].size, words[1].size)
        return b"".join([tag, head, prefix, words[0].tobytes(), words[1].tobytes()])

    def _packed(self, method: int, prefix: bytes, syms, t_n: int) -> bytes:
        return lz.pack_streams(
            method, self.level, [prefix, syms[0].tobytes(), syms[1].tobytes()], symbols=(1, 2), row=t_n
        )

    # ---- decode -----------------------------------------------------------------------------
    def _check_slice(self, layer: int, group: int, c_n: int) -> None:
        gd = self.cal.group_dim
        if layer >= self.cal.num_layers or c_n % gd or c_n == 0 or group + c_n // gd > self.cal.groups:
            raise CorruptChunk(
                f"section layer {layer} / group {group} / {c_n} channels outside the calibration"
            )

    def scratch_bytes(self, header: ChunkHeader, layer: int) -> int:
        lay = header.layout
        t_n, c_n = header.num_tokens, lay.num_kv_heads * lay.head_dim
        cap = max(1, t_n * c_n // MAX_ESCAPE_FRACTION)
        sinks = min(self.cal.sinks, t_n)
        scales = max(ops.scale_bytes(f, t_n) for f in (ops.SCALE_FP32, ops.SCALE_LOG8))
        return PRE.size + scales + 2 * 2 * cap + 2 * sinks * c_n * lay.itemsize + 2 * t_n * c_n

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        entropy = self.entropy
        if entropy == "auto":
            section = memoryview(section)
            if len(section) < 1 or section[0] not in AUTO_TAG.values():
                raise CorruptChunk("section has no valid entropy tag")
            entropy = "deflate" if section[0] == AUTO_TAG["deflate"] else "rans"
            section = section[1:]
        if entropy in lz.PACKED:
            return lz.unpack_streams(section, out, lz.PACKED[entropy])
        if len(section) < RANS_SUB.size + PRE.size:
            raise CorruptChunk("section shorter than its sub-header")
        prefix_len, kw, vw = RANS_SUB.unpack_from(section, 0)
        o = RANS_SUB.size
        if o + prefix_len + 2 * (kw + vw) != len(section) or prefix_len < PRE.size:
            raise CorruptChunk("section length does not match its streams")
        _, t_n, c_n, _, _, layer, group, _, _ = PRE.unpack_from(section, o)
        self._check_slice(layer, group, c_n)
        raw = prefix_len + 2 * t_n * c_n
        if raw > out.size or t_n == 0:
            raise CorruptChunk(f"section claims {raw} decoded bytes, scratch holds {out.size}")
        out[:prefix_len] = np.frombuffer(section, np.uint8, prefix_len, o)
        o += prefix_len
        cum16, bucket = self.cal.decode_tables(self.quality)
        n = t_n * c_n
        for kv, count in enumerate((kw, vw)):
            dst = np.empty((t_n, c_n), np.uint8)
            words = np.frombuffer(section, np.uint16, count, o) if count else np.empty(0, np.uint16)
            rc = rans.decode(
                words if words.ctypes.data % 2 == 0 else words.copy(),
                self.cal.ctx0(layer, kv, group),
                cum16,
                bucket,
                self.cal.prob_bits,
                dst,
            )
            if rc != 0:
                raise CorruptChunk(f"rANS stream {kv} is corrupt ({rc})")
            out[prefix_len + kv * n : prefix_len + (kv + 1) * n] = dst.T.reshape(-1)
            o += 2 * count
        return prefix_len + 2 * n

    def view(self, header: ChunkHeader, layer: int, decoded) -> TransformView:
        """Validate and slice a decoded-layer buffer (the one parser of that format); ``CorruptChunk``."""
        lay = header.layout
        buf = np.asarray(decoded, dtype=np.uint8)
        if buf.size < PRE.size:
            raise CorruptChunk("decoded layer shorter than its prelude")
        start, t_n, c_n, sdt, n_sink, sec_layer, group, nk, nv = PRE.unpack_from(buf, 0)
        if t_n != header.num_tokens or sdt > ops.SCALE_LOG8 or sec_layer != layer or start >= 1 << 31:
            raise CorruptChunk("layer prelude does not match the chunk header")
        if c_n != lay.num_kv_heads * lay.head_dim:
            raise CorruptChunk("layer prelude's channel count does not match the chunk header")
        self._check_slice(layer, group, c_n)
        if n_sink != ops.sink_count(self.cal, start, t_n):
            raise CorruptChunk("sink token count does not match the calibration")
        sb = ops.scale_bytes(sdt, t_n)
        sink_bytes = n_sink * c_n * lay.itemsize
        need = PRE.size + sb + 2 * (nk + nv) + 2 * sink_bytes + 2 * t_n * c_n
        if buf.size != need:
            raise CorruptChunk(f"decoded layer holds {buf.size} bytes, its prelude implies {need}")
        o = PRE.size
        sc = ops.read_scales(buf, o, sdt, t_n)
        if not np.all(np.isfinite(sc)):
            raise CorruptChunk("a token scale is not finite")
        o += sb
        esc = np.frombuffer(buf, np.int16, nk + nv, o) if nk + nv else np.empty(0, np.int16)
        o += 2 * (nk + nv)
        sinks = buf[o : o + 2 * sink_bytes].reshape(2, n_sink, c_n * lay.itemsize)
        o += 2 * sink_bytes
        sym = buf[o:].reshape(2, c_n, t_n)
        if self.quantizer == "trellis":
            trellis.check_escapes(esc)
            sc *= np.float32(trellis.DELTA)
        trellis_k = self.quantizer == "trellis"
        view = TransformView(self, layer, group, start, n_sink, sc, esc, nk, sinks, sym, trellis_k)
        if not view.escapes_consistent():  # here, so a bad chunk is a miss where it is fetched, not at a load
            raise CorruptChunk("escape count does not match the symbols")
        return view

    def dequant_stage(self, header: ChunkHeader, layer: int, decoded, out_k, out_v) -> None:
        self._check_out(header, out_k, out_v)
        self.view(header, layer, decoded).dequant_into(header.layout.dtype, out_k, out_v)


@dataclass(frozen=True)
class TransformView:
    """One layer of one chunk after the lossless stage (zero-copy views into the decoded buffer):
    ``scales`` [2, T] float32 (a copy), ``esc`` [nk + nv] int16 (K's first), ``sinks`` [2, S, C*itemsize]
    raw bytes of the exact sink tokens, ``sym`` [2, C, T] uint8 (component-major).

    ``trellis``: ``sym``/``esc`` hold a trellis-coded chunk's k as coded (the scales already times DELTA);
    the integer codes r are replayed where the chunk is dequantized: ``replayed`` on the host (the CPU
    stage), ``kernels.transform.trellis_codes`` on a device. Else they hold r (the scalar quantizer's)."""

    codec: TransformCodec
    layer: int
    group: int
    start: int
    n_sink: int
    scales: np.ndarray
    esc: np.ndarray
    nk: int
    sinks: np.ndarray
    sym: np.ndarray
    trellis: bool = False

    @property
    def tokens(self) -> int:
        return self.sym.shape[2]

    @property
    def groups(self) -> int:
        return self.sym.shape[1] // self.codec.cal.group_dim

    def escapes_consistent(self) -> bool:
        """Every escape symbol has its value and no value is left over (a device cannot check it)."""
        return all(
            ops.count_escapes(self.sym[kv]) == n for kv, n in enumerate((self.nk, self.esc.size - self.nk))
        )

    def replayed(self) -> TransformView:
        """The view with the integer codes r (new arrays for a trellis view; ``self`` otherwise);
        ``CorruptChunk`` when a trellis view's symbols and escapes disagree."""
        if not self.trellis:
            return self
        sym, esc, nk = trellis.replay(self.sym, self.esc, self.nk)
        return dataclasses.replace(self, sym=sym, esc=esc, nk=nk, trellis=False)

    def dequant_into(self, dtype: str, out_k: np.ndarray, out_v: np.ndarray) -> None:
        """The CPU dequant stage into ``out_k``/``out_v`` ([T, H, D] of ``dtype``'s storage, C-contiguous)."""
        if self.trellis:
            return self.replayed().dequant_into(dtype, out_k, out_v)
        cal = self.codec.cal
        t_n = self.tokens
        mode = _MODES[dtype]
        cos, sin = ops.rope_tables(cal.rope, self.start, t_n)
        style = ops.rope_style(cal.rope)
        n_g, gd = self.groups, cal.group_dim
        gs = slice(self.group, self.group + n_g)
        tables = cal.inverse_tables(self.codec.quality, self.layer)
        escs = (self.esc[: self.nk], self.esc[self.nk :])
        for kv, out in enumerate((out_k, out_v)):
            flat = out.reshape(t_n, n_g, gd)
            used = tables.decode(
                kv,
                self.group,
                self.sym[kv],
                escs[kv],
                self.scales[kv],
                cal.mean[self.layer, kv, gs],
                (cos, sin, style) if kv == 0 else None,
                cal.head_dim,
                mode,
                flat if mode == 0 else flat.view(np.uint16),
            )
            if used != escs[kv].size:
                raise CorruptChunk("escape count does not match the symbols")
            if self.n_sink:
                flat.view(np.uint8).reshape(t_n, -1)[: self.n_sink] = self.sinks[kv]
