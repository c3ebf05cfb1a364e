"""Replies of the standalone Redis backend's reads (``RedisStore.get_many``, ``stream_get``) read straight
off a redis-py connection's socket.

redis-py's parser reads whatever the socket holds: on a slow link that is a TCP segment or two per read, so
a 256 KiB ``GETRANGE`` reply (or a whole chunk's ``GET``) costs a hundred-odd wake-ups, each a trip through
the parser's Python loop (measured: at 160 Mbit/s the data plane's two store threads spent more CPU than its
inflate stage). This
reader parses the RESP2 replies itself (integers, bulk strings, errors) and reads each bulk string into one
buffer of its announced length, with ``SO_RCVLOWAT`` set to the bytes of the reply still to come (at most
``LOWAT_MAX``): the kernel wakes the reader when that much is in, not per segment. The low-water mark
never exceeds what the server already announced it will send, so a read cannot wait for bytes that never
come; header lines are read with a mark of 1.

Relies on redis-py internals (checked in ``usable``): a plain TCP ``redis.connection.Connection`` speaking
RESP2 (``redis_store.connection_kwargs`` asks for it; redis-py 8 defaults to RESP3) whose ``_sock`` is the
socket, and a parser holding no bytes when the commands were sent (true for a pooled connection whose
earlier replies were all read: ``RedisStore`` disconnects a connection that failed or
was abandoned mid-reply). TLS and unix-socket connections keep redis-py's parser.

Errors raise redis-py's exception types (``redis_store.translate_errors`` maps them): ``TimeoutError``
(the socket's timeout passed with no byte), ``ConnectionError`` (closed, or a socket error),
``ResponseError`` (an error reply), ``InvalidResponse`` (not RESP2). ``close`` restores the socket's mark
(the connection goes back to the pool); it returns False when that failed, and the caller must then
disconnect the connection.

Threads: one (the caller's), for the life of the reader. Buffers: each bulk string is a fresh ``bytearray``
owned by the caller.
"""

from __future__ import annotations

import socket

import redis

LOWAT_MAX = 128 << 10  # the largest low-water mark asked for (the kernel also caps it at half its buffer)
_MAX_LINE = 64 << 10


def usable(conn) -> bool:
    """True for a connection this reader can read from (plain TCP, RESP2, a socket open)."""
    return (
        type(conn) is redis.connection.Connection
        and getattr(conn, "protocol", None) == 2
        and isinstance(getattr(conn, "_sock", None), socket.socket)
    )


class RespReader:
    def __init__(self, conn) -> None:
        self._sock: socket.socket = conn._sock
        self._pending = bytearray()  # bytes read past the last reply's end (a header read reads ahead)
        self._lowat = 1

    def integer(self) -> int:
        line = self._line()
        if line[:1] != b":":
            raise redis.exceptions.InvalidResponse(f"expected an integer reply, got {line[:20]!r}")
        return int(line[1:])

    def bulk(self) -> bytearray | None:
        """A bulk string (``None`` for a null bulk)."""
        line = self._line()
        if line[:1] != b"$":
            raise redis.exceptions.InvalidResponse(f"expected a bulk string, got {line[:20]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        out = bytearray(n + 2)
        view = memoryview(out)
        got = min(len(self._pending), n + 2)
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < n + 2:
            self._mark(n + 2 - got)
            k = self._recv(self._sock.recv_into, view[got:])
            if k == 0:
                raise redis.exceptions.ConnectionError("the server closed the connection mid-reply")
            got += k
        view.release()
        if out[n:] != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk string not terminated by CRLF")
        del out[n:]
        return out

    def close(self) -> bool:
        """Restore the socket's low-water mark; False if that failed (disconnect the connection then)."""
        try:
            self._mark(1)
        except OSError:
            return False
        return True

    # ---- internals ----------------------------------------------------------------------------------
    def _line(self) -> bytes:
        while True:
            i = self._pending.find(b"\r\n")
            if i >= 0:
                line = bytes(self._pending[:i])
                del self._pending[: i + 2]
                if line[:1] == b"-":
                    raise redis.exceptions.ResponseError(line[1:].decode("utf-8", "replace"))
                return line
            if len(self._pending) > _MAX_LINE:
                raise redis.exceptions.InvalidResponse("reply header line too long")
            self._mark(1)
            data = self._recv(self._sock.recv, 4096)
            if not data:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            self._pending += data

    def _mark(self, n: int) -> None:
        n = max(1, min(n, LOWAT_MAX))
        if n != self._lowat:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self._lowat = n

    @staticmethod
    def _recv(read, arg):
        try:
            return read(arg)
        except TimeoutError as e:  # socket.timeout
            raise redis.exceptions.TimeoutError("timeout reading a reply") from e
        except OSError as e:
            raise redis.exceptions.ConnectionError(f"{type(e).__name__}: {e}") from e
