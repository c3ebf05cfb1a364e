"""Quantized + per-channel static-model rANS: our entropy-coded codec.

Codes are coded with one distribution per (layer, K/V, channel), fitted once per model and quantization
spec (``tables.fit``) and stored once (``tables.EntropyTables``), so chunks carry no tables — unlike
CacheGen, whose per-chunk tables are ~40% of its payload at 256 tokens. The blob's ``aux_id`` is the
table id; a decoder that does not know it raises ``ForeignChunk``.

Section::

    <8sHHIIIII  table id prefix (8 B), layer, reserved, T, C, prefix_len, k_words, v_words
    prefix      prelude + scales (+ key channel scales) exactly as in the decoded-layer buffer
    k words     uint16 rANS stream of K codes (channel-major), v words likewise
"""

from __future__ import annotations

import json
import struct

import numpy as np

from sgl_remote_kv.codec import quant, rans
from sgl_remote_kv.codec.calibration import tables
from sgl_remote_kv.codec.calibration import tables as tables_mod
from sgl_remote_kv.codec.errors import CorruptChunk, ForeignChunk
from sgl_remote_kv.codec.format import ChunkHeader
from sgl_remote_kv.types import ModelFingerprint

SUB = struct.Struct("<8sHHIIIII")


def words_view(section: memoryview, offset: int, count: int) -> np.ndarray:
    """uint16 view of ``count`` words at ``offset`` (copied only if misaligned)."""
    w = np.frombuffer(section, np.uint16, count, offset) if count else np.empty(0, np.uint16)
    return w if w.ctypes.data % 2 == 0 else w.copy()


class QuantRansCodec(quant.QuantCodec):
    name = "quant_rans"
    codec_id = 3

    def __init__(
        self,
        k_bins: str | int = "256",
        v_bins: str | int = "256",
        granularity: str = "token",
        k_channel_scale: bool = False,
        tables: tables.EntropyTables | None = None,
        k_outliers: int = 0,
    ):
        self.spec = quant.QuantSpec.make(k_bins, v_bins, granularity, k_channel_scale, k_outliers)
        self._spec_json = quant_spec_json(self.spec)
        if tables is not None:
            if tables.spec_params != self._spec_json:
                raise ValueError("tables were fitted for another quantization spec")
            tables_mod.register(tables)
        self._tables = tables

    def params(self) -> dict:
        return self.spec.params()

    # ---- tables -----------------------------------------------------------------------------
    def tables_for(self, fingerprint: ModelFingerprint) -> tables.EntropyTables:
        t = self._tables
        if t is None or t.fingerprint_digest != fingerprint.digest():
            t = tables.find_for(fingerprint.digest(), self._spec_json)
        if t is None:
            raise ValueError(f"no entropy tables for this model and {self._spec_json}; run tables.fit first")
        return t

    def aux_id(self, fingerprint: ModelFingerprint) -> bytes:
        return self.tables_for(fingerprint).table_id

    def _check_aux(self, header: ChunkHeader, fingerprint: ModelFingerprint) -> None:
        """The blob's table is a registered one for this model and spec (found by id, not refitted)."""
        t = tables.lookup(header.aux_id)
        if t is None:
            raise ForeignChunk(f"unknown entropy table {header.aux_id.hex()}")
        if t.fingerprint_digest != header.fingerprint_digest or t.spec_params != self._spec_json:
            raise ForeignChunk("entropy table belongs to another model or spec")

    # ---- encode -----------------------------------------------------------------------------
    def _section_tables(self, view: quant.LayerView, layer: int, fingerprint: ModelFingerprint):
        """(table id prefix, [(freq, cum, ctx0, prob_bits) for K, V], extra bytes to ship in the section)."""
        t = self.tables_for(fingerprint)
        freq, cum = t.flat()
        models = [(freq, cum, t.ctx0(layer, 0), t.prob_bits), (freq, cum, t.ctx0(layer, 1), t.prob_bits)]
        return t.table_id[:8], models, b""

    def encode_parts(
        self,
        head: np.ndarray,
        k_codes: np.ndarray,
        v_codes: np.ndarray,
        layer: int,
        fingerprint: ModelFingerprint,
    ) -> bytes:
        lay = fingerprint.layout
        c_n = lay.num_kv_heads * lay.head_dim
        t_n = k_codes.size // c_n
        buf = np.concatenate([head, k_codes, v_codes])
        view = quant.split_layer(self.spec, buf, layer, t_n, lay.num_kv_heads, lay.head_dim, lay.itemsize)
        prefix_len = buf.size - 2 * t_n * c_n
        tid, models, extra = self._section_tables(view, layer, fingerprint)
        streams = []
        for codes, (freq, cum, ctx0, bits) in zip((view.k_codes, view.v_codes), models, strict=True):
            words, ok = rans.encode(codes, ctx0, freq, cum, bits)
            if not ok:
                raise ValueError(f"layer {layer}: a code has zero probability in its table")
            streams.append(words)
        head = SUB.pack(tid, layer, 0, t_n, c_n, prefix_len, streams[0].size, streams[1].size)
        return b"".join([head, buf[:prefix_len].tobytes(), extra, streams[0].tobytes(), streams[1].tobytes()])

    # ---- decode -----------------------------------------------------------------------------
    def _decode_models(self, section: memoryview, tid: bytes, layer: int, c_n: int, offset: int):
        """([(cum16, bucket, ctx0, prob_bits) for K, V], bytes of the section consumed by tables)."""
        t = tables.lookup(tid)
        if t is None:
            raise ForeignChunk(f"unknown entropy table {tid.hex()}")
        if layer >= t.num_layers or c_n != t.channels:
            raise CorruptChunk("section layer/channels do not fit the entropy table")
        cum16, bucket = t.decode_tables()
        bits = t.prob_bits
        return [(cum16, bucket, t.ctx0(layer, 0), bits), (cum16, bucket, t.ctx0(layer, 1), bits)], 0

    def lossless_stage(self, section: memoryview, out: np.ndarray) -> int:
        if len(section) < SUB.size:
            raise CorruptChunk("section shorter than its sub-header")
        tid, layer, _, t_n, c_n, prefix_len, kw, vw = SUB.unpack_from(section, 0)
        n_codes = t_n * c_n
        raw_len = prefix_len + 2 * n_codes
        if raw_len > out.size or n_codes == 0:
            raise CorruptChunk(f"section claims {raw_len} decoded bytes, scratch holds {out.size}")
        if SUB.size + prefix_len > len(section):
            raise CorruptChunk("section prefix truncated")
        models, tbl_len = self._decode_models(section, tid, layer, c_n, SUB.size + prefix_len)
        o = SUB.size + prefix_len + tbl_len
        if o + 2 * (kw + vw) != len(section):
            raise CorruptChunk("section length does not match its streams")
        out[:prefix_len] = np.frombuffer(section, np.uint8, prefix_len, SUB.size)
        for j, count in enumerate((kw, vw)):
            cum16, bucket, ctx0, bits = models[j]
            dst = out[prefix_len + j * n_codes : prefix_len + (j + 1) * n_codes].reshape(t_n, c_n)
            rc = rans.decode(words_view(section, o, count), ctx0, cum16, bucket, bits, dst)
            if rc != 0:
                raise CorruptChunk(f"rANS stream {j} of layer {layer} is corrupt ({rc})")
            o += 2 * count
        return raw_len


def quant_spec_json(spec: quant.QuantSpec) -> str:
    return json.dumps(spec.params(), sort_keys=True, separators=(",", ":"))
