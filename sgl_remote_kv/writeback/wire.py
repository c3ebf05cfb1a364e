"""The frames between the write-back (in the scheduler process, ``encoders.py``) and one of its encoder
processes (``encoder_process.py``), over one Unix stream socket per encoder. No pickle.

One frame::

    header  10 bytes  struct "<4sHI": magic b"SKWB", WIRE_VERSION, body length
    body    msgpack of one of the tagged Structs below (``Message``), validated strictly: unknown fields,
            wrong types or values out of bounds are a ``WireError``, never anything else

KV does not travel in frames: before ``Encode`` the host writes the chunk's K then V (``[L, T, H, D]``, C
order, the layout's storage dtype; V right after K) at the start of the encoder's slot, a shared memory file
both processes map; the encoder answers ``Encoded`` once it no longer reads the slot. One request in flight
per encoder. Conversation: ``Hello`` -> ``Ready`` (``error`` set: the encoder could not start and exits),
then ``Encode`` -> ``Encoded`` any number of times; the host closing the socket ends the encoder.

Threads: pure functions; ``send``/``recv`` use the caller's socket on the caller's thread.
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated

import msgspec

MAGIC = b"SKWB"
WIRE_VERSION = 1
_HEADER = struct.Struct("<4sHI")
MAX_SLOT_BYTES = 1 << 36
CONTROL_FRAME_BYTES = 64 << 10  # every frame but ``Encoded``

Text = Annotated[str, msgspec.Meta(max_length=4096)]


class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    """What the encoder encodes with: the codec (name, canonical params JSON) and the model."""

    codec: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    codec_params: Text
    fingerprint: Text  # ModelFingerprint.canonical()
    slot_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_SLOT_BYTES)]
    nice: Annotated[int, msgspec.Meta(ge=0, le=19)]  # added to the encoder's niceness at start


class Ready(msgspec.Struct, tag="ready", frozen=True, forbid_unknown_fields=True):
    error: Text = ""  # why the encoder cannot encode ("" : it can)


class Encode(msgspec.Struct, tag="encode", frozen=True, forbid_unknown_fields=True):
    """Encode the chunk in the slot: ``tokens`` tokens at sequence position ``start``."""

    tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    start: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class Encoded(msgspec.Struct, tag="encoded", frozen=True, forbid_unknown_fields=True):
    blob: bytes = b""  # the chunk's blob (``Codec.encode``), or empty with ``error``
    error: Text = ""  # the codec refused the chunk (its exception, in words)
    cpu_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0  # the encoder's CPU time for this chunk


Message = Hello | Ready | Encode | Encoded
_DECODER = msgspec.msgpack.Decoder(Message)


class WireError(Exception):
    """A frame that is not one of ours (bad magic or version, too long, not a valid message)."""


def send(sock: socket.socket, msg: Message) -> None:
    body = msgspec.msgpack.encode(msg)
    sock.sendall(_HEADER.pack(MAGIC, WIRE_VERSION, len(body)))
    sock.sendall(body)


def recv(sock: socket.socket, max_bytes: int = CONTROL_FRAME_BYTES) -> Message:
    """The next frame's message; ``EOFError`` when the peer closed the socket, ``OSError`` (``TimeoutError``
    included) from the socket, ``WireError`` for a frame that is not ours or longer than ``max_bytes``."""
    magic, version, n = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != MAGIC or version != WIRE_VERSION:
        raise WireError(f"not a write-back encoder frame (magic {magic!r}, version {version})")
    if n > max_bytes:
        raise WireError(f"frame of {n} bytes over the {max_bytes}-byte bound")
    try:
        return _DECODER.decode(_recv_exact(sock, n))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise WireError(f"bad frame: {e}") from None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise EOFError("the peer closed the socket")
        got += r
    return bytes(buf)
