"""Authenticated remote KV values: a shared-secret MAC bound to the chunk key.

Threat: a store that others can write to (a shared Redis, a world-writable directory). Without a
secret the tier already rejects anything malformed or foreign (client framing CRC, codec header and
section CRCs, model fingerprint); it cannot reject a *well-formed* blob that someone wrote under the
wrong key (a replay: another prompt's KV served for this prompt). With ``--remote-kv-auth-key-file``
every value carries ``HMAC-SHA256(secret, tag || len(key) || key || value)``; a value whose MAC does
not verify under the key it was read from is a miss, so a writer without the secret can at worst cost a
recompute, never change an answer: ``get_many`` returns it as a ``store.base.CorruptValue``, which the
store client counts as a corrupt value (``store_errors_total{op="get",kind="corrupt"}``), logs
(rate-limited, ``store/corruption.py``) and deletes; ``stats().extra["auth_rejected"]`` counts them too.

Where: the MAC is applied by ``AuthenticatedStore``, a ``KVStore`` wrapper selected by the store URL
prefix ``auth+`` (``auth+redis://h:p/0?auth_key_file=/etc/srkv.key``). The store layer is the one
place every path shares that knows the chunk key of a value: the write-back, the in-process fetch and
the DPU data plane (a separate process that opens the store from the URL) all get it with no change
to the codec API. ``RemoteKVConfig.resolved_store_url`` adds the prefix when the flag is set.

Key file: raw bytes or hex text, at least ``MIN_KEY_BYTES`` bytes of secret, at most
``MAX_KEY_FILE_BYTES``; errors are ``AuthKeyError`` (a ``ValueError``) naming the file.

Threads: ``AuthenticatedStore`` is as thread-safe as its inner store (the key is immutable).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import stat
import string
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from sgl_remote_kv.store.base import CorruptValue, KVStore, StoreStats, open_store, redact_url

logger = logging.getLogger(__name__)

AUTH_PREFIX = "auth+"
KEY_FILE_OPTION = "auth_key_file"
TAG = b"sgl-remote-kv/auth/v1"
MAC_LEN = 32
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


class AuthKeyError(ValueError):
    """The auth key file is missing, unreadable, too short or too long."""


def load_auth_key(path: str | Path) -> bytes:
    """The secret in ``path``: hex text (whitespace stripped) or raw bytes; see module docstring."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise AuthKeyError(f"auth key file {str(p)!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AuthKeyError(f"auth key file {str(p)!r} is not a regular file")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise AuthKeyError(f"auth key file {str(p)!r} is {st.st_size} bytes (max {MAX_KEY_FILE_BYTES})")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise AuthKeyError(f"auth key file {str(p)!r}: {e.strerror or e}") from None
    key = _decode_key(raw)
    if len(key) < MIN_KEY_BYTES:
        raise AuthKeyError(
            f"auth key file {str(p)!r} holds {len(key)} bytes of secret; need >= {MIN_KEY_BYTES}"
        )
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        logger.warning("auth key file %s is accessible by every user; chmod 600 it", p)
    return key


def _decode_key(raw: bytes) -> bytes:
    text = raw.strip()
    hexdigits = set(string.hexdigits.encode())
    if text and len(text) % 2 == 0 and all(b in hexdigits for b in text):
        return bytes.fromhex(text.decode("ascii"))
    return raw


def mac(secret: bytes, chunk_key: bytes, value) -> bytes:
    """HMAC-SHA256 of ``value`` bound to ``chunk_key`` (length-prefixed, domain-separated)."""
    m = hmac.new(secret, TAG + struct.pack("<Q", len(chunk_key)) + bytes(chunk_key), hashlib.sha256)
    m.update(value)
    return m.digest()


def seal(secret: bytes, chunk_key: bytes, value) -> bytes:
    """``value || mac``."""
    return bytes(value) + mac(secret, chunk_key, value)


def unseal(secret: bytes, chunk_key: bytes, blob) -> bytes | None:
    """The value of a sealed blob, or ``None`` if it is too short or its MAC does not verify."""
    if blob is None or len(blob) < MAC_LEN:
        return None
    view = memoryview(blob)
    value, tag = view[: len(view) - MAC_LEN], view[len(view) - MAC_LEN :]
    if not hmac.compare_digest(mac(secret, chunk_key, value), bytes(tag)):
        return None
    return bytes(value)


class AuthenticatedStore:
    """``KVStore`` wrapper: seals on put, verifies on get (a failed check is a ``CorruptValue``: a miss)."""

    def __init__(self, inner: KVStore, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise AuthKeyError(f"auth secret must be >= {MIN_KEY_BYTES} bytes")
        self.inner = inner
        self._secret = secret
        self._lock = threading.Lock()
        self._rejected = 0

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        # Presence only: a forged value here costs one fetch, which then fails the MAC check.
        return self.inner.count_prefix(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        values = self.inner.get_many(keys)
        out: list[bytes | None] = []
        bad = 0
        for k, v in zip(keys, values, strict=True):
            value = unseal(self._secret, k, v) if v is not None else None
            if v is not None and value is None:
                bad += 1
                value = CorruptValue("its MAC does not verify (not written with this secret, or changed)")
            out.append(value)
        if bad:
            with self._lock:
                self._rejected += bad
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self.inner.put_many([(k, seal(self._secret, k, v)) for k, v in items])

    def delete_many(self, keys: Sequence[bytes]) -> None:
        self.inner.delete_many(keys)

    def scan(self, batch: int = 512):
        """The inner store's keys (admin walks; values are not checked here: ``admin.scan`` does)."""
        return self.inner.scan(batch)

    def stats(self) -> StoreStats:
        inner = self.inner.stats()
        with self._lock:
            rejected = self._rejected
        return dataclasses.replace(
            inner, backend=f"auth+{inner.backend}", extra={**inner.extra, "auth_rejected": rejected}
        )

    def close(self) -> None:
        self.inner.close()


def auth_store_url(store_url: str, key_file: str) -> str:
    """``store_url`` wrapped so ``open_store`` returns an ``AuthenticatedStore`` keyed by ``key_file``."""
    if "://" not in store_url:
        path, sep, query = store_url.partition("?")
        store_url = Path(path).resolve().as_uri() + sep + query
    sep = "&" if "?" in store_url else "?"
    return AUTH_PREFIX + store_url + sep + urlencode([(KEY_FILE_OPTION, str(key_file))])


def split_auth_url(url: str) -> tuple[str, str]:
    """``auth+<inner>?auth_key_file=P`` -> (inner url without the option, P); ``ValueError`` if absent.

    Plain string surgery (not ``urlsplit``/``urlunsplit``, which would drop the ``//`` of an empty
    authority in ``faulty+file:///x``)."""
    if not url.lower().startswith(AUTH_PREFIX):
        raise ValueError(f"store URL {redact_url(url)!r} does not start with {AUTH_PREFIX!r}")
    base, _, query = url[len(AUTH_PREFIX) :].partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    key_files = [v for k, v in pairs if k == KEY_FILE_OPTION]
    if len(key_files) != 1 or not key_files[0]:
        raise ValueError(f"store URL {redact_url(url)!r}: needs exactly one {KEY_FILE_OPTION}=PATH option")
    rest = urlencode([(k, v) for k, v in pairs if k != KEY_FILE_OPTION])
    return base + ("?" + rest if rest else ""), key_files[0]


def open_auth_store(url: str) -> AuthenticatedStore:
    """Factory for ``auth+<inner url>?auth_key_file=PATH`` (see ``store.base`` registry)."""
    inner_url, key_file = split_auth_url(url)
    return AuthenticatedStore(open_store(inner_url), load_auth_key(key_file))
