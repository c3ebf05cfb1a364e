"""The store framing: every value the ``StoreClient`` writes is ``header || payload``.

Header version 2 (little-endian): magic ``SRKV``, version (u8), 3 pad bytes, payload length (u64), CRC32
(u32) over the chunk key, the two fields below and the payload, then ``written_at`` (u64, unix seconds)
and the writer's 8-byte tenant tag (``keys.tenant_tag``: what ``sgl-remote-kv-admin`` counts and evicts
by; zeros for the shared namespace). Version 1 (no time, no tag; CRC over key and payload) is still read.
A value framed for another key never verifies: the key is under the CRC.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from isal import isal_zlib

from .keys import SHARED_TAG

_MAGIC = b"SRKV"
_HEADER_V1 = struct.Struct("<4sBxxxQI")  # magic, version, pad, payload length, crc32(key || payload)
# v2: + written_at (unix s), tenant tag; crc32(key || written_at || tag || payload)
_HEADER = struct.Struct("<4sBxxxQIQ8s")
_META = struct.Struct("<Q8s")
_VERSION = 2


@dataclass(frozen=True)
class Framed:
    """A verified framed value: its payload and what the frame says about it (v1: no time, shared)."""

    payload: bytes
    version: int
    written_at: int  # unix seconds; 0 for version 1 values
    tenant_tag: bytes  # keys.tenant_tag of the writer's request; zeros: shared (and every v1 value)


def frame(
    key: bytes,
    payload: bytes | bytearray | memoryview,
    tenant_tag: bytes = SHARED_TAG,
    written_at: int | None = None,
) -> bytes:
    """``header || payload`` (one copy of the payload)."""
    meta = _META.pack(int(time.time()) if written_at is None else written_at, tenant_tag)
    crc = isal_zlib.crc32(payload, isal_zlib.crc32(meta, isal_zlib.crc32(key)))
    return _HEADER.pack(_MAGIC, _VERSION, len(payload), crc, *_META.unpack(meta)) + bytes(payload)


def check_frame(key: bytes, blob: bytes) -> Framed:
    """The framed value; ``FrameError`` (saying why) if it is truncated, corrupt, of an unknown version or
    not for ``key``."""
    r = FrameReader(key)
    payload = bytes(r.feed(blob))
    r.finish()
    return Framed(payload, r.version, r.written_at, r.tenant_tag)


def read_frame(key: bytes, blob: bytes) -> Framed | None:
    """The framed value, or ``None`` if it is truncated, corrupt, of an unknown version or not for ``key``."""
    try:
        return check_frame(key, blob)
    except FrameError:
        return None


def unframe(key: bytes, blob: bytes) -> bytes | None:
    """The payload of a framed blob, or ``None`` if it is truncated, corrupt or not for ``key``."""
    f = read_frame(key, blob)
    return None if f is None else f.payload


class FrameError(ValueError):
    """A streamed value is not a valid frame (bad header, more or fewer bytes than it claims, bad CRC)."""


class FrameReader:
    """The frame parser (``read_frame`` is its one-shot use): feed the value's bytes in order, in any
    pieces; ``feed`` returns the payload bytes of each (the header is held back until whole); ``finish``
    checks the length and the CRC over key, header fields and payload (so a value framed for another key,
    or changed between pieces, fails). ``payload_len``, ``version``, ``written_at`` and ``tenant_tag`` are
    known once the header is in. Raises ``FrameError``. One thread."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._head = b""
        self._crc = 0
        self._want = 0  # the stored CRC
        self.payload_len: int | None = None
        self.received = 0  # payload bytes fed so far
        self.version, self.written_at, self.tenant_tag = 0, 0, SHARED_TAG  # (version 1: no time, shared)

    def feed(self, piece) -> memoryview:
        data = memoryview(piece).cast("B")
        while self.payload_len is None and len(data):
            need = self._header_size() if len(self._head) >= 5 else 5
            take = need - len(self._head)
            self._head += bytes(data[:take])
            data = data[take:]
            if len(self._head) >= 5 and len(self._head) == self._header_size():
                self._open_header()
        if self.payload_len is None:
            return data
        if len(data) > self.payload_len - self.received:
            raise FrameError("the value is longer than its frame header says")
        self._crc = isal_zlib.crc32(data, self._crc)
        self.received += len(data)
        return data

    def _header_size(self) -> int:
        magic, version = self._head[:4], self._head[4]
        if magic != _MAGIC or version not in (1, 2):
            raise FrameError("not a framed value (magic or version)")
        return _HEADER_V1.size if version == 1 else _HEADER.size

    def _open_header(self) -> None:
        _, self.version, length, crc = _HEADER_V1.unpack_from(self._head)
        meta = self._head[_HEADER_V1.size :] if self.version == 2 else b""
        if meta:
            self.written_at, self.tenant_tag = _META.unpack(meta)
        self._crc, self._want, self.payload_len = (
            isal_zlib.crc32(meta, isal_zlib.crc32(self._key)),
            crc,
            length,
        )

    def finish(self) -> None:
        """The whole value was fed: ``FrameError`` unless it is complete and its CRC matches."""
        if self.payload_len is None or self.received != self.payload_len:
            raise FrameError("the value is shorter than its frame header says")
        if self._crc != self._want:
            raise FrameError("frame checksum mismatch (corrupt, changed while read, or not this key's)")
