"""End to end, the tier through SGLang's public ``UnifiedCacheLinker`` API (``sglang_glue/linker.py``) on a
real CPU server with the real model.

A server writes a prompt back (checkpoint write-back); after a restart (empty local cache) the
waiting_for_KV queue fetches and stages the chunks, SGLang's ``lookup`` reports them, ``load`` copies them
layer by layer, and SGLang reports the tokens as ``storage`` hits (the queue marks them). Tokens equal the cold run (lossless codec,
float32). Both fetch paths that write into a destination: the in-process decode and the DPU data plane.
"""

from __future__ import annotations

import pytest

from tests.fixtures.faults import wait_written
from tests.fixtures.remote_kv_server import CHUNK, generate, metrics, remote_kv_server, storage_tokens, total

pytestmark = [pytest.mark.e2e]


def _prompt(model_dir, words: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    body = " ".join(f"Clause {i}: the linker loads staged page {i} {words}." for i in range(24))
    return tok(body + "\nQuestion: which clause comes last?", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "mode",
    [
        # ~1.5 min each. In the default suite: in-process remote hits through the linker in
        # test_sglang_own_linker_flags_naming_our_linker_run_the_tier (after a flush); the DPU path's
        # across a restart, with this test's assertions (linker log line, no
        # ``device`` tokens, one decision, no failure, the cold run's tokens), in
        # test_installed_wheel_server.py::test_installed_wheel_serves_remote_hits_across_a_restart
        pytest.param("inproc", marks=pytest.mark.slow),
        pytest.param("dpu", marks=pytest.mark.slow),
    ],
)
def test_linker_restart_hit_is_token_identical(model_dir, tmp_path, mode):
    prompt = _prompt(model_dir, "into the slots SGLang allocated")
    need = (len(prompt) - 1) // CHUNK
    store = f"file://{tmp_path / 'store'}"
    with remote_kv_server(model_dir, store, mode=mode) as s1:
        cold = generate(s1, prompt, 8)[0]
        wait_written(s1, 0, need, 120)
        assert "remote KV tier through the linker API" in s1.log_text()
    with remote_kv_server(model_dir, store, mode=mode) as s2:
        out = generate(s2, prompt, 8)[0]
        m = metrics(s2)
        log = s2.log_text()
    # the queue inserts nothing into the tree: a cached prefix came through the linker's load (SGLang splits it by our ``storage_hit_*`` marks: storage, not host)
    assert "remote KV tier through the linker API" in log
    details = out["meta_info"]["cached_tokens_details"]
    assert storage_tokens(out) == need * CHUNK and details["device"] == 0, details
    assert out["output_ids"] == cold["output_ids"]
    assert m.get(f'sglang:remote_kv_decisions_total{{path="{mode}"}}', 0) == 1, m
    assert total(m, "failures") == 0, m


def test_sglang_own_linker_flags_naming_our_linker_run_the_tier(model_dir, tmp_path):
    """The other way in: SGLang's three linker flags naming ``RemoteKVLinker`` (besides ``--remote-kv``,
    which would set them itself). One server: cold, written back, ``/flush_cache`` (drops only the local
    cache), the same prompt again is a remote hit through the linker, token-identical."""
    import json

    from tests.fixtures.remote_kv_server import flush_cache

    prompt = _prompt(model_dir, "named on SGLang's own command line")
    need = (len(prompt) - 1) // CHUNK
    flags = (
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps({"linker": "RemoteKVLinker", "linker_module_path": "sgl_remote_kv.sglang_glue.linker"}),
    )
    with remote_kv_server(model_dir, f"file://{tmp_path / 'store'}", *flags, mode="inproc") as s:
        cold = generate(s, prompt, 8)[0]
        wait_written(s, 0, need, 120)
        flush_cache(s)
        out = generate(s, prompt, 8)[0]
        log = s.log_text()
    assert "remote KV tier through the linker API" in log
    details = out["meta_info"]["cached_tokens_details"]
    assert storage_tokens(out) == need * CHUNK and details["device"] == 0, details
    assert out["output_ids"] == cold["output_ids"]
