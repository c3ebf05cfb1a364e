"""The offline ``sglang.Engine`` with the tier: ``sgl_remote_kv.configure(remote_kv="dpu", ...)`` (the
flags' destinations as keywords) before constructing the Engine; the CLI's validation and errors.

1. a bad option (``remote_kv="gpu"``, a bad chunk size, an unknown ``remote_kv_bogus``) is a
   ``ValueError`` naming the flag, and nothing is exported;
2. engine A computes a prompt cold and writes its chunks back to an embedded store;
3. engine B (a new process: nothing local) serves the prompt's whole usable prefix from the store,
   token-identical to A.

Each engine runs in its own Python process (an Engine owns scheduler subprocesses and process-wide
state), with the CPU platform plugin on, float32 and the lossless codec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sgl_remote_kv import env
from tests.fixtures.remote_kv_server import CHUNK

pytestmark = [pytest.mark.e2e]

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import sglang as sgl
    import sgl_remote_kv

    model, store, mode, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    cpu = dict(device="cpu", dtype="float32", max_total_tokens=4096, attention_backend="torch_native",
               cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled",
               enable_cache_report=True, log_level="warning")
    tier = dict(remote_kv="dpu", remote_kv_store=f"file://{store}", remote_kv_chunk_size=%(chunk)d,
                remote_kv_codec="lossless", remote_kv_policy_margin=1e9)
    sgl_remote_kv.configure(**tier)
    engine = sgl.Engine(model_path=model, **cpu)
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8})
    want = (len(ids) - 1) // %(chunk)d
    deadline = time.monotonic() + 60
    while mode == "write" and len(list(Path(store).rglob("*"))) < want and time.monotonic() < deadline:
        time.sleep(0.2)  # the write-back is asynchronous: wait until the chunks are in the store
    engine.shutdown()
    print(json.dumps({"output_ids": out["output_ids"], "cached": out["meta_info"]["cached_tokens"]}))
    """
) % {"chunk": CHUNK}


def _run(model_dir: str, store: str, mode: str, ids: list[int]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, store, mode, json.dumps(ids)],
        env=dict(os.environ, **{env.CPU_PLATFORM: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"remote_kv": "gpu"}, "--remote-kv"),
        ({"remote_kv": "dpu", "remote_kv_chunk_size": 100}, "--remote-kv-chunk-size"),
        ({"remote_kv_bogus": 1}, "remote_kv_bogus"),
        ({"remote_kv": "dpu", "remote_kv_flush": "all"}, "--remote-kv-flush"),
    ],
)
def test_configure_validates_like_the_cli(monkeypatch, options, named):
    import sgl_remote_kv

    monkeypatch.setenv(env.CONFIG_JSON, "")  # restored after the test, whatever configure exports
    with pytest.raises(ValueError, match=named):
        sgl_remote_kv.configure(**options)
    assert env.config_json() is None  # nothing exported


def test_configure_exports_the_config(monkeypatch):
    import sgl_remote_kv
    from sgl_remote_kv.config import RemoteKVConfig

    monkeypatch.setenv(env.CONFIG_JSON, "")  # restored after the test, whatever configure exports
    cfg = sgl_remote_kv.configure(remote_kv="dpu", remote_kv_store="file:///tmp/x", remote_kv_layerwise=True)
    assert RemoteKVConfig.current() == cfg and cfg.layerwise and cfg.mode == "dpu"


def test_engine_restart_hit(model_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.fixtures.faults import make_case

    store = str(tmp_path / "store")
    case = make_case(AutoTokenizer.from_pretrained(model_dir), "engine-api", n_chunks=3)
    a = _run(model_dir, store, "write", case.ids)
    assert a["cached"] == 0
    b = _run(model_dir, store, "read", case.ids)
    assert b["cached"] == case.chunks * CHUNK, "a fresh engine must fetch the stored prefix"
    assert b["output_ids"] == a["output_ids"]
