"""Prefix-chain chunk keys and key namespaces.

A prompt's tokens are cut into chunks of ``chunk_size`` tokens; only full chunks get keys. The key of
chunk i is ``h_i = sha256(h_{i-1} || token ids of chunk i as little-endian uint32)`` with
``h_{-1} = namespace``. Equal prefixes therefore give equal keys on every process and host, a key
identifies its whole prefix (not just its own chunk), and "how many leading chunks exist" is a
question about a key list (``KVStore.count_prefix``). No Python ``hash()`` is used anywhere: its seed
differs per process.

The namespace folds in everything that makes stored KV incompatible: the model fingerprint (weights
identity, architecture, KV layout and dtype, TP rank and size), the codec id and parameters, and an
optional tenant salt, so two tenants never share keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from ..types import ModelFingerprint

_NS_TAG = b"sgl-remote-kv/namespace/v1"
_TAIL_TAG = b"sgl-remote-kv/tail/v1"
_GENERATION_TAG = b"sgl-remote-kv/generation/v1"


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def tenant_salt(cache_salt: str | None, extra_key: str | None) -> str | None:
    """The tenant salt of a request's cache salt and extra key (SGLang folds the LoRA id into the
    latter); None for the shared namespace. Injective: JSON of the pair."""
    if cache_salt is None and extra_key is None:
        return None
    return json.dumps([cache_salt, extra_key])


def namespace(
    fingerprint: ModelFingerprint,
    codec_id: str,
    codec_params: str | bytes,
    tenant_salt: str | None = None,
    generation: bytes = b"",
) -> bytes:
    """32-byte namespace digest. Fields are length-prefixed, so no two field tuples collide.

    ``tenant_salt=None`` (shared cache) and ``tenant_salt=""`` are distinct namespaces. ``generation``
    (the store's current generation of this fingerprint, see ``generation_key``; empty until a
    ``--remote-kv-flush tier`` flush) is folded in only when non-empty, so generation 0 keeps the keys of
    earlier releases.
    """
    if not codec_id:
        raise ValueError("codec_id must be non-empty")
    params = codec_params.encode() if isinstance(codec_params, str) else bytes(codec_params)
    h = hashlib.sha256(_NS_TAG)
    h.update(_field(fingerprint.digest()))
    h.update(_field(codec_id.encode()))
    h.update(_field(params))
    if tenant_salt is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + _field(tenant_salt.encode()))
    if generation:
        h.update(b"\x02" + _field(generation))
    return h.digest()


TENANT_TAG_BYTES = 8
SHARED_TAG = bytes(TENANT_TAG_BYTES)  # the shared namespace (no tenant salt)
GENERATION_MAGIC = b"SKVG"  # a generation value is this magic + 16 random bytes (never a chunk blob)


def tenant_tag(salt: str | None) -> bytes:
    """8-byte tag of a tenant salt, stored beside each chunk value (store framing v2) so an operator can
    count and evict per tenant: one-way (the salt is not recoverable from it), zeros for the shared
    namespace. Computing it needs the salt, i.e. the tenant's ``cache_salt`` / ``extra_key``."""
    if salt is None:
        return SHARED_TAG
    return hashlib.sha256(b"sgl-remote-kv/tenant-tag/v1" + salt.encode()).digest()[:TENANT_TAG_BYTES]


def generation_key(fingerprint: ModelFingerprint) -> bytes:
    """Store key of the fingerprint's generation: a random token written by a ``tier`` flush; every key
    namespace of the fingerprint folds it in, so a new generation retires all chunks stored before it
    (they age out of the store like any unused value)."""
    return hashlib.sha256(_GENERATION_TAG + _field(fingerprint.digest())).digest()


def chunk_keys(namespace: bytes, token_ids: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """Keys of the full ``chunk_size``-token chunks of ``token_ids`` (a trailing partial chunk has none)."""
    return _chain(namespace, token_ids, chunk_size)


def tail_keys(prev: bytes, token_ids: Sequence[int] | np.ndarray, granule: int) -> list[bytes]:
    """Keys of the tail *sub-chunks* of one chunk's region: ``token_ids`` are the region's tokens (fewer
    than a chunk's), ``prev`` the key of the chunk before the region (the namespace for region 0). The
    chain starts at ``sha256(TAIL_TAG || prev || granule)``, so sub-chunk keys never equal chunk keys and
    each one still identifies the whole prefix it ends."""
    if len(prev) != 32:
        raise ValueError(f"prev must be a 32-byte key, got {len(prev)} bytes")
    if granule <= 0:
        raise ValueError(f"granule must be positive, got {granule}")
    start = hashlib.sha256(_TAIL_TAG + prev + granule.to_bytes(4, "little")).digest()
    return _chain(start, token_ids, granule)


def _chain(namespace: bytes, token_ids: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if len(namespace) != 32:
        raise ValueError(f"namespace must be a 32-byte digest, got {len(namespace)} bytes")
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {ids.shape}")
    n_full = len(ids) // chunk_size
    if n_full == 0:
        return []
    if ids.dtype.kind not in "iu" and len(ids):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    ids = ids[: n_full * chunk_size]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    raw = ids.astype("<u4", copy=False).tobytes()
    step = 4 * chunk_size
    keys: list[bytes] = []
    prev = namespace
    for i in range(n_full):
        prev = hashlib.sha256(prev + raw[i * step : (i + 1) * step]).digest()
        keys.append(prev)
    return keys
