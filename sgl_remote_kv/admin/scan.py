"""Walk a store's values and say what each one is (the admin command's read side).

Every value is classified without trusting it: the MAC (when the URL is ``auth+...``), the store framing
(length, CRC over key and metadata, version 1 or 2: ``store.framing.read_frame``), then the payload — a
chunk blob (``codec.format``: header CRC, limits, and with ``deep`` every layer's CRC), a store
generation marker (``keys.GENERATION_MAGIC`` + 16 random bytes, or the 16 bare random bytes that releases
before the magic wrote), or something foreign. A chunk in a version-1 frame (``V1_CHUNK``) has no write
time and no tenant tag: its tenant is unknown ("untagged"), never taken for the shared namespace. Nothing
here deletes; ``cli`` does.

Threads: single-threaded; the store is opened for this walk only (``open_admin``) and closed by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sgl_remote_kv.codec.base import codec_class
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.codec.format import MAGIC, layer_section, parse_header
from sgl_remote_kv.store.base import open_store, redact_url
from sgl_remote_kv.store.framing import read_frame
from sgl_remote_kv.store.keys import GENERATION_MAGIC, SHARED_TAG
from sgl_remote_kv.store.security import AUTH_PREFIX, load_auth_key, split_auth_url, unseal

# Releases before ``GENERATION_MAGIC`` wrote a generation as 16 bare random bytes; no chunk blob is that
# short (its fixed header alone is longer), and only our client frames values (CRC bound to the key).
LEGACY_GENERATION_BYTES = 16


class ValueKind(str, Enum):
    CHUNK = "chunk"  # a valid chunk blob
    V1_CHUNK = "v1_chunk"  # a valid chunk blob in a version-1 frame: no write time, no tenant tag
    GENERATION = "generation"  # a --remote-kv-flush tier generation marker (never deleted by verify/evict)
    BAD_MAC = "bad_mac"  # auth+ store: the value's MAC does not verify under the given key
    CORRUPT_FRAME = "corrupt_frame"  # truncated, CRC mismatch, unknown framing version, other key's value
    BAD_HEADER = "bad_header"  # framed fine, but the chunk header is corrupt / over limits / unsupported
    BAD_LAYER_CRC = "bad_layer_crc"  # a layer section's CRC does not match the header's table
    FOREIGN = "foreign"  # framed fine, but neither a chunk blob nor a generation marker

    @property
    def failed(self) -> bool:
        """What ``verify`` reports (and ``--delete`` removes)."""
        return self not in (ValueKind.CHUNK, ValueKind.V1_CHUNK, ValueKind.GENERATION)

    @property
    def is_chunk(self) -> bool:
        """A valid chunk (what ``stats`` groups and ``evict`` may select)."""
        return self in (ValueKind.CHUNK, ValueKind.V1_CHUNK)


@dataclass(frozen=True)
class Entry:
    """One stored value. Chunk fields are set for chunks only; ``written_at`` is None when unknown
    (version-1 frames; a file's modification time is no substitute: the embedded store touches values
    it serves, for its LRU); ``tenant_tag`` is None when unknown (version-1 frames, unreadable values)."""

    key: bytes
    kind: ValueKind
    size: int  # bytes stored (framing and MAC included)
    written_at: float | None = None
    tenant_tag: bytes | None = None
    fingerprint: str = ""  # hex digest of the model fingerprint
    codec: str = ""
    tokens: int = 0
    raw_bytes: int = 0  # the KV it encodes, uncompressed
    detail: str = ""

    @property
    def tenant(self) -> str:
        if self.tenant_tag is None:
            return "untagged"
        return "shared" if self.tenant_tag == SHARED_TAG else self.tenant_tag.hex()


@dataclass
class AdminStore:
    """A store opened for the admin command: the backend itself (``auth+`` unwrapped, so a bad MAC is
    told apart from an absent value) and the MAC secret, if any."""

    store: object
    secret: bytes | None
    url: str  # redacted, for messages

    def close(self) -> None:
        self.store.close()


def open_admin(url: str) -> AdminStore:
    """``ValueError`` for a bad URL or a backend that cannot list its keys; store errors propagate."""
    secret = None
    inner = url
    if url.lower().startswith(AUTH_PREFIX):
        inner, key_file = split_auth_url(url)
        secret = load_auth_key(key_file)
    path = _local_path(inner)
    if path is not None and not (path / "objects").is_dir():
        raise ValueError(f"no store at {path} (nothing to look at)")
    store = open_store(inner)
    if not hasattr(store, "scan"):
        store.close()
        raise ValueError(f"store {redact_url(url)} cannot list its keys")
    return AdminStore(store, secret, redact_url(url))


def _local_path(url: str) -> Path | None:
    """The directory of an embedded-store URL (``file:///dir`` or a plain path); None for other schemes.
    The admin command must not create a store where there was none (opening one does)."""
    if url.startswith("file://"):
        return Path(unquote(urlsplit(url).path))
    if "://" not in url:
        return Path(url.split("?", 1)[0])
    return None


def classify(key: bytes, raw: bytes, secret: bytes | None, deep: bool = True) -> Entry:
    """What ``raw`` (the value stored under ``key``) is; ``deep``: also check every layer's CRC."""
    size = len(raw)
    if secret is not None:
        raw = unseal(secret, key, raw)
        if raw is None:
            return Entry(key, ValueKind.BAD_MAC, size)
    framed = read_frame(key, raw)
    if framed is None:
        return Entry(key, ValueKind.CORRUPT_FRAME, size)
    v1 = framed.version == 1  # no time, no tenant tag
    when, tag = (None, None) if v1 else (framed.written_at, framed.tenant_tag)
    payload = framed.payload
    if payload[:4] == GENERATION_MAGIC or len(payload) == LEGACY_GENERATION_BYTES:
        return Entry(key, ValueKind.GENERATION, size, when)
    if payload[:4] != MAGIC:
        return Entry(key, ValueKind.FOREIGN, size, when, tag)
    try:
        hdr = parse_header(payload, None, verify_payload=False)
    except ChunkError as e:
        return Entry(key, ValueKind.BAD_HEADER, size, when, tag, detail=str(e)[:200])
    try:
        for layer in range(hdr.layout.num_layers if deep else 0):
            layer_section(payload, hdr, layer, verify=True)
    except ChunkError as e:
        return Entry(key, ValueKind.BAD_LAYER_CRC, size, when, tag, detail=str(e)[:200])
    try:
        codec = codec_class(hdr.codec_id).name
    except KeyError:
        codec = f"unknown:{hdr.codec_id}"
    return Entry(
        key,
        ValueKind.V1_CHUNK if v1 else ValueKind.CHUNK,
        size,
        when,
        tag,
        hdr.fingerprint_digest.hex(),
        codec,
        hdr.num_tokens,
        hdr.num_tokens * hdr.layout.bytes_per_token(),
    )


def walk(
    adm: AdminStore, deep: bool = True, batch: int = 256, progress: Callable[[int], None] | None = None
) -> Iterator[Entry]:
    """Every value of the store, classified (values deleted meanwhile are skipped)."""
    for keys in adm.store.scan(batch):
        for key, raw in zip(keys, adm.store.get_many(keys), strict=True):
            if raw is not None:
                yield classify(key, raw, adm.secret, deep)
        if progress is not None:
            progress(len(keys))
