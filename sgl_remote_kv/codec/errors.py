"""The closed set of errors a chunk decode can raise.

Every failure while parsing or decoding an untrusted blob is one of these (never ``IndexError``,
``struct.error``, ``ValueError``...). Callers treat any ``ChunkError`` as a cache miss.
Encoding errors caused by the caller's own arguments (wrong shapes, non-finite values) are plain
``ValueError``: they are programming errors, not hostile input.
"""

from __future__ import annotations

__all__ = ["ChunkError", "CorruptChunk", "ForeignChunk", "UnsupportedVersion", "LimitExceeded", "CORRUPTION"]


class ChunkError(Exception):
    """Base of every decode-side error."""


class CorruptChunk(ChunkError):
    """Bad magic, checksum/MAC mismatch, truncation, or an internally inconsistent payload."""


class ForeignChunk(ChunkError):
    """A well-formed chunk of another model, codec, codec parameters or entropy-model table."""


class UnsupportedVersion(ChunkError):
    """A well-formed chunk whose format version this build does not read."""


class LimitExceeded(ChunkError):
    """The header claims sizes beyond the configured ``Limits`` (refused before allocating)."""


# The errors that mean the stored bytes are damaged (counted as store_errors_total{kind="corrupt"}, logged by
# ``store/corruption.py``); a foreign or newer-version chunk is well-formed, only not ours to read.
CORRUPTION = (CorruptChunk, LimitExceeded)
