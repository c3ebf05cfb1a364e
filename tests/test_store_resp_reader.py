"""``store.resp_reader``: the standalone Redis backend's read replies read off the socket with a low-water mark.

Against a real redis-server: the pieces are the value's, the pooled connection gets its mark back, an
error reply or a value changed between pieces never stalls. Against a stand-in server on a TCP socket
(crafted bytes, pauses): replies split anywhere, read-ahead across replies, and the property the design
rests on: the mark never exceeds the bytes a reply still announced, so a short reply after a long one is
read at once, not after the socket's timeout."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import redis

from sgl_remote_kv.store import resp_reader
from sgl_remote_kv.store.base import StoreError
from sgl_remote_kv.store.redis_store import RedisStore, redis_key

pytest_plugins = ["fixtures.redis_servers"]


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


# ---- against redis-server ------------------------------------------------------------------------------
def test_pieces_come_through_the_reader_and_the_pooled_connection_gets_its_mark_back(redis_server):
    st = RedisStore("127.0.0.1", redis_server.port)
    v = os.urandom(700_001)
    st._r.set(redis_key(b"k" * 32), v)
    conn = st._r.connection_pool.get_connection()
    assert resp_reader.usable(conn)  # plain TCP: the streamed get below reads through the reader
    st._r.connection_pool.release(conn)
    used = []
    real = resp_reader.RespReader.bulk

    def spy(self):
        used.append(1)
        return real(self)

    resp_reader.RespReader.bulk = spy
    try:
        pieces = list(st.stream_get(b"k" * 32, 65536))
    finally:
        resp_reader.RespReader.bulk = real
    assert b"".join(pieces) == v and len(pieces) == 11 and len(used) == 11
    used.clear()
    resp_reader.RespReader.bulk = spy
    try:  # whole values too: a batch of GETs, an absent key among them
        got = st.get_many([b"k" * 32, b"z" * 32, b"k" * 32])
    finally:
        resp_reader.RespReader.bulk = real
    assert got == [v, None, v] and len(used) == 3
    conn = st._r.connection_pool.get_connection()
    assert _lowat(conn._sock) == 1
    st._r.connection_pool.release(conn)
    assert st._r.get(redis_key(b"k" * 32)) == v  # the connection still speaks RESP after the reader
    st.close()


def test_an_error_reply_is_a_store_error_and_a_value_shrunk_between_pieces_ends_at_once(redis_server):
    st = RedisStore("127.0.0.1", redis_server.port, timeout_s=5.0)
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    raw.rpush(redis_key(b"L" * 32), b"x")  # GETRANGE on a list: WRONGTYPE
    with pytest.raises(StoreError, match="WRONGTYPE"):
        list(st.stream_get(b"L" * 32, 4096))
    k = redis_key(b"s" * 32)
    raw.set(k, os.urandom(400_000))
    gen = st.stream_get(b"s" * 32, 100_000)
    first = next(gen)  # the rest of the GETRANGEs are sent: shrink the value before the server runs them?
    raw.set(k, b"short")  # (they may have run already; either way no read may wait for bytes never sent)
    t0 = time.monotonic()
    rest = list(gen)
    assert time.monotonic() - t0 < 2.0  # well under the 5 s socket timeout
    assert len(first) == 100_000 and sum(map(len, rest)) <= 300_000
    assert st._r.get(k) == b"short"
    st.close()


# ---- against a stand-in server ---------------------------------------------------------------------------
class _Conn:
    """What the reader needs of a redis-py connection: its socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


@pytest.fixture
def pair():
    """(client socket with a 1 s timeout, server socket): a real TCP connection on localhost."""
    ls = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(ls.getsockname(), timeout=1.0)
    s, _ = ls.accept()
    ls.close()
    yield c, s
    c.close()
    s.close()


def _send_later(sock: socket.socket, parts: list[tuple[float, bytes]]) -> threading.Thread:
    def run():
        for delay, data in parts:
            time.sleep(delay)
            sock.sendall(data)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_replies_split_anywhere_and_read_ahead_across_replies(pair):
    c, s = pair
    body = os.urandom(5000)
    stream = b":5000\r\n$5000\r\n" + body + b"\r\n$0\r\n\r\n$-1\r\n$3\r\nabc\r\n"
    cuts = [1, 3, 7, 8, 9, 15, 16, 2000, 5014, 5015, 5016, 5017, 5020, 5022, 5026, len(stream)]
    t = _send_later(s, [(0.01, stream[a:b]) for a, b in zip([0, *cuts[:-1]], cuts, strict=True)])
    r = resp_reader.RespReader(_Conn(c))
    assert r.integer() == 5000
    assert r.bulk() == body
    assert r.bulk() == b""
    assert r.bulk() is None
    assert r.bulk() == b"abc"
    assert r.close() and _lowat(c) == 1
    t.join()


def test_a_short_reply_after_a_long_one_is_read_at_once(pair):
    """The mark is set to what the *current* reply still owes; a stale mark (the long reply's) would hold
    the short reply's read until the socket's timeout."""
    c, s = pair
    body = os.urandom(300_000)
    t = _send_later(s, [(0.0, b"$300000\r\n" + body[:1000]), (0.2, body[1000:] + b"\r\n"), (0.2, b":7\r\n")])
    r = resp_reader.RespReader(_Conn(c))
    t0 = time.monotonic()
    assert r.bulk() == body
    assert r.integer() == 7
    assert time.monotonic() - t0 < 0.9  # the pauses (0.4 s), not the 1 s timeout
    t.join()


@pytest.mark.parametrize(
    "data, error",
    [
        (b"-ERR boom\r\n", redis.exceptions.ResponseError),
        (b"+OK\r\n", redis.exceptions.InvalidResponse),
        (b"$3\r\nabcXY", redis.exceptions.InvalidResponse),  # not CRLF-terminated
        (b"$10\r\nabc", redis.exceptions.ConnectionError),  # the server closes mid-reply
        (b"$10\r\nabc", redis.exceptions.TimeoutError),  # the server stalls mid-reply
    ],
)
def test_bad_replies_raise_redis_errors(pair, data, error):
    c, s = pair
    s.sendall(data)
    if error is redis.exceptions.ConnectionError:
        s.shutdown(socket.SHUT_WR)
    r = resp_reader.RespReader(_Conn(c))
    with pytest.raises(error):
        r.bulk()
    assert r.close() and _lowat(c) == 1


def test_only_plain_tcp_resp2_connections_are_read_directly(redis_server):
    resp3 = redis.Redis(host="127.0.0.1", port=redis_server.port, protocol=3).connection_pool.get_connection()
    assert resp3._sock is not None and not resp_reader.usable(resp3)  # RESP3 nulls and pushes: redis-py reads
    assert not resp_reader.usable(redis.connection.UnixDomainSocketConnection(path="/nonexistent"))
    assert not resp_reader.usable(redis.connection.Connection())  # not connected: no socket
