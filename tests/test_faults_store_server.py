"""Store-side faults that need their own server (slow: one server start each, ~2-3 min on the box).

- embedded store (``file://``) on a small tmpfs: disk full (write-backs fail, reads still serve),
  read-only remount (same), then recovery once space / write access is back;
- Redis Cluster: one master SIGKILLed mid-run (its shard's chunks become misses), then restarted with
  its nodes.conf (empty) and the tier refills.

Same contract as ``test_faults_server.py``: exact tokens vs. cold recompute, server healthy, failure
counted, full remote hits once the fault clears.
"""

from __future__ import annotations

import contextlib
import subprocess

import pytest

from sgl_remote_kv.store.redis_server import RedisCluster
from tests.fixtures.faults import (
    CHUNK,
    ask,
    failures,
    gen,
    healthy,
    make_case,
    metric,
    prime,
    wait_for,
    wait_full_hit,
)
from tests.fixtures.remote_kv_server import flush_cache, remote_kv_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@contextlib.contextmanager
def tmpfs(path, size_mb: int):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path) -> None:
    """Fill the filesystem to the last byte (dd stops at ENOSPC)."""
    subprocess.run(["dd", "if=/dev/zero", f"of={path / 'filler'}", "bs=1M"], capture_output=True, check=False)


def _remount(path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def test_embedded_store_disk_full_and_read_only(model_dir, tmp_path, tok):
    with tmpfs(tmp_path / "mnt", 96) as mnt, remote_kv_server(model_dir, f"file://{mnt / 'store'}") as srv:
        served = prime(srv, make_case(tok, "embedded-served"))

        _fill(mnt)  # disk full
        before = failures(srv)
        full = make_case(tok, "embedded-full")
        flush_cache(srv)
        full.ref = gen(srv, full.ids)["output_ids"]
        wait_for(lambda: failures(srv) > before, 60, what="write-back failure on a full disk")
        _, hit = ask(srv, served)  # what is stored keeps being served
        assert hit == served.chunks * CHUNK
        (mnt / "filler").unlink()
        assert wait_full_hit(srv, full, timeout=120) == full.chunks * CHUNK

        _remount(mnt, "ro")  # read-only
        try:
            before = failures(srv)
            ro = make_case(tok, "embedded-ro")
            flush_cache(srv)
            ro.ref = gen(srv, ro.ids)["output_ids"]
            wait_for(lambda: failures(srv) > before, 60, what="write-back failure on a read-only store")
            _, hit = ask(srv, served)
            assert hit == served.chunks * CHUNK
        finally:
            _remount(mnt, "rw")
        assert wait_full_hit(srv, ro, timeout=120) == ro.chunks * CHUNK
        assert metric(srv, "failures", kind="writeback:store") > 0
        assert healthy(srv)


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
