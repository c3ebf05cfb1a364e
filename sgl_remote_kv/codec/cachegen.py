"""Re-implemented CacheGen peer (as shipped in LMCache): per-(layer, token) max-abs quantization with
CacheGen's bins (K 32 bins for layers 0-9 then 16; V 32 bins for layers 0-1 then 16), then static
entropy coding with one distribution per (layer, K/V, channel) **built per chunk and shipped in the
blob** (so the tables count in its size, as in LMCache). Our rANS stands in for its arithmetic coder
(same model, same bits within a fraction of a percent).

Section: like ``quant_rans`` (table id prefix zero) with, after the prefix, the K frequency tables
``[C, 2*m_k+1]`` uint16 and the V tables ``[C, 2*m_v+1]`` uint16 (12-bit frequencies; LMCache ships
16-bit CDFs of the same size).
"""

from __future__ import annotations

import numpy as np

from sgl_remote_kv.codec import quant, rans
from sgl_remote_kv.codec.base import NO_AUX, Codec
from sgl_remote_kv.codec.errors import CorruptChunk
from sgl_remote_kv.codec.quant_rans import QuantRansCodec
from sgl_remote_kv.types import ModelFingerprint

CACHEGEN_K_BINS = "32@0,16@10"
CACHEGEN_V_BINS = "32@0,16@2"


def _chunk_freq(codes: np.ndarray, nsym: int) -> np.ndarray:
    c_n = codes.shape[1]
    idx = (codes.astype(np.int64) + (np.arange(c_n) * nsym)[None, :]).ravel()
    counts = np.bincount(idx, minlength=c_n * nsym).reshape(c_n, nsym).astype(np.float64)
    return rans.normalize_counts(counts, rans.PROB_BITS)


class CacheGenCodec(QuantRansCodec):
    name = "cachegen"
    codec_id = 4

    def __init__(
        self,
        k_bins: str | int = CACHEGEN_K_BINS,
        v_bins: str | int = CACHEGEN_V_BINS,
        granularity: str = "token",
        k_channel_scale: bool = False,
        k_outliers: int = 0,
    ):
        super().__init__(k_bins, v_bins, granularity, k_channel_scale, k_outliers=k_outliers)

    _check_aux = Codec._check_aux

    def aux_id(self, fingerprint: ModelFingerprint) -> bytes:
        return NO_AUX

    def _section_tables(self, view: quant.LayerView, layer: int, fingerprint: ModelFingerprint):
        models, extra = [], []
        for codes, m in ((view.k_codes, view.mk), (view.v_codes, view.mv)):
            freq = _chunk_freq(codes, 2 * m + 1)
            cum, ok = rans.build_cum(freq, rans.PROB_BITS)
            assert ok, "normalize_counts always yields valid tables"
            models.append((freq, cum, 0, rans.PROB_BITS))
            extra.append(freq.tobytes())
        return bytes(8), models, b"".join(extra)

    def _decode_models(self, section: memoryview, tid: bytes, layer: int, c_n: int, offset: int):
        mk, mv = self.spec.levels(layer)
        models, o = [], offset
        for m in (mk, mv):
            n = c_n * (2 * m + 1)
            if o + 2 * n > len(section):
                raise CorruptChunk("frequency tables truncated")
            freq = np.frombuffer(section, np.uint16, n, o).reshape(c_n, 2 * m + 1).copy()
            cum16, bucket, ok = rans.build_decode_tables(freq, rans.PROB_BITS)
            if not ok:
                raise CorruptChunk("invalid frequency table")
            models.append((cum16, bucket, 0, rans.PROB_BITS))
            o += 2 * n
        return models, o - offset
