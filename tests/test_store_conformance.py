"""One conformance suite for every KVStore backend: embedded directory store, a real redis-server, a real
3-node Redis Cluster, the fault wrapper with no faults, and the fault-tolerant client (over the
embedded store)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from sgl_remote_kv.store.base import KVStore, StoreStats, open_store
from sgl_remote_kv.store.client import StoreClient
from sgl_remote_kv.store.faulty import FaultyStore
from sgl_remote_kv.store.keys import chunk_keys

pytest_plugins = ["fixtures.redis_servers"]

BACKENDS = ["local", "redis", "redis-cluster", "faulty-nofaults", "client"]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[KVStore]:
    kind = request.param
    if kind == "local":
        s: KVStore = open_store(str(tmp_path / "store"))
    elif kind == "redis":
        s = open_store(request.getfixturevalue("redis_server").url)
    elif kind == "redis-cluster":
        s = open_store(request.getfixturevalue("redis_cluster").url)
    elif kind == "faulty-nofaults":
        s = open_store(f"faulty+file://{tmp_path / 'store'}")
        assert isinstance(s, FaultyStore)
    else:
        s = StoreClient(open_store((tmp_path / "store").as_uri()))
    yield s
    s.close()


def rkeys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def test_put_get_roundtrip_and_order(store: KVStore) -> None:
    keys = rkeys(6)
    items = [(k, os.urandom(100 + i)) for i, k in enumerate(keys[:4])]
    store.put_many(items)
    got = store.get_many([keys[3], keys[5], keys[0], keys[3], keys[4]])
    assert got == [items[3][1], None, items[0][1], items[3][1], None]


def test_count_prefix_stops_at_first_gap(store: KVStore) -> None:
    keys = rkeys(5)
    store.put_many([(k, b"v" * 10) for k in keys[:2]] + [(keys[3], b"x")])
    assert store.count_prefix(keys) == 2
    assert store.count_prefix(keys[:2]) == 2
    assert store.count_prefix([]) == 0
    assert store.count_prefix(keys[2:]) == 0


def test_overwrite_and_delete(store: KVStore) -> None:
    k1, k2, k3 = rkeys(3)
    store.put_many([(k1, b"old"), (k2, b"two")])
    store.put_many([(k1, b"new value")])
    assert store.get_many([k1]) == [b"new value"]
    store.delete_many([k1, k3])  # k3 absent: ignored
    assert store.get_many([k1, k2]) == [None, b"two"]
    assert store.count_prefix([k2, k1]) == 1


def test_empty_and_large_values(store: KVStore) -> None:
    k_empty, k_big = rkeys(2)
    big = np.random.default_rng(0).integers(0, 256, 8 * 1024 * 1024, dtype=np.uint8).tobytes()
    store.put_many([(k_empty, b""), (k_big, big)])
    assert store.get_many([k_empty, k_big]) == [b"", big]
    assert store.count_prefix([k_empty, k_big]) == 2


def test_memoryview_and_bytearray_values_are_copied(store: KVStore) -> None:
    k1, k2 = rkeys(2)
    buf = bytearray(b"abcdef")
    store.put_many([(k1, memoryview(buf)), (k2, buf)])
    buf[:] = b"zzzzzz"  # the caller owns and reuses its buffer after the call
    assert store.get_many([k1, k2]) == [b"abcdef", b"abcdef"]


def test_prompt_prefix_lookup_with_chunk_keys(store: KVStore) -> None:
    ns = os.urandom(32)
    stored_prompt = np.arange(1000, 1000 + 64 * 5, dtype=np.int64)
    keys = chunk_keys(ns, stored_prompt, 64)
    store.put_many([(k, f"chunk{i}".encode()) for i, k in enumerate(keys)])
    # a new prompt sharing 3 full chunks, then diverging
    new_prompt = np.concatenate([stored_prompt[: 64 * 3 + 10], np.full(200, 7)])
    new_keys = chunk_keys(ns, new_prompt, 64)
    assert len(new_keys) == len(new_prompt) // 64
    assert store.count_prefix(new_keys) == 3
    assert store.get_many(new_keys[:3]) == [b"chunk0", b"chunk1", b"chunk2"]


def test_stats_count_hits_misses_bytes(store: KVStore) -> None:
    before = store.stats()
    k1, k2 = rkeys(2)
    store.put_many([(k1, b"x" * 1000)])
    store.get_many([k1, k2])
    after = store.stats()
    assert isinstance(after, StoreStats)
    assert after.hits - before.hits == 1
    assert after.misses - before.misses == 1
    assert after.bytes_read - before.bytes_read == 1000
    assert after.bytes_written - before.bytes_written == 1000
    assert after.latency["get_many"].count >= 1
    assert after.error_count == before.error_count == 0


def test_concurrent_writers_readers_never_see_partial_values(store: KVStore) -> None:
    keys = rkeys(4)
    values = {i: bytes([i]) * (200_000 + i * 1000) for i in range(1, 5)}
    bad: list[bytes] = []
    stop = threading.Event()

    def writer(i: int) -> None:
        for _ in range(15):
            store.put_many([(k, values[i]) for k in keys])

    def reader() -> None:
        while not stop.is_set():
            for v in store.get_many(keys):
                if v is not None and v not in values.values():
                    bad.append(v[:16])

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(i,)) for i in values]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert bad == []
    assert all(v in values.values() for v in store.get_many(keys))


def test_bad_keys_raise_value_error_or_miss(store: KVStore) -> None:
    if isinstance(store, StoreClient):  # the client never raises: misuse is a counted miss
        assert store.get_many([b"short"]) == [None]
        assert store.stats().errors.get("invalid") == 1
        assert store.stats().circuit == "closed"
        return
    with pytest.raises(ValueError, match="32-byte"):
        store.get_many([b"short"])
    with pytest.raises(ValueError, match="32-byte"):
        store.put_many([("not bytes" * 4, b"v")])  # type: ignore[list-item]
