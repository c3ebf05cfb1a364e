"""The ShadowServe topology on one machine, in small: the data-plane service is the only process that can
reach the store. Redis and the service run in this (root) network namespace, the service pinned to its
own core; the host clients (two ``DpuClient``s standing in for the two ranks of a ``--tp 2`` server)
run in a fresh network namespace (``unshare --net``: only a loopback that is down), where the store is
unreachable. They reach the service through its ``ipc://`` socket (a file: visible across network
namespaces) and get their KV through the shared ``/dev/shm`` region; the host's own store calls (lookups,
a write-back) go through the service's store proxy (``dpu+ipc://``). Remote hits are token-identical
(float32 + ``lossless``); the store going down, and the service hanging, end fetches as misses.

Needs ``unshare --net`` (root or user namespaces) and ``redis-server``; skipped without ``unshare``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dpu_helpers import CHUNK, codecs, put_chunks
from dpu_service_helpers import LAYOUT32, Service, random_kv, rank_fp, slots_flags

pytest_plugins = ["fixtures.redis_servers"]

_CLIENTS = r"""
import sys, time
sys.path.insert(0, {tests!r})
import numpy as np, redis
from dpu_helpers import CHUNK, codecs, make_pool, pool_tokens
from dpu_service_helpers import LAYOUT32, random_kv, rank_fp
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

def say(*a):
    print(*a, flush=True)

try:  # this namespace cannot reach the store
    redis.Redis(host="127.0.0.1", port={port}, socket_connect_timeout=1).ping()
    say("STORE_REACHABLE")
except redis.exceptions.ConnectionError:
    say("STORE_UNREACHABLE")
keys = {keys!r}
data = {{r: random_kv(4, seed=50 + r) for r in (0, 1)}}
clients = {{}}
for r in (0, 1):
    cfg = DpuClientConfig("unused://", dest_slot_bytes=4 * {cb}, endpoint={ep!r}, heartbeat_s=0.2,
                          heartbeat_timeout_s=1.5, start_timeout_s=30)
    clients[r] = DpuClient(cfg, rank_fp(r), codecs()["lossless"])
    clients[r].start()
say("PIDS", clients[0].pid, clients[1].pid)

# the host's store calls (lookups, write-backs) go through the service's store proxy
from sgl_remote_kv.store.client import ClientConfig, open_client
store = open_client({store_ep!r}, ClientConfig(timeout_s=2.0, retries=0))
mine = [bytes([9, i]).ljust(32, b"x") for i in range(2)]
wrote = store.put_many([(k, b"written back from the namespace") for k in mine])
found = [store.count_prefix([bytes.fromhex(k) for k in keys[r]]) for r in (0, 1)]
say("PROXY", wrote, *found, store.count_prefix(mine))

def fetch_both(tag):
    targets = {{r: make_pool(LAYOUT32, 512, 4 * CHUNK, seed=r) for r in (0, 1)}}
    hs = {{r: clients[r].submit(tag, [bytes.fromhex(k) for k in keys[r]], CHUNK, targets[r]) for r in (0, 1)}}
    out = []
    for r in (0, 1):
        res = hs[r].wait(timeout=30)
        exact = all(
            np.array_equal(pool_tokens(targets[r], LAYOUT32, i * CHUNK, (i + 1) * CHUNK)[j], data[r][i][j])
            for i in range(res.hit_chunks) for j in (0, 1)
        )
        out.append(f"{{res.hit_chunks}}:{{','.join(sorted(set(res.failures.values())))}}:{{exact}}")
    say(tag.upper(), *out)

fetch_both("hits")
for step in ("store_down", "hung"):
    sys.stdin.readline()  # the test changed the world
    fetch_both(step)
    if step == "store_down":
        got = store.lookup_prefix(mine)
        say("PROXY_DOWN", got.found, got.error)
store.close()
for c in clients.values():
    c.close()
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_only_the_service_reaches_the_store(own_redis_server, tmp_path):
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --net is not permitted here")
    url = own_redis_server.url
    keys = {
        r: put_chunks(url, codecs()["lossless"], random_kv(4, seed=50 + r), rank_fp(r), prefix=b"n%d" % r)[0]
        for r in (0, 1)
    }
    own_core = max(os.sched_getaffinity(0))
    store_ep = f"ipc://{tmp_path}/store.sock"
    svc = Service(
        f"ipc://{tmp_path}/dpu.sock",
        url,
        tmp_path / "service.log",
        *slots_flags(),
        "--cpus",
        str(own_core),
        "--store-timeout",
        "0.5",
        "--store-endpoint",
        store_ep,
    ).start()
    from sgl_remote_kv.contract.sizing import chunk_bytes

    script = _CLIENTS.format(
        tests=str(Path(__file__).parent),
        port=own_redis_server.port,
        ep=svc.endpoint,
        store_ep=f"dpu+{store_ep}",
        keys={r: [k.hex() for k in keys[r]] for r in (0, 1)},
        cb=chunk_bytes(LAYOUT32, CHUNK),
    )
    host = subprocess.Popen(
        ["unshare", "--net", sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "clients.log", "wb"),
        text=True,
    )
    try:
        assert host.stdout.readline().strip() == "STORE_UNREACHABLE"
        assert host.stdout.readline().split()[1:] == [str(svc.proc.pid)] * 2  # both ranks: one service
        assert sorted(os.sched_getaffinity(svc.proc.pid)) == [own_core]
        # lookups and a write-back through the service: both ranks' 4 chunks found, the 2 new values stored
        assert host.stdout.readline().split() == ["PROXY", "2", "4", "4", "2"]
        # remote hits, token-identical, for both ranks
        assert host.stdout.readline().split() == ["HITS", "4::True", "4::True"]
        own_redis_server.stop()  # the store goes down: misses with the store client's error kind
        host.stdin.write("go\n")
        host.stdin.flush()
        line = host.stdout.readline().split()
        assert line[0] == "STORE_DOWN" and all(x.startswith("0:") and "store_" in x for x in line[1:]), line
        line = host.stdout.readline().split()  # a lookup through the proxy: a miss with the store's reason
        assert line[:2] == ["PROXY_DOWN", "0"] and line[2] in ("unavailable", "timeout"), line
        os.kill(svc.proc.pid, signal.SIGSTOP)  # the service hangs: misses after the heartbeat timeout
        host.stdin.write("go\n")
        host.stdin.flush()
        assert host.stdout.readline().split() == ["HUNG", "0:dataplane_lost:True", "0:dataplane_lost:True"]
        os.kill(svc.proc.pid, signal.SIGCONT)
        host.stdin.close()
        assert host.wait(timeout=30) == 0
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        if svc.proc.poll() is None:
            os.kill(svc.proc.pid, signal.SIGCONT)
        svc.kill()
