"""What ``/flush_cache`` means with the tier on: the deliberate difference from SGLang's
prefix-cache-branching kit (docs/CONFORMANCE.md), and the option that restores "a flush makes the next
request miss".

1. A server with ``--remote-kv-flush tier``: every flush writes a new store generation, so after it a
   prompt whose chunks were stored misses (no ``storage`` tokens) and recomputes the same tokens; its
   chunks are stored again under the new generation.
2. A second server with the default (``local``) over the same store reads that generation when it
   starts: the prompt is a full remote hit on its first request, and still after a (local) flush.
3. A server already running when another one flushes with ``tier`` scope follows the new generation.
"""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from sgl_remote_kv.store import generation
from tests.fixtures.faults import ask, gen, make_case, metric, prime, wait_for, wait_written
from tests.fixtures.remote_kv_server import CHUNK, flush_cache, remote_kv_server, storage_tokens

pytestmark = [pytest.mark.e2e]


# make test-slow (default run kept near 30 min): ~120 s
@pytest.mark.slow
def test_flush_scope_tier_then_local(model_dir, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    case = make_case(AutoTokenizer.from_pretrained(model_dir), "flush-scope", n_chunks=3)
    margin = ("--remote-kv-policy-margin", "1e9")
    with remote_kv_server(model_dir, store, "--remote-kv-flush", "tier", *margin) as srv:
        prime(srv, case)  # cold; its chunks land in the store (generation after prime's first flush)
        before = metric(srv, "written_chunks")
        out, hit = ask(srv, case)  # flush (tier scope: a new generation), then ask: tokens checked
        assert hit == 0, f"after a tier flush the prompt must miss, got {hit} storage tokens"
        assert out["meta_info"]["cached_tokens"] == 0
        wait_written(srv, before, case.chunks)  # stored again, under the new generation
        assert "remote tier retired" in srv.log_text()
    with remote_kv_server(model_dir, store, *margin) as srv:  # default scope: local
        out = gen(srv, case.ids)
        assert out["output_ids"] == case.ref
        assert storage_tokens(out) == case.chunks * CHUNK, "a new server must read the current generation"
        flush_cache(srv)
        out = gen(srv, case.ids)
        assert out["output_ids"] == case.ref
        assert storage_tokens(out) == case.chunks * CHUNK, "a local flush keeps the remote tier"


@pytest.mark.slow  # two servers at once and a 10 s poll interval (~80 s); the logic: tests/test_generation_watch.py
def test_a_running_server_follows_another_servers_tier_flush(model_dir, tmp_path):
    """3. A server that is already running when another one flushes with ``tier`` scope stops serving the
    retired chunks within ``generation.POLL_S`` of activity: the stored prompt then misses, same tokens."""
    store = f"file://{tmp_path / 'store'}"
    tok = AutoTokenizer.from_pretrained(model_dir)
    case, other = make_case(tok, "follow", n_chunks=3), make_case(tok, "follow-other", n_chunks=1)
    margin = ("--remote-kv-policy-margin", "1e9")
    with remote_kv_server(model_dir, store, *margin) as b:
        prime(b, case)
        _, hit = ask(b, case)
        assert hit == case.chunks * CHUNK  # served from the tier before the other server's flush
        with remote_kv_server(model_dir, store, "--remote-kv-flush", "tier", *margin) as a:
            flush_cache(a)
        time.sleep(generation.POLL_S + 0.5)
        gen(b, other.ids)  # scheduler passes: the watch reads the new generation and applies it
        wait_for(lambda: "store generation changed" in b.log_text(), 30, what="the generation change")
        _, hit = ask(b, case)
        assert hit == 0, f"the retired chunks must not be served, got {hit} storage tokens"
