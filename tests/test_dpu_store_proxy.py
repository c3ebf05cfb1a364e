"""The data-plane service's store proxy (``--store-endpoint``) and the host's ``dpu+ipc://`` store URL:
a host that cannot reach the store looks up, writes back, reads and deletes through the service, under
the usual ``StoreClient`` (framing, tenant tags, misses on failure). A real service process, a real file
store; the service killed = misses with a reason, never an exception; hostile frames are dropped."""

from __future__ import annotations

import time

import pytest
import zmq
from dpu_service_helpers import Service

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.store.base import open_store
from sgl_remote_kv.store.client import ClientConfig, open_client


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [(tag + bytes([i])).ljust(32, b"\0") for i in range(n)]


@pytest.fixture
def proxied(tmp_path):
    """(service, proxy endpoint, the store's own URL): the service proxies a file store."""
    store_url = f"file://{tmp_path}/store"
    proxy_ep = f"ipc://{tmp_path}/store.sock"
    svc = Service(
        f"ipc://{tmp_path}/dpu.sock", store_url, tmp_path / "service.log", "--store-endpoint", proxy_ep
    )
    svc.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "store.sock").exists():
        assert time.monotonic() < deadline and svc.proc.poll() is None, (tmp_path / "service.log").read_text()
        time.sleep(0.05)
    yield svc, proxy_ep, store_url
    svc.kill()


def test_lookups_writes_reads_and_deletes_go_through_the_service(proxied):
    svc, ep, store_url = proxied
    host = open_client(f"dpu+{ep}", ClientConfig(timeout_s=5.0))
    keys = _keys(5)
    values = [bytes([i]) * (1000 + 700_000 * (i == 2)) for i in range(5)]  # one value above 512 KiB
    assert host.put_many(list(zip(keys[:4], values[:4], strict=True)), tenant_tag=b"T" * 8) == 4
    assert host.count_prefix(keys) == 4
    assert host.get_many(keys) == [*values[:4], None]
    # what the proxy stored is exactly what the host's client framed: the store's own client reads it
    direct = open_client(store_url)
    assert direct.get_many(keys[:4]) == values[:4]
    host.delete_many(keys[1:2])
    assert host.count_prefix(keys) == 1 and direct.count_prefix(keys) == 1
    assert host.stats().error_count == 0
    host.close()
    direct.close()


def test_a_dead_service_is_a_miss_with_a_reason(proxied, tmp_path):
    svc, ep, _ = proxied
    host = open_client(f"dpu+{ep}?timeout=1", ClientConfig(timeout_s=2.0, retries=0, breaker_failures=100))
    keys = _keys(2)
    assert host.put_many([(keys[0], b"x" * 100)]) == 1
    svc.kill()
    (tmp_path / "store.sock").unlink(missing_ok=True)
    got = host.lookup_prefix(keys)
    assert got.found == 0 and got.error == "unavailable"
    assert host.get_many(keys) == [None, None]
    assert host.put_many([(keys[1], b"y")]) == 0
    host.close()


def test_a_hung_service_times_out(tmp_path):
    """A socket that accepts but never answers: the call ends at its timeout as a miss."""
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    mute.bind(f"ipc://{tmp_path}/mute.sock")
    try:
        host = open_client(
            f"dpu+ipc://{tmp_path}/mute.sock?timeout=0.5", ClientConfig(timeout_s=5.0, retries=0)
        )
        t0 = time.monotonic()
        got = host.lookup_prefix(_keys(1))
        assert got.found == 0 and got.error == "timeout" and time.monotonic() - t0 < 4
        host.close()
    finally:
        mute.close(0)


def test_hostile_frames_are_dropped_and_the_proxy_keeps_serving(proxied):
    svc, ep, _ = proxied
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    s.send(b"garbage")  # not a protocol frame: dropped, no answer
    s.send_multipart([P.encode(P.Heartbeat(1, 0))])  # a control message on the store socket: dropped
    # put_many with a value count that does not match its keys: answered as a bad request
    s.send_multipart([P.encode(P.StoreRequest(7, "put_many", _keys(2))), b"only one value"])
    assert s.poll(5000)
    reply = P.decode(s.recv_multipart()[0])
    assert isinstance(reply, P.StoreReply) and reply.req == 7 and reply.error == "bad_request"
    s.send_multipart([P.encode(P.StoreRequest(8, "count_prefix", _keys(1)))])
    assert s.poll(5000)
    reply = P.decode(s.recv_multipart()[0])
    assert reply.req == 8 and reply.error == "" and reply.count == 0
    s.close(0)
    assert svc.proc.poll() is None


def test_bad_urls_and_endpoints_are_refused():
    with pytest.raises(ValueError, match="auth_key_file"):
        open_store("dpu+tcp://127.0.0.1:5999")
    with pytest.raises(ValueError, match="timeout"):
        open_store("dpu+ipc:///tmp/x.sock?timeout=soon")
    from sgl_remote_kv.dpu.store_proxy import StoreProxyConfig

    with pytest.raises(ValueError, match="auth-key-file"):
        StoreProxyConfig("tcp://127.0.0.1:5999", "file:///tmp/s")
