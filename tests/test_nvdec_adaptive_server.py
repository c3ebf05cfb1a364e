"""End to end, adaptive resolution (issue 37): real CPU SGLang servers, real SmolLM2 (float32), embedded store.

A ``--remote-kv nvdec`` server answers a prompt cold and writes every chunk back at each default
resolution (64-token chunks: 16, 32 tokens/frame and full), reporting each version's bytes; after a
restart the same prompt is a remote hit through the adaptive NVDEC fetcher (its decode table measured at
start-up on its own pool), every chunk at the resolution Alg. 1 chose (``nvdec_chunks{resolution}``),
and the greedy tokens equal the cold run's.
"""

from __future__ import annotations

import time

import pytest

from tests.fixtures.remote_kv_server import CHUNK, generate, metrics, remote_kv_server, storage_tokens, total

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALWAYS_FETCH = ("--remote-kv-policy-margin", "1e9")  # read through NVDEC even where recompute is faster
NEW_TOKENS = 16
LABELS = ("16", "32", "full")


def _prompt(tok) -> list[int]:
    body = " ".join(f"Item {i}: the lighthouse keeper logs ship number {i} at dawn." for i in range(20))
    return tok(body + "\nWhich ships did the keeper log?", add_special_tokens=False)["input_ids"]


def test_adaptive_restart_hit_tokens_equal_cold(model_dir, tmp_path):
    from transformers import AutoTokenizer

    prompt = _prompt(AutoTokenizer.from_pretrained(model_dir))
    chunks = (len(prompt) - 1) // CHUNK
    assert chunks >= 3
    store = f"file://{tmp_path / 'store'}"
    with remote_kv_server(model_dir, store, codec="default", mode="nvdec") as s1:
        cold, _ = generate(s1, prompt, NEW_TOKENS)
        deadline = time.monotonic() + 300  # three hevc encodes per chunk on a loaded CPU
        while total(metrics(s1), "nvdec_written_chunks") < len(LABELS) * chunks:  # every version
            assert time.monotonic() < deadline, "write-back did not finish"
            time.sleep(1.0)
        written = metrics(s1)
    for lab in LABELS:  # every version stored, its cost reported
        key = f'sglang:remote_kv_nvdec_written_chunks_total{{resolution="{lab}"}}'
        assert written.get(key) == chunks, (lab, written)
        assert written.get(f'sglang:remote_kv_nvdec_written_bytes_total{{resolution="{lab}"}}', 0) > 0
    with remote_kv_server(model_dir, store, *ALWAYS_FETCH, codec="default", mode="nvdec") as s2:
        assert "NVDEC resolutions ['full', '16', '32'] (fetch adaptive)" in s2.log_text()
        out, _ = generate(s2, prompt, NEW_TOKENS)
        m = metrics(s2)
    assert storage_tokens(out) == chunks * CHUNK, "the whole usable prefix came from the tier"
    assert m.get('sglang:remote_kv_decisions_total{path="nvdec"}', 0) == 1, m
    assert total(m, "nvdec_chunks") == chunks and total(m, "nvdec_fallbacks") == 0
    assert total(m, "nvdec_bytes") == m["sglang:remote_kv_fetched_bytes_total"]
    per_res = {lab: m.get(f'sglang:remote_kv_nvdec_chunks_total{{resolution="{lab}"}}', 0) for lab in LABELS}
    print(f"adaptive resolutions of the {chunks} chunks: {per_res}")
    assert out["output_ids"] == cold["output_ids"], "lossless versions: the hit's tokens equal the cold run's"
