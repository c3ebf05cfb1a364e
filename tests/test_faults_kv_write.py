"""A failed write into the KV pool is a failed chunk, never a hit: real CPU servers (real SmolLM2 float32,
lossless codecs) whose every ``KVWriter.write`` raises (``tests/fixtures/kv_write_fault``), one per fetch
path. A prompt primed by a cold recompute (written back: reads are not faulted) is asked again after the
local cache is flushed: the remote fetch succeeds, its write into the pool fails, the request recomputes
and its tokens equal the cold answer; ``failures{kind="write"}`` counts it and no token is reported as a
storage hit. The server stays healthy, and its normal stop is not logged as a crash.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.faults import ask, healthy, make_case, metric, prime, wait_for
from tests.fixtures.remote_kv_server import remote_kv_server

pytestmark = pytest.mark.e2e
FAULT_DIR = str(Path(__file__).resolve().parent / "fixtures" / "kv_write_fault")


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize(
    "mode,codec",
    [
        pytest.param("dpu", "lossless", id="dpu"),
        # ~45 s each, slow set only: after the write's KVWriteError the linker's load fails the chunks the
        # same way for every path (shown here on dpu); the in-process install raising it:
        # tests/test_inproc_device_decode.py::test_a_failing_device_is_a_write_error_for_the_install; the
        # NVDEC path's install calls the same writer as the in-process one
        pytest.param("inproc", "lossless", id="inproc", marks=pytest.mark.slow),
        pytest.param("nvdec", "hevc", id="nvdec", marks=pytest.mark.slow),
    ],
)
def test_failed_pool_write_is_a_miss_and_recompute(model_dir, tmp_path, tok, mode, codec):
    env = {
        "SRKV_TEST_FAULT_KV_WRITE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (FAULT_DIR, os.environ.get("PYTHONPATH")) if p),
    }
    url = f"file://{tmp_path}/store"
    with remote_kv_server(
        model_dir, url, "--remote-kv-policy-margin", "1e9", codec=codec, mode=mode, env=env
    ) as srv:
        case = prime(srv, make_case(tok, f"write-fault-{mode}"))
        assert metric(srv, "failures", kind="write") == 0
        out, hit = ask(srv, case)  # tokens checked against the cold recompute inside
        assert hit == 0, f"{mode}: a failed pool write was served as a {hit}-token hit"
        wait_for(lambda: metric(srv, "failures", kind="write") >= 1, 30, what="failures{kind=write}")
        assert metric(srv, "decisions", path=mode) >= 1  # the fetch ran on this path
        assert healthy(srv)
        assert "injected KV write fault" in srv.log_text()
    # a normal stop is not logged as a crash by SGLang's subprocess watchdog
    assert "crashed" not in srv.log_text(), srv.log_tail(20)
