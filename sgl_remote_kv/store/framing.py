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
import zlib
from dataclasses import dataclass

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


def frame(key: bytes, payload: bytes | bytearray | memoryview, tenant_tag: bytes = SHARED_TAG,
          written_at: int | None = None) -> bytes:  # fmt: skip
    """``header || payload`` (one copy of the payload)."""
    meta = _META.pack(int(time.time()) if written_at is None else written_at, tenant_tag)
    crc = zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(key)))
    return _HEADER.pack(_MAGIC, _VERSION, len(payload), crc, *_META.unpack(meta)) + bytes(payload)


def read_frame(key: bytes, blob: bytes) -> Framed | None:
    """The framed value, or ``None`` if it is truncated, corrupt, of an unknown version or not for ``key``."""
    if len(blob) < _HEADER_V1.size:
        return None
    magic, version, length, crc = _HEADER_V1.unpack_from(blob)
    if magic != _MAGIC or version not in (1, 2):
        return None
    size = _HEADER_V1.size if version == 1 else _HEADER.size
    if length != len(blob) - size:
        return None
    payload = blob[size:]
    meta = b"" if version == 1 else blob[_HEADER_V1.size : size]
    if zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(key))) != crc:
        return None
    written_at, tag = _META.unpack(meta) if meta else (0, SHARED_TAG)
    return Framed(payload, version, written_at, tag)


def unframe(key: bytes, blob: bytes) -> bytes | None:
    """The payload of a framed blob, or ``None`` if it is truncated, corrupt or not for ``key``."""
    f = read_frame(key, blob)
    return None if f is None else f.payload
