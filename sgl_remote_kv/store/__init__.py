"""The remote KV tier's storage: keys, backends and the fault-tolerant client (see docs/STORE.md).

Importing this package never imports redis; backends load lazily by URL scheme.
"""

from .base import KVStore, StoreError, StoreStats, default_store_url, open_store
from .client import ClientConfig, StoreClient, open_client
from .keys import chunk_keys, namespace

__all__ = [
    "ClientConfig",
    "KVStore",
    "StoreClient",
    "StoreError",
    "StoreStats",
    "chunk_keys",
    "default_store_url",
    "namespace",
    "open_client",
    "open_store",
]
