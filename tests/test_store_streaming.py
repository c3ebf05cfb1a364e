"""``StoreClient.stream_get`` against a real redis-server: a value read in pieces is handed out as it
arrives and counts only once its frame verified; every failure is an outcome, never an exception."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis

from sgl_remote_kv.store.client import ClientConfig, open_client
from sgl_remote_kv.store.framing import FrameError, FrameReader, frame
from sgl_remote_kv.store.local import LocalStore
from sgl_remote_kv.store.redis_store import redis_key
from sgl_remote_kv.store.streaming import StreamOutcome

pytest_plugins = ["fixtures.redis_servers"]


def _key() -> bytes:
    return os.urandom(32)


def _drain(s) -> bytes:
    return b"".join(bytes(p) for p in s.pieces())


@pytest.mark.parametrize("piece", [7, 1000, 65536, 1 << 22])
def test_a_value_arrives_in_pieces_and_verifies(redis_server, piece):
    c = open_client(redis_server.url)
    k, v = _key(), os.urandom(300_000)
    assert c.put_many([(k, v)]) == 1
    s = c.stream_get(k, max_bytes=1 << 20, piece_bytes=piece)
    sizes = [len(p) for p in s.pieces()]
    assert s.outcome is StreamOutcome.OK and s.payload_len == len(v) == sum(sizes)
    assert max(sizes) <= piece and (piece >= len(v) or len(sizes) > 1)
    s2 = c.stream_get(k, 1 << 20, piece)
    assert _drain(s2) == v and s2.outcome is StreamOutcome.OK
    st = c.stats()
    assert st.hits == 2 and st.bytes_read == 2 * len(v)
    c.close()


def test_an_absent_value_is_absent_then_negatively_cached(redis_server):
    c = open_client(redis_server.url)
    k = _key()
    s = c.stream_get(k, 1 << 20, 4096)
    assert _drain(s) == b"" and s.outcome is StreamOutcome.ABSENT
    assert c.stream_get(k, 1 << 20, 4096) is None  # the negative cache answers; get_many does it
    assert c.get_many([k]) == [None]
    c.close()


def test_a_value_of_another_key_a_longer_or_shorter_value_are_corrupt_and_deleted(redis_server):
    c = open_client(redis_server.url)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    v = os.urandom(50_000)
    cases = {}
    k_other = _key()
    raw.set(redis_key(k_other), frame(_key(), v))  # framed for another key
    cases[k_other] = "checksum"
    k_long = _key()
    raw.set(redis_key(k_long), frame(k_long, v) + b"x")
    cases[k_long] = "longer"
    k_short = _key()
    raw.set(redis_key(k_short), frame(k_short, v)[:-1])
    cases[k_short] = "shorter"
    for k, why in cases.items():
        s = c.stream_get(k, 1 << 20, 4096)
        _drain(s)
        assert s.outcome is StreamOutcome.CORRUPT and why in s.error
        assert raw.exists(redis_key(k)) == 0  # deleted, so it is never served
    assert c.stats().errors.get("corrupt", 0) == 3
    c.close()


def test_a_frame_longer_than_allowed_is_corrupt_before_it_is_read(redis_server):
    c = open_client(redis_server.url)
    k = _key()
    c.put_many([(k, os.urandom(2 << 20))])
    s = c.stream_get(k, max_bytes=1 << 20, piece_bytes=4096)
    assert _drain(s) == b"" and s.outcome is StreamOutcome.CORRUPT and "2097152" in s.error
    c.close()


def test_a_consumer_that_leaves_early_drops_the_connection_and_the_next_get_works(redis_server):
    c = open_client(redis_server.url)
    k, v = _key(), os.urandom(1 << 20)
    c.put_many([(k, v)])
    s = c.stream_get(k, 2 << 20, 4096)
    it = s.pieces()
    next(it)
    it.close()
    assert s.outcome is StreamOutcome.ABORTED
    for _ in range(3):  # connections go back to the pool clean (no stale replies in front of new ones)
        assert c.get_many([k]) == [v]
        s = c.stream_get(k, 2 << 20, 65536)
        assert _drain(s) == v and s.outcome is StreamOutcome.OK
    assert c.circuits()["read"] == "closed"
    c.close()


def test_a_stalled_store_times_out_and_a_dead_one_fails_into_outcomes(own_redis_server):
    cfg = ClientConfig(timeout_s=0.3, retries=0, breaker_failures=2)
    c = open_client(own_redis_server.url, cfg)
    k, v = _key(), os.urandom(100_000)
    c.put_many([(k, v)])
    raw = redis.Redis(host="127.0.0.1", port=own_redis_server.port)
    raw.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    t0 = time.monotonic()
    s = c.stream_get(k, 1 << 20, 4096)
    _drain(s)
    assert s.outcome is StreamOutcome.FAILED and s.error == "timeout" and time.monotonic() - t0 < 1.2
    time.sleep(1.5)
    own_redis_server.stop()
    s = c.stream_get(k, 1 << 20, 4096)
    _drain(s)
    assert s.outcome is StreamOutcome.FAILED and s.error == "unavailable"
    assert c.circuits()["read"] == "open"  # two failures
    assert c.stream_get(k, 1 << 20, 4096) is None  # the breaker refuses; get_many answers the miss
    assert c.get_many([k]) == [None]
    c.close()


def test_streams_from_threads_share_the_client(redis_server):
    c = open_client(redis_server.url)
    items = [(_key(), os.urandom(200_000 + i)) for i in range(8)]
    c.put_many(items)
    bad: list[str] = []

    def run(i):
        k, v = items[i]
        for _ in range(5):
            s = c.stream_get(k, 1 << 20, 16384)
            if _drain(s) != v or s.outcome is not StreamOutcome.OK:
                bad.append(f"{i}: {s.outcome} {s.error}")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not bad
    c.close()


def test_backends_that_cannot_stream_answer_none(tmp_path):
    c = open_client(f"file://{tmp_path}/kv")
    assert not hasattr(LocalStore, "stream_get")
    assert c.stream_get(_key(), 1 << 20, 4096) is None
    c.close()


def test_the_frame_reader_takes_any_cut_and_refuses_other_keys():
    k, v = _key(), os.urandom(10_000)
    blob = frame(k, v)
    for cut in (1, 5, 19, 20, 21, 36, 37, 4096):
        r, out = FrameReader(k), bytearray()
        for i in range(0, len(blob), cut):
            out += r.feed(blob[i : i + cut])
        r.finish()
        assert bytes(out) == v and r.payload_len == len(v)
    r = FrameReader(_key())
    r.feed(blob)
    with pytest.raises(FrameError, match="checksum"):
        r.finish()
    with pytest.raises(FrameError, match="magic"):
        FrameReader(k).feed(b"XXXX" + blob[4:])
