"""A real ``--remote-kv dpu`` server: values corrupted in the store are classified as ``corrupt`` by the
data plane (not as a miss), counted as store errors, repaired by the recompute's write-back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.faults import ask, make_case, metric, prime, wait_full_hit
from tests.fixtures.remote_kv_server import CHUNK, remote_kv_server

pytestmark = pytest.mark.e2e


def test_dpu_framing_corruption_is_corrupt_counted_and_repaired(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    root = tmp_path / "store"
    with remote_kv_server(model_dir, f"file://{root}", "--remote-kv-policy-margin", "1e9") as srv:
        case = prime(srv, make_case(tok, "dpu-bitflip"))
        objects = sorted(p for p in Path(root, "objects").rglob("*") if p.is_file())
        assert len(objects) >= case.chunks, objects
        for p in objects:  # a raw bit flip in every stored value: the framing CRC fails
            raw = bytearray(p.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            p.write_bytes(bytes(raw))
        corrupt, miss = metric(srv, "failures", kind="corrupt"), metric(srv, "failures", kind="miss")
        store_corrupt = metric(srv, "store_errors", op="get", kind="corrupt")
        repairs = metric(srv, "failures", kind="repair_undecodable")
        _, hit = ask(srv, case)  # tokens equal the recompute's
        assert hit == 0
        assert metric(srv, "failures", kind="corrupt") == corrupt + 1
        assert metric(srv, "failures", kind="miss") == miss
        # >= 1: with two fetch workers the data plane may read (and delete) chunk 1 before the cancel
        assert metric(srv, "store_errors", op="get", kind="corrupt") >= store_corrupt + 1
        assert metric(srv, "failures", kind="repair_undecodable") == repairs + 1
        # the data plane's client deleted chunk 0, the waiting queue too; each recompute rewrites the
        # chunks it could not use, so the prefix heals chunk by chunk
        assert wait_full_hit(srv, case, timeout=150) == case.chunks * CHUNK
