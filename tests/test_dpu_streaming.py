"""A data plane reading Redis values in pieces (``--stream-piece-kib``): layers decode as their bytes arrive,
but the host hears of a layer (``LayerDone``, so it writes it into its pool) only once the whole value's
store frame verified. Real data-plane processes, a real redis-server; slow pieces and faults come from
``faulty+redis://`` (``piece_latency_s``)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import redis
from dpu_helpers import CHUNK, FP, LAYOUT, codecs, make_pool, pool_tokens, put_chunks, random_chunks

from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.store.redis_store import redis_key
from tests.fixtures.dpu_clients import dp_spec

pytest_plugins = ["fixtures.redis_servers", "fixtures.dpu_clients"]

PIECE_KIB = 1  # a test chunk's blob is ~25-35 KiB: dozens of pieces, the header spread over two


def _streamed(client, at_least: int, timeout: float = 10.0) -> int:
    """The data plane's count of streamed chunks once it reached ``at_least`` (heartbeat stats)."""
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        stats = json.loads(client.stats().get("dataplane") or "{}")
        n = stats.get("pipeline", {}).get("fetch", {}).get("streamed", 0)
        if n >= at_least:
            return n
        time.sleep(0.1)
    return n


def _assert_chunks_in_pool(target, blobs, chunks):
    for i in chunks:
        k, v = decode(blobs[i], FP)
        pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
        assert np.array_equal(k, pk) and np.array_equal(v, pv), f"chunk {i} differs"


def _assert_chunk_unwritten(target, i):
    pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
    assert not pk.any() and not pv.any(), f"chunk {i} reached the pool"


@pytest.mark.parametrize("codec_name,output", [("lossless", "kv"), ("quant", "kv"), ("quant", "codes")])
def test_streamed_fetch_is_bit_exact_and_equals_whole_gets(redis_server, make_client, codec_name, output):
    """``codes``: the data plane only inflates (into the region, as pieces arrive) and the CPU pool's writer
    dequantizes; the held ``LayerDone`` s carry the codes' lengths."""
    codec = codecs()[codec_name]
    url = redis_server.url
    keys, blobs = put_chunks(
        url, codec, random_chunks(5, seed=11), prefix=f"s-{codec_name}-{output}".encode()
    )
    streaming = make_client(
        url, codec, process=dp_spec(stream_piece_kib=PIECE_KIB), eager_writes=True, output=output
    )
    whole = make_client(url, codec, process=dp_spec(stream_piece_kib=0), output=output)
    for c, expect_streamed in ((streaming, 5), (whole, 0)):
        target = make_pool(LAYOUT, 512, 5 * CHUNK)
        res = c.fetch("r", keys, CHUNK, target, timeout=30)
        assert res.hit_chunks == 5 and not res.failures
        assert res.wire_bytes == sum(map(len, blobs))
        _assert_chunks_in_pool(target, blobs, range(5))
        assert _streamed(c, expect_streamed) == expect_streamed


def test_a_value_failing_its_frame_only_at_the_end_never_reaches_the_pool(redis_server, make_client):
    """Chunk 2 holds chunk 1's value: a valid chunk blob (header and section CRCs pass, so its layers
    decode and are copied out as they arrive) whose store frame names another key, which only the last
    byte reveals. The host must get ``corrupt`` for it and none of its layers, also with eager writes."""
    codec = codecs()["lossless"]
    slow = redis_server.url.replace("redis://", "faulty+redis://") + "?piece_latency_s=0.01"
    keys, blobs = put_chunks(redis_server.url, codec, random_chunks(3, seed=12), prefix=b"misframed")
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    raw.set(redis_key(keys[2]), raw.get(redis_key(keys[1])))
    c = make_client(slow, codec, process=dp_spec(stream_piece_kib=PIECE_KIB), eager_writes=True)
    target = make_pool(LAYOUT, 512, 3 * CHUNK)
    h = c.submit("r", keys, CHUNK, target)
    res = h.wait(timeout=60)
    assert res.hit_chunks == 2 and res.failures[2] == "corrupt"
    _assert_chunks_in_pool(target, blobs, range(2))
    _assert_chunk_unwritten(target, 2)
    assert raw.exists(redis_key(keys[2])) == 0  # the data plane's client deleted it
    assert _streamed(c, 2) == 2


def test_a_section_failing_its_crc_mid_value_ends_the_prefix_there(redis_server, make_client):
    codec = codecs()["lossless"]
    keys, blobs = put_chunks(redis_server.url, codec, random_chunks(3, seed=13), prefix=b"badsection")
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    v = bytearray(raw.get(redis_key(keys[1])))
    v[-10] ^= 0x40  # inside the last layer's section
    raw.set(redis_key(keys[1]), bytes(v))
    c = make_client(redis_server.url, codec, process=dp_spec(stream_piece_kib=PIECE_KIB), eager_writes=True)
    target = make_pool(LAYOUT, 512, 3 * CHUNK)
    res = c.fetch("r", keys, CHUNK, target, timeout=30)
    assert res.hit_chunks == 1 and res.failures[1] == "corrupt"
    _assert_chunks_in_pool(target, blobs, [0])
    _assert_chunk_unwritten(target, 1)


def test_cancel_mid_stream_then_the_same_data_plane_serves_again(redis_server, make_client):
    codec = codecs()["quant"]
    slow = redis_server.url.replace("redis://", "faulty+redis://") + "?piece_latency_s=0.02"
    keys, blobs = put_chunks(redis_server.url, codec, random_chunks(4, seed=14), prefix=b"cancel")
    c = make_client(slow, codec, process=dp_spec(stream_piece_kib=PIECE_KIB))
    h = c.submit("r", keys, CHUNK, make_pool(LAYOUT, 512, 4 * CHUNK))
    time.sleep(0.3)  # chunk 0 is arriving, piece by piece
    t0 = time.monotonic()
    c.cancel(h)
    assert time.monotonic() - t0 < 5
    res = h.wait(timeout=30)
    assert res.hit_chunks < 4
    fast = make_client(redis_server.url, codec, process=dp_spec(stream_piece_kib=PIECE_KIB))
    target = make_pool(LAYOUT, 512, 4 * CHUNK)
    assert fast.fetch("again", keys, CHUNK, target, timeout=30).hit_chunks == 4
    _assert_chunks_in_pool(target, blobs, range(4))
    res = c.fetch("after-cancel", keys[:1], CHUNK, make_pool(LAYOUT, 512, CHUNK), timeout=60)
    assert res.hit_chunks == 1  # the cancelled stream left no stale replies on its connection


def test_the_store_dying_is_a_store_error_and_nothing_of_the_lost_chunks_is_written(
    own_redis_server, make_client
):
    """The store dies while chunk 0 is streamed: its pieces were already on the way (pipelined), so it may
    still complete; every chunk after it is a store error and none of their layers reaches the pool."""
    codec = codecs()["lossless"]
    slow = own_redis_server.url.replace("redis://", "faulty+redis://") + "?piece_latency_s=0.02"
    keys, blobs = put_chunks(own_redis_server.url, codec, random_chunks(3, seed=15), prefix=b"dies")
    c = make_client(slow, codec, process=dp_spec(stream_piece_kib=PIECE_KIB), eager_writes=True)
    target = make_pool(LAYOUT, 512, 3 * CHUNK)
    h = c.submit("r", keys, CHUNK, target)
    killer = threading.Timer(0.25, own_redis_server.stop)
    killer.start()
    res = h.wait(timeout=60)
    killer.join()
    assert res.hit_chunks < 3 and res.failures[res.hit_chunks].startswith("store_"), res.failures
    _assert_chunks_in_pool(target, blobs, range(res.hit_chunks))
    for i in range(res.hit_chunks, 3):
        _assert_chunk_unwritten(target, i)
