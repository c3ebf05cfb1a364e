"""The shaped-link helper used by the store and e2e benchmarks: a real redis-server in a network
namespace, fetched through a tbf-shaped veth; everything it creates is gone afterwards."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from benchmarks.netshape import netns_supported, shaped_link
from benchmarks.redis_server import RedisServer, require_redis
from sgl_remote_kv.store.redis_store import RedisStore


def _srkv_leftovers() -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [
        line
        for line in (ns + links).splitlines()
        if f"srkv-{os.getpid() % 10000:04d}" in line or f"srkvh{os.getpid() % 10000:04d}" in line
    ]


def test_fetch_through_shaped_link_is_near_the_wire_floor(tmp_path) -> None:
    require_redis()
    ok, reason = netns_supported()
    if not ok:
        pytest.skip(f"network namespaces not permitted here: {reason}")
    blob = os.urandom(2 * 1024 * 1024)
    with shaped_link(100.0) as link:
        server = RedisServer(tmp_path / "r", 6379, host=link.ns_addr, netns=link.netns).start()
        try:
            store = RedisStore(link.ns_addr, 6379, timeout_s=10)
            key = os.urandom(32)
            store.put_many([(key, blob)])
            t0 = time.perf_counter()
            assert store.get_many([key]) == [blob]
            elapsed = time.perf_counter() - t0
            store.close()
        finally:
            server.stop()
        assert "tbf" in link.qdisc()
    floor = len(blob) * 8 / 100e6
    assert 0.9 * floor < elapsed < 4 * floor
    assert _srkv_leftovers() == []
