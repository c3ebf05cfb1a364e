"""A Redis Cluster master SIGKILLed mid-run against a real server (slow: its own server start): the
chunks on the dead shard become misses (exact tokens, server up), and once the node is restarted with
its nodes.conf (its data gone) the tier refills and serves full remote hits again."""

from __future__ import annotations

import pytest

from benchmarks.redis_server import RedisCluster
from tests.fixtures.faults import CHUNK, ask, healthy, make_case, prime, wait_full_hit
from tests.fixtures.remote_kv_server import remote_kv_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_redis_cluster_node_killed_mid_run(model_dir, tmp_path, tok):
    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        with remote_kv_server(model_dir, cluster.url + "?timeout=1") as srv:
            cases = [prime(srv, make_case(tok, f"cluster-{i}", n_chunks=4)) for i in range(2)]
            victim = cluster.nodes[1]
            victim.stop(kill=True)
            hits = [ask(srv, case)[1] for case in cases]  # tokens checked inside ask
            # 8 chunks over 3 shards: some chunk of a case sits on the dead one (a batch touching it
            # fails whole, and the breaker opens), so not everything can still be a hit.
            assert any(h < c.chunks * CHUNK for h, c in zip(hits, cases, strict=True)), hits
            assert healthy(srv)
            victim.start()  # rejoins with its nodes.conf (same id and slots); its data is gone
            cluster.wait_ok()
            for case in cases:
                assert wait_full_hit(srv, case, timeout=120) == case.chunks * CHUNK
    finally:
        cluster.stop()
