"""A serving process follows other servers' ``--remote-kv-flush tier`` flushes (``GenerationWatch``).

Real ``StoreClient`` over an embedded file store (behind the fault wrapper for outages), a real
``KeySpace``, a fake clock. What must hold: the generation is re-read only after ``interval_s`` and
applied on the polling thread; a changed generation changes every key namespace; a store that does not
answer changes nothing (an error is not "never flushed"); a read started before this server's own
flush cannot bring the old generation back.
"""

from __future__ import annotations

import time

import pytest

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.runtime import KeySpace
from sgl_remote_kv.store import generation
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import ClientConfig, StoreClient
from sgl_remote_kv.store.faulty import FaultConfig, FaultyStore
from sgl_remote_kv.store.local import LocalStore
from tests.admission_fakes import FP


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def world(tmp_path):
    store = FaultyStore(LocalStore(tmp_path / "store"))
    client = StoreClient(store, ClientConfig(negative_ttl_s=0, breaker_failures=1000, retries=0))
    keys = KeySpace(FP, get_codec("lossless"), 16)
    clock = Clock()
    watch = generation.GenerationWatch(client, FP, keys, interval_s=10.0, clock=clock)
    yield store, client, keys, clock, watch
    watch.close()
    client.close()


def _settle(watch) -> None:
    """Let a started read finish, then poll once more to apply it."""
    if watch._pending is not None:
        watch._pending.result(timeout=10)
    watch.poll()


def _flush_elsewhere(client, value: bytes) -> None:
    assert client.put_many([(keys_mod.generation_key(FP), value)])


def test_read_tells_never_flushed_from_no_answer(world):
    store, client, *_ = world
    assert generation.read(client, FP) == b""
    _flush_elsewhere(client, b"g1")
    assert generation.read(client, FP) == b"g1"
    store.set_faults(FaultConfig(down=True))
    assert generation.read(client, FP) is None


def test_another_servers_flush_is_followed_after_the_interval(world):
    _, client, keys, clock, watch = world
    ns0 = keys.namespace(None)
    _flush_elsewhere(client, b"g1")
    clock.t = 9.0
    _settle(watch)
    assert keys.generation == b"" and keys.namespace(None) == ns0  # not due yet
    clock.t = 10.5
    watch.poll()  # starts the read; nothing applied on this call
    _settle(watch)
    assert keys.generation == b"g1" and keys.namespace(None) != ns0
    assert keys.namespace(None) == keys_mod.namespace(FP, "lossless", keys.codec.params_bytes(), None, b"g1")


def test_an_unreachable_store_keeps_the_generation(world):
    store, client, keys, clock, watch = world
    keys.set_generation(b"g1")
    store.set_faults(FaultConfig(down=True))
    clock.t = 11.0
    watch.poll()
    _settle(watch)
    assert keys.generation == b"g1"


def test_a_read_from_before_our_own_flush_is_discarded(world):
    store, client, keys, clock, watch = world
    _flush_elsewhere(client, b"old")
    store.set_faults(FaultConfig(latency_s=0.3))  # the read is still running when we flush
    clock.t = 11.0
    watch.poll()
    keys.set_generation(b"new")  # what RemoteKVRuntime.on_flush does, then:
    watch.forget_pending()
    time.sleep(0.5)
    watch.poll()
    assert keys.generation == b"new"
