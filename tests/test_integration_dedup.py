"""End to end, in-flight dedup: after a restart, two concurrent requests for the same long prompt fetch
its chunks once (the second waits on the first's fetch, then finds them as a local device hit).

Real CPU SGLang servers, real SmolLM2 (float32), embedded store behind a 0.5 s-per-call delay (so the
second request surely arrives while the first one's fetch is in flight), lossless codec.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.fixtures.remote_kv_server import CHUNK, generate, metrics, remote_kv_server, total

pytestmark = pytest.mark.e2e

DOC = " ".join(f"Paragraph {i}: a heron number {i} waits by river {i * 5 % 11} at dawn." for i in range(30))


# make test-slow (default run kept near 30 min): ~120 s
@pytest.mark.slow
def test_concurrent_same_prefix_fetches_once(model_dir, tmp_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(DOC + "\nWhere do herons wait?", add_special_tokens=False)[
        "input_ids"
    ]
    n_chunks = (len(ids) - 1) // CHUNK
    path = tmp_path / "store"
    with remote_kv_server(model_dir, f"file://{path}") as s1:
        base, _ = generate(s1, ids, 4)
        deadline = time.monotonic() + 180
        while metrics(s1).get("sglang:remote_kv_written_chunks_total", 0) < n_chunks:
            assert time.monotonic() < deadline, "write-back did not finish"
            time.sleep(0.5)
    with remote_kv_server(model_dir, f"faulty+file://{path}?latency_s=0.5") as s2:
        outs: list = [None, None]

        def run(i: int) -> None:
            outs[i] = generate(s2, ids, 4)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join(600)
        m = metrics(s2)
    assert all(o is not None and o["output_ids"] == base["output_ids"] for o in outs)
    assert m.get("sglang:remote_kv_dedup_followers_total", 0) == 1, m
    assert total(m, "hit_chunks") == n_chunks, m
