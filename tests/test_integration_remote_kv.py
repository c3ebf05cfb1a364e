"""End to end: real CPU SGLang servers, real SmolLM2 (float32), real embedded store, lossless codec.

One scenario per test (each starts servers one at a time, always stopped by the fixture):

- ``test_multi_turn_fidelity_partial_chunked``: a baseline server without the tier answers a
  two-turn chat and a document question; a tier server (small ``--chunked-prefill-size``) answers turn
  1 and writes it back; with its local cache flushed (``/flush_cache``; the tier is kept, as after a
  restart: restarts are tests/test_linker_server.py's and tests/test_installed_wheel_server.py's) turn 2
  is served from the remote tier (cached tokens by tier report ``storage``) and is token-identical to
  the baseline; the same document with a different question fetches exactly the document's chunks; the
  remote hit is longer than one prefill chunk.
- ``test_slow_store_no_hit_not_delayed_and_abort``: with a store that answers every call after 1 s, a
  request without a remote hit sent while another waits for its fetch gets its answer first; a
  request aborted while waiting for KV is cancelled cleanly and the server keeps serving. (The DPU data
  plane lost during a fetch: tests/test_faults_server.py::test_data_plane_lost_mid_fetch.)
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.fixtures.faults import wait_written
from tests.fixtures.remote_kv_server import (
    CHUNK,
    chat,
    flush_cache,
    generate,
    metrics,
    remote_kv_server,
    storage_tokens,
    total,
)

pytestmark = pytest.mark.e2e

DOC = " ".join(
    f"Section {i}: the quick brown fox number {i} jumps over the lazy dog and studies topic {i * 7 % 13}."
    for i in range(24)
)
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K+V, 30 layers, 3 KV heads, head dim 64, float32
Q1 = " Question: What does the fox do?\nAnswer:"
Q2 = "\nWhich topic does section 3 study?\nAnswer:"


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _text(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


def test_multi_turn_fidelity_partial_chunked(model_dir, tmp_path, tok):
    store = f"file://{tmp_path / 'store'}"
    doc_ids = _ids(tok, DOC)
    q1_ids, q2_ids = _ids(tok, Q1), _ids(tok, Q2)
    assert q1_ids[0] != q2_ids[0], "questions must diverge at their first token"
    turn1 = [{"role": "user", "content": DOC + " What does the fox do?"}]

    with remote_kv_server(model_dir, None) as base:
        b1 = chat(base, turn1)
        turn2 = turn1 + [
            {"role": "assistant", "content": _text(b1)},
            {"role": "user", "content": "And what does the dog do?"},
        ]
        b2 = chat(base, turn2)
        base_doc_q2, _ = generate(base, doc_ids + q2_ids)

    with remote_kv_server(model_dir, store, "--chunked-prefill-size", "128") as s1:
        r1 = chat(s1, turn1)
        assert _text(r1) == _text(b1)
        assert storage_tokens(r1) == 0
        generate(s1, doc_ids + q1_ids)
        turn1_tokens = r1["usage"]["prompt_tokens"]
        wait_written(s1, 0, (turn1_tokens - 1) // CHUNK + len(doc_ids) // CHUNK, 120)
        flush_cache(s1)  # local cache empty, tier kept
        r2 = chat(s1, turn2)
        hit = storage_tokens(r2)
        assert hit >= (turn1_tokens - 1) // CHUNK * CHUNK, (hit, turn1_tokens)
        assert hit > 128, "the remote hit must span more than one prefill chunk"
        assert _text(r2) == _text(b2), "remote KV (lossless, fp32) must be token-identical"

        before = metrics(s1)
        out, _ = generate(s1, doc_ids + q2_ids)
        after = metrics(s1)
        doc_chunks = len(doc_ids) // CHUNK
        got = total(after, "hit_chunks") - total(before, "hit_chunks")
        assert got == doc_chunks, (got, doc_chunks)
        assert storage_tokens(out) == doc_chunks * CHUNK
        decoded = (
            after["sglang:remote_kv_decoded_bytes_total"] - before["sglang:remote_kv_decoded_bytes_total"]
        )
        assert decoded == doc_chunks * CHUNK * KV_BYTES_PER_TOKEN
        assert out["output_ids"] == base_doc_q2["output_ids"]


def _abort_after(srv, input_ids: list[int], seconds: float) -> str:
    """Send a request and drop the connection after ``seconds`` (SGLang aborts it)."""
    req = urllib.request.Request(
        srv.base_url + "/generate",
        data=json.dumps(
            {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
        ).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        urllib.request.urlopen(req, timeout=seconds).read()
        return "completed"
    except (TimeoutError, urllib.error.URLError):
        return "aborted"


def test_slow_store_no_hit_not_delayed_and_abort(model_dir, tmp_path, tok):
    store = f"faulty+file://{tmp_path / 'store'}?latency_s=1.0"
    doc_ids = _ids(tok, DOC)
    short_ids = _ids(tok, "Name one colour.")
    assert len(short_ids) <= CHUNK  # no full chunk: never looked up, never parked
    # The store is artificially slow (1 s per call): pin the policy to "fetch" so this test exercises
    # waiting and abort rather than the fetch-vs-recompute choice.
    with remote_kv_server(model_dir, store, "--remote-kv-policy-margin", "1e9") as srv:
        generate(srv, doc_ids + _ids(tok, Q1))
        wait_written(srv, 0, len(doc_ids) // CHUNK, 120)
        flush_cache(srv)  # drop the local copy: the next hit must be remote

        done: dict[str, float] = {}

        def slow():
            out, dt = generate(srv, doc_ids + _ids(tok, Q2))
            done["hit"] = time.monotonic()
            done["hit_storage"] = storage_tokens(out)
            done["hit_s"] = dt

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.5)  # the hit request is now waiting for its lookup/fetch (>= 2 s)
        _, quick_s = generate(srv, short_ids, max_new_tokens=2)
        done["quick"] = time.monotonic()
        t.join(timeout=300)
        assert done["hit_storage"] == len(doc_ids) // CHUNK * CHUNK
        assert done["quick"] < done["hit"], (quick_s, done)
        assert quick_s < done["hit_s"]

        flush_cache(srv)
        before = metrics(srv).get('sglang:remote_kv_failures_total{kind="aborted_while_waiting"}', 0)
        assert _abort_after(srv, doc_ids + _ids(tok, " Summarise it."), 0.6) == "aborted"
        deadline = time.monotonic() + 30
        key = 'sglang:remote_kv_failures_total{kind="aborted_while_waiting"}'
        while metrics(srv).get(key, 0) <= before and time.monotonic() < deadline:
            time.sleep(0.3)
        assert metrics(srv).get(key, 0) == before + 1
        out, _ = generate(srv, short_ids, max_new_tokens=2)  # still serving
        assert out["meta_info"]["completion_tokens"] == 2
