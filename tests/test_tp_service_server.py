"""ShadowServe's topology with a real multi-rank server: a ``--tp 3`` SGLang server (SmolLM2-135M has 3 KV
heads: its smallest multi-rank layout) attaches all three ranks to one data-plane service and reaches the
store only through the service's store proxy (``--remote-kv-store dpu+ipc://``). Float32 + ``lossless``:

1. cold: every rank writes its own shard back through the service (all 3 x chunks keys land in the store);
2. after a flush: the whole prefix is a remote hit on every rank, token-identical to the cold answer, and
   the server spawned no data plane of its own;
3. the service killed: a consistent miss on every rank (``storage`` = 0), recomputed, same tokens.

Slow (~5-7 min on the 2-core box: three ranks share two cores)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_tp_server import BIND, DOC_A, QUESTION, TP, _ids, _rank_keys, _wait_stored

from tests.fixtures.faults import data_plane_procs
from tests.fixtures.remote_kv_server import CHUNK, flush_cache, generate, remote_kv_server, storage_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_tp3_server_attached_to_one_service_with_the_store_only_through_it(model_dir, tmp_path):
    store_dir = tmp_path / "store"
    ep, store_ep = f"ipc://{tmp_path}/dpu.sock", f"ipc://{tmp_path}/store.sock"
    log = open(tmp_path / "service.log", "ab")
    cmd = [
        sys.executable,
        "-m",
        "sgl_remote_kv.dpu",
        "--endpoint",
        ep,
        "--store",
        f"file://{store_dir}",
        "--store-endpoint",
        store_ep,
        "--log-level",
        "INFO",
    ]
    svc = subprocess.Popen(cmd, stdout=log, stderr=log)
    ids = _ids(model_dir, DOC_A + QUESTION)
    usable = (len(ids) - 1) // CHUNK
    try:
        with remote_kv_server(
            model_dir,
            f"dpu+{store_ep}",
            "--tp",
            str(TP),
            "--remote-kv-policy-margin",
            "1e9",
            "--remote-kv-dpu-endpoint",
            ep,
            env={"SGLANG_CPU_OMP_THREADS_BIND": BIND},
            max_total_tokens=4096,
        ) as srv:
            assert data_plane_procs(srv.proc.pid) == []  # every rank attached, none spawned its own
            cold, _ = generate(srv, ids, 12)
            assert storage_tokens(cold) == 0
            _wait_stored(
                store_dir, [_rank_keys(model_dir, ids, r) for r in range(TP)]
            )  # 3 shards, via the proxy
            flush_cache(srv)
            hit, _ = generate(srv, ids, 12)
            assert storage_tokens(hit) == usable * CHUNK, hit["meta_info"]
            assert hit["output_ids"] == cold["output_ids"], "remote KV at TP=3 (lossless, fp32) must be exact"
            svc.kill()
            svc.wait()
            flush_cache(srv)
            miss, _ = generate(srv, ids, 12)
            assert storage_tokens(miss) == 0, "the service gone: a miss on every rank"
            assert miss["output_ids"] == cold["output_ids"]
    finally:
        if svc.poll() is None:
            svc.kill()
        svc.wait()
        log.close()
