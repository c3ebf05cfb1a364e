"""End to end, tail sub-chunks (issue 21): a prompt that ends mid-chunk is served from the store up to its
last sub-chunk once the local cache is gone, not just up to its last full chunk.

Real CPU SGLang server, real SmolLM2 (float32), embedded store, lossless codec, DPU path, chunks of 64
tokens with tail sub-chunks of 16 (``--remote-kv-tail-tokens 16``). The local cache is emptied with
``/flush_cache`` (the tier is kept); a restart reads the same store the same way (restarts:
tests/test_linker_server.py, tests/test_installed_wheel_server.py).
"""

from __future__ import annotations

import random
import time

import pytest

from tests.fixtures.remote_kv_server import (
    CHUNK,
    flush_cache,
    generate,
    metrics,
    remote_kv_server,
    storage_tokens,
    total,
)

pytestmark = pytest.mark.e2e

TAIL = 16


def test_prompt_ending_mid_chunk_is_served_up_to_its_last_sub_chunk(model_dir, tmp_path):
    rng = random.Random(7)
    ids = [rng.randrange(1000, 30000) for _ in range(3 * CHUNK + 2 * TAIL + 9)]  # 3 chunks, 2 subs, 9 left
    store = f"file://{tmp_path / 'store'}"
    with remote_kv_server(model_dir, store, "--remote-kv-tail-tokens", str(TAIL)) as srv:
        cold, _ = generate(srv, ids, 4)
        deadline = time.monotonic() + 180
        while metrics(srv).get("sglang:remote_kv_written_chunks_total", 0) < 3 + 2:  # chunks + tail
            assert time.monotonic() < deadline, "write-back did not finish"
            time.sleep(0.5)
        flush_cache(srv)
        before = total(metrics(srv), "hit_tokens")
        warm, _ = generate(srv, ids, 4)
        after = total(metrics(srv), "hit_tokens")
    assert storage_tokens(cold) == 0
    assert warm["output_ids"] == cold["output_ids"]
    assert storage_tokens(warm) == 3 * CHUNK + 2 * TAIL  # the whole stored prefix, tail included
    assert after - before == 3 * CHUNK + 2 * TAIL
