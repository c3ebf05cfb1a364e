"""Rows of the ``hevc`` codec for the codec table (``benchmarks/bench_codec.py`` discovers ``rows(ctx)``).

Two rows on the codec table's real SmolLM2 KV (256-token chunks, bf16, all texts): our KVFetcher layout
(searched tiling, chosen resolution) and the naive llm.265 layout (one ``[tokens, channels]`` frame per
three layers), both with the default codec's quantization (256 bins, per-head scales) so their quality
equals ``quant_deflate``'s bit for bit and only the ratio differs. ``benchmarks/bench_nvdec.py`` writes
the chosen tiling/resolution into ``docs/results/nvdec.json``; without that file the defaults below apply.
Runs on the benchmark's main thread.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import sgl_remote_kv.nvdec  # noqa: F401  (registers "hevc")
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec

logger = logging.getLogger(__name__)

NVDEC_JSON = Path(__file__).resolve().parent.parent / "docs" / "results" / "nvdec.json"
QUANT = {"k_bins": "256", "v_bins": "256", "granularity": "head", "k_channel_scale": False}
DEFAULT_CHOICE = {"tiling": "1x3/8x8", "tokens_per_frame": 16}


def chosen() -> dict:
    """Tiling and resolution picked by the last ``bench_nvdec`` run (tune texts), else the defaults."""
    try:
        return {**DEFAULT_CHOICE, **json.loads(NVDEC_JSON.read_text())["choice"]}
    except (OSError, ValueError, KeyError) as e:
        logger.info("no nvdec choice (%s); using %s", e, DEFAULT_CHOICE)
        return dict(DEFAULT_CHOICE)


def codecs(choice: dict | None = None) -> list[tuple[str, str, HevcCodec]]:
    """(label, family, codec) of the rows."""
    c = choice or chosen()
    heads_dims = c["tiling"]
    ours = HevcCodec(**QUANT, tiling=heads_dims, tokens_per_frame=c["tokens_per_frame"])
    return [
        (
            f"hevc lossless, KVFetcher layout ({heads_dims}, {c['tokens_per_frame']} tok/frame, 256 bins/head)",
            "hevc-ours",
            ours,
        ),
        (
            "hevc lossless, naive llm.265 layout ([tokens x channels] frame, 256 bins/head)",
            "hevc-naive",
            HevcCodec(**QUANT, tiling=naive_tiling_spec(), tokens_per_frame=0, grid_cols=1),
        ),
    ]


def naive_tiling_spec(heads: int = 3, dim: int = 64) -> str:
    return f"1x{heads}/1x{dim}"


def rows(ctx, choice: dict | None = None) -> list[dict]:
    """Codec-table rows measured through ``ctx.measure_codec`` (single-thread timings)."""
    out = []
    lay = ctx.fingerprint.layout
    for label, family, codec in codecs(choice):
        if codec.tiling.hr * codec.tiling.hc != lay.num_kv_heads:
            codec = HevcCodec(
                **{**codec.params(), "tiling": naive_tiling_spec(lay.num_kv_heads, lay.head_dim)}
            )
        out.append(ctx.measure_codec(label, codec, timing=True, family=family, codec_name="hevc"))
    return out
