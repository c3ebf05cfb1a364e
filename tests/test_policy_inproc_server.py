"""End to end, ``--remote-kv inproc`` (the in-process decode baseline): a real CPU SGLang server with
the real model and the embedded store writes a prompt back, and after a restart (empty local cache)
serves its whole usable prefix from the remote tier through the in-process path only
(``decisions{path="inproc"}``; no data plane process is started)."""

from __future__ import annotations

import time

import pytest

from tests.fixtures.remote_kv_server import CHUNK, generate, metrics, remote_kv_server, storage_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_inproc_mode_serves_remote_hits_in_process(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    body = " ".join(f"Line {i}: the in-process baseline decodes chunk {i} itself." for i in range(20))
    prompt = tok(body + "\nSummary:", add_special_tokens=False)["input_ids"]
    need = (len(prompt) - 1) // CHUNK
    store = f"file://{tmp_path / 'store'}"
    with remote_kv_server(model_dir, store, mode="inproc") as s1:
        ref = generate(s1, prompt, 8)[0]["output_ids"]
        deadline = time.monotonic() + 120
        while metrics(s1).get("sglang:remote_kv_written_chunks_total", 0) < need:
            assert time.monotonic() < deadline, "write-back did not finish"
            time.sleep(0.5)
    with remote_kv_server(model_dir, store, mode="inproc") as s2:
        out = generate(s2, prompt, 8)[0]
        m = metrics(s2)
        log = s2.log_text()
    assert storage_tokens(out) == need * CHUNK
    assert m.get('sglang:remote_kv_decisions_total{path="inproc"}', 0) == 1, m
    assert "DPU data plane started" not in log
    assert out["output_ids"] == ref  # lossless codec, float32: token-identical
