"""Framing of the control channel between the host (the DPU client) and the data plane, over ZeroMQ:
how a message (``messages.py``; every name there is re-exported here, so ``protocol.SubmitFetch`` etc.
work) becomes one frame and back.

Wire format of one message (one ZeroMQ frame, no pickle anywhere)::

    envelope  8 bytes  struct "<4sHH": magic b"SKDP", PROTOCOL_VERSION, message kind (KINDS)
    body      msgpack of the kind's msgspec Struct (typed, strict: wrong types or unknown kinds fail)

``decode`` is the only parser. It checks the frame size (``MAX_FRAME_BYTES``), the envelope, then
lets msgspec validate the body against the kind's Struct, whose fields carry bounds (``Meta``); a few
cross-field rules are checked in ``__post_init__``. Every failure is a ``ProtocolError`` subclass,
never anything else: a hostile peer can only get its message dropped. The data plane's ``--warm``
argument (``Warmup``) is JSON instead: ``encode_warmup``/``decode_warmup``.

Who calls: any thread may call ``encode``/``decode``/``drain`` (pure functions, no shared state besides
the immutable per-kind decoders; ``drain`` uses the caller's socket on the caller's thread).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import msgspec

from .messages import (
    FAIL_KINDS,
    MAX_CHUNKS,
    MAX_DEST_BYTES,
    MAX_FRAME_BYTES,
    MAX_LAYERS,
    MAX_REGIONS,
    MAX_STORE_KEYS,
    MAX_VALUE_BYTES,
    BlobRef,
    Cancel,
    ChunkDest,
    ChunkDone,
    ChunkFailed,
    ChunksVerified,
    Fingerprint,
    Goodbye,
    Heartbeat,
    JobDone,
    LayerDone,
    Layout,
    Message,
    Pong,
    Register,
    Registered,
    StoreReply,
    StoreRequest,
    SubmitFetch,
    Warmup,
)

# 2: SubmitFetch.blob_off/blob_cap, ChunksVerified; 3: ChunkFailed.store_error;
# 4: Register / Registered / Goodbye (a client registers its regions before submitting), Pong.registered;
# 5: SubmitFetch.output ("codes": the lossless stage's output for the pool's writer), LayerDone.lengths
PROTOCOL_VERSION = 5
MAGIC = b"SKDP"
ENVELOPE = struct.Struct("<4sHH")


class ProtocolError(Exception):
    """Base of every error ``decode`` raises."""


class BadFrame(ProtocolError):
    """Too short, too long, wrong magic, or a body that does not validate."""


class VersionMismatch(ProtocolError):
    """A well-formed envelope of another protocol version."""


class UnknownKind(ProtocolError):
    """A well-formed envelope naming a message kind this build does not know."""


def encode_warmup(w: Warmup) -> str:
    return msgspec.json.encode(w).decode()


def decode_warmup(text: str) -> Warmup:
    """Parse ``--warm``; ``ValueError`` with the reason when it is not a valid ``Warmup``."""
    try:
        return msgspec.json.decode(text, type=Warmup)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"bad --warm: {e}") from None


KINDS: dict[int, type[msgspec.Struct]] = {
    1: SubmitFetch,
    2: Cancel,
    3: Heartbeat,
    4: Pong,
    5: ChunkDone,
    6: LayerDone,
    7: ChunkFailed,
    8: JobDone,
    9: ChunksVerified,
    10: Register,
    11: Registered,
    12: Goodbye,
    13: StoreRequest,  # kinds 13-14 travel only on the store proxy's socket (additive: no version bump)
    14: StoreReply,
}
_KIND_OF = {cls: k for k, cls in KINDS.items()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {k: msgspec.msgpack.Decoder(cls) for k, cls in KINDS.items()}


def encode(msg: Message) -> bytes:
    """One frame for ``msg`` (envelope + msgpack body)."""
    kind = _KIND_OF[type(msg)]
    out = ENVELOPE.pack(MAGIC, PROTOCOL_VERSION, kind) + _ENCODER.encode(msg)
    if len(out) > MAX_FRAME_BYTES:
        raise ValueError(f"message of {len(out)} bytes exceeds MAX_FRAME_BYTES")
    return out


def decode(frame: bytes | memoryview) -> Message:
    """Parse one frame. Raises only ``ProtocolError`` subclasses."""
    n = len(frame)
    if n < ENVELOPE.size:
        raise BadFrame(f"frame of {n} bytes is shorter than the envelope")
    if n > MAX_FRAME_BYTES:
        raise BadFrame(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    magic, version, kind = ENVELOPE.unpack_from(frame, 0)
    if magic != MAGIC:
        raise BadFrame("bad magic")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    dec = _DECODERS.get(kind)
    if dec is None:
        raise UnknownKind(f"unknown message kind {kind}")
    try:
        return dec.decode(memoryview(frame)[ENVELOPE.size :])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:  # ValueError: bad UTF-8
        raise BadFrame(f"{KINDS[kind].__name__}: {e}") from None


def drain(
    sock,
    on_message: Callable[[list[bytes], Message], None],
    on_bad: Callable[[str], None],
    parts: int = 1,
) -> None:
    """Receive every queued message of ``sock`` without blocking: frames of ``parts`` ZeroMQ parts
    whose last part is a message (earlier parts, e.g. a ROUTER's peer id, are passed through as
    ``head``). A wrong part count or an undecodable frame goes to ``on_bad(reason)`` and is dropped.
    The one receive loop of both ends (data-plane server, host client)."""
    import zmq

    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != parts:
            on_bad(f"{len(frames)} frame parts, expected {parts}")
            continue
        try:
            msg = decode(frames[-1])
        except ProtocolError as e:
            on_bad(str(e))
            continue
        on_message(frames[:-1], msg)


__all__ = [
    # framing (this module)
    "PROTOCOL_VERSION",
    "MAGIC",
    "ENVELOPE",
    "KINDS",
    "ProtocolError",
    "BadFrame",
    "VersionMismatch",
    "UnknownKind",
    "encode",
    "decode",
    "drain",
    "encode_warmup",
    "decode_warmup",
    # the messages and their limits (``messages.py``)
    "MAX_FRAME_BYTES",
    "MAX_CHUNKS",
    "MAX_LAYERS",
    "MAX_DEST_BYTES",
    "MAX_REGIONS",
    "MAX_STORE_KEYS",
    "MAX_VALUE_BYTES",
    "FAIL_KINDS",
    "Message",
    "Layout",
    "Fingerprint",
    "Warmup",
    "ChunkDest",
    "SubmitFetch",
    "Cancel",
    "Heartbeat",
    "Pong",
    "Register",
    "Registered",
    "Goodbye",
    "BlobRef",
    "ChunksVerified",
    "ChunkDone",
    "LayerDone",
    "ChunkFailed",
    "JobDone",
    "StoreRequest",
    "StoreReply",
]
