"""ShadowServe's topology on one machine with a real multi-rank server (issue 17 item 2): the store (a real
redis-server) and the data-plane service run in their own network namespace, the service pinned to its
own core; a ``--tp 3`` SGLang server (SmolLM2-135M's 3 KV heads do not split over 2 ranks: 3 is its
smallest multi-rank layout) runs in the root namespace, which has no route to the store. Every rank
attaches to the service through its ``ipc://`` socket (a file: visible across network namespaces), its KV
arrives through the shared ``/dev/shm`` region, and the server's own store calls (lookups, write-backs)
go through the service's store proxy (``--remote-kv-store dpu+ipc://``). Float32 + ``lossless``:

1. the server's namespace cannot reach the store (neither the store's loopback address nor the
   namespace's veth address answer);
2. cold: every rank writes its shard back through the proxy; after a flush, a remote hit on every rank,
   token-identical to the cold answer, and no rank spawned a data plane of its own;
3. the service hung (SIGSTOP): a miss, recomputed, same tokens; resumed (SIGCONT): hits again;
4. the store down: a miss, recomputed, same tokens.

The service killed outright is ``tests/test_tp_service_server.py``. Slow (~2 min: three ranks share two
cores). Needs root (``ip netns``) and ``redis-server``; skipped where namespaces cannot be created.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_tp_server import BIND, DOC_A, QUESTION, TP, _ids, _rank_keys

from benchmarks.netshape import netns_supported, shaped_link
from benchmarks.redis_server import RedisServer, free_port, ping, require_redis
from tests.fixtures.faults import data_plane_procs
from tests.fixtures.remote_kv_server import CHUNK, flush_cache, generate, remote_kv_server, storage_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE_CORE = "1"


def _wait_stored(store, keys_by_rank: list[list[bytes]], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        have = [store.count_prefix(k) for k in keys_by_rank]
        if all(h == len(k) for h, k in zip(have, keys_by_rank, strict=True)):
            return
        assert time.monotonic() < deadline, (
            f"write-back incomplete: {have} of {[len(k) for k in keys_by_rank]}"
        )
        time.sleep(1.0)


def test_tp3_server_reaches_the_store_only_through_a_service_in_its_own_namespace(model_dir, tmp_path):
    require_redis()
    ok, why = netns_supported()
    if not ok:
        pytest.skip(f"cannot create network namespaces here: {why}")
    from sgl_remote_kv.store.client import ClientConfig, open_client

    ids = _ids(model_dir, DOC_A + QUESTION)
    usable = (len(ids) - 1) // CHUNK
    ep, store_ep = f"ipc://{tmp_path}/dpu.sock", f"ipc://{tmp_path}/store.sock"
    with shaped_link(None) as link:  # a namespace with its loopback up (and a veth nobody listens on)
        redis = RedisServer(tmp_path / "redis", free_port(), netns=link.netns).start()
        log = open(tmp_path / "service.log", "ab")
        cmd = [
            "ip",
            "netns",
            "exec",
            link.netns,
            sys.executable,
            "-m",
            "sgl_remote_kv.dpu",
            "--endpoint",
            ep,
            "--store",
            redis.url,
            "--store-endpoint",
            store_ep,
            "--cpus",
            SERVICE_CORE,
            "--log-level",
            "INFO",
        ]
        svc = subprocess.Popen(cmd, stdout=log, stderr=log)
        try:
            # 1. this namespace (the server's) has no route to the store
            assert not ping("127.0.0.1", redis.port) and not ping(link.ns_addr, redis.port)
            proxy = open_client(f"dpu+{store_ep}", ClientConfig(timeout_s=5.0, retries=2))
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
                # 2. cold, write-back through the proxy, a full remote hit on every rank
                assert data_plane_procs(srv.proc.pid) == []
                cold, _ = generate(srv, ids, 12)
                assert storage_tokens(cold) == 0
                _wait_stored(proxy, [_rank_keys(model_dir, ids, r) for r in range(TP)])
                flush_cache(srv)
                hit, _ = generate(srv, ids, 12)
                assert storage_tokens(hit) == usable * CHUNK, hit["meta_info"]
                assert hit["output_ids"] == cold["output_ids"], (
                    "remote KV at TP=3 (lossless, fp32) must be exact"
                )
                # 3. the service hung: a miss; resumed: hits again
                os.kill(svc.pid, signal.SIGSTOP)
                try:
                    flush_cache(srv)
                    hung, _ = generate(srv, ids, 12)
                finally:
                    os.kill(svc.pid, signal.SIGCONT)
                assert storage_tokens(hung) == 0, "a hung service: a miss on every rank"
                assert hung["output_ids"] == cold["output_ids"]
                again = None
                for _ in range(6):  # the clients reconnect after a heartbeat timeout
                    flush_cache(srv)
                    again, _ = generate(srv, ids, 12)
                    if storage_tokens(again) == usable * CHUNK:
                        break
                    time.sleep(2.0)
                assert storage_tokens(again) == usable * CHUNK, "hits again once the service resumed"
                assert again["output_ids"] == cold["output_ids"]
                # 4. the store down: a miss, same tokens
                redis.stop(kill=True)
                flush_cache(srv)
                down, _ = generate(srv, ids, 12)
                assert storage_tokens(down) == 0
                assert down["output_ids"] == cold["output_ids"]
                assert svc.poll() is None, "the service outlives its store"
        finally:
            if svc.poll() is None:
                svc.kill()
            svc.wait()
            redis.stop(kill=True)
            log.close()
