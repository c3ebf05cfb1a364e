"""Offline intra-frame layout search (KVFetcher §3.2.2): try every geometric tiling the three rules allow
(heads intact, element order kept, head order kept) on sample KV and keep the smallest encoding.

The search depends only on the model architecture and the codec (the paper finds it input-agnostic), so it
runs once per model; the result is a ``tiling`` string for :class:`~sgl_remote_kv.nvdec.hevc_codec.HevcCodec`.
Runs on the calling thread (x265 limited to one worker pool).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from sgl_remote_kv.nvdec import layout as lo
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec

from sgl_remote_kv.types import ModelFingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchResult:
    best: str  # tiling spec, e.g. "1x3/8x8"
    sizes: tuple[tuple[str, int], ...]  # (tiling, blob bytes summed over samples), smallest first


def search_tiling(
    samples: list[tuple[np.ndarray, np.ndarray]],
    fingerprint: ModelFingerprint,
    layers: int | None = 3,
    **codec_params,
) -> SearchResult:
    """Encode every candidate tiling on ``samples`` (``(k, v)`` chunks ``[L, T, H, D]``) and rank them.

    ``layers`` limits the sample to the first layers (a multiple of 3 keeps whole videos; ``None`` = all).
    """
    lay = fingerprint.layout
    fp = fingerprint
    if layers is not None and layers < lay.num_layers:
        from dataclasses import replace

        fp = replace(fingerprint, layout=replace(lay, num_layers=layers))
        samples = [(np.ascontiguousarray(k[:layers]), np.ascontiguousarray(v[:layers])) for k, v in samples]
    sizes = []
    for tiling in lo.candidate_tilings(lay.num_kv_heads, lay.head_dim):
        codec = HevcCodec(**{**codec_params, "tiling": tiling.spec()})
        total = sum(len(codec.encode(k, v, fp)) for k, v in samples)
        sizes.append((tiling.spec(), total))
        logger.debug("tiling %s: %d bytes", tiling.spec(), total)
    sizes.sort(key=lambda x: x[1])
    return SearchResult(sizes[0][0], tuple(sizes))
