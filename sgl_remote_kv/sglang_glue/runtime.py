"""Process-wide state of the remote KV tier inside one SGLang scheduler process.

Built once by the radix cache factory (``radix_cache.build``), which is the first place that knows the
KV pool, the model and the TP rank; the scheduler hooks pick it up with ``get()``. Holds the store
client, the codec, the model fingerprint, namespaces per tenant salt, the fetch backend, the
write-back worker, the policy and the metrics.

Tenant isolation: a request's ``cache_salt`` and ``extra_key`` (SGLang folds the LoRA id into
``extra_key``) go into the key namespace, so tenants never share chunk keys (and cannot probe each
other's prefixes by timing).

Threads: built and read on the scheduler thread; the objects it holds document their own threading.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field

from sgl_remote_kv.codec.base import Codec, default_codec, get_codec
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.kvpool import KVWriter
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.sglang_glue import metrics as metrics_mod
from sgl_remote_kv.sglang_glue.fetch import FetchBackend, InProcessFetchBackend
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import ClientConfig, StoreClient, open_client
from sgl_remote_kv.types import ModelFingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlueSettings:
    """Tunables of the glue that are not user flags (yet)."""

    lookup_timeout_s: float = 2.0  # a lookup slower than this is a miss (the request is released)
    # Upper cap of a fetch's life (and of a dedup follower's wait). Fetches are normally cancelled much
    # earlier by the policy: when they lose against recompute, or past a byte-scaled hang guard
    # (``policy.estimator``: abandon/timeout rules).
    fetch_timeout_s: float = 120.0
    writeback_queue: int = 64  # pending write-back jobs; more are dropped (never blocks serving)
    idle_wait_s: float = 0.005  # how long an otherwise idle scheduler waits for a fetch to finish
    use_dpu: bool = True  # --remote-kv dpu|auto: spawn the DPU data plane (in-process path if it fails)


@dataclass(frozen=True)
class FetchPath:
    """One way to get a prefix into the pool: a backend plus the codec it decodes. A path's chunks
    live under its codec's namespace (codec id + params are part of every key)."""

    name: str  # dpu | nvdec | inproc
    backend: FetchBackend
    codec: Codec
    closers: tuple = field(default=())  # extra resources to close with the backend (e.g. a pool)


def resolve_codec(name: str) -> Codec:
    """``default`` -> the codec package's default; anything else by registry name."""
    if name in ("", "default"):
        try:
            return default_codec()
        except (ImportError, KeyError) as e:  # default codec module not present in this build
            logger.warning("default codec unavailable (%r); using lossless", e)
            return get_codec("lossless")
    return get_codec(name)


def tenant_salt(cache_salt: str | None, extra_key: str | None) -> str | None:
    if cache_salt is None and extra_key is None:
        return None
    return json.dumps([cache_salt, extra_key])


class RemoteKVRuntime:
    def __init__(
        self,
        config: RemoteKVConfig,
        fingerprint: ModelFingerprint,
        codec: Codec,
        client: StoreClient,
        settings: GlueSettings | None = None,
        fetch_backend: FetchBackend | None = None,
        kv_writer: KVWriter | None = None,
    ) -> None:
        self.config = config
        self.settings = settings or GlueSettings()
        self.fingerprint = fingerprint
        self.codec = codec
        self.client = client
        self.metrics = metrics_mod.get()
        self.wakeup = threading.Event()  # set by workers when something completes
        self._namespaces: dict[tuple[str | None, str, bytes], bytes] = {}
        self.kv_writer = kv_writer  # the pool's one KVWriter (kvpool); every fetched write goes through it
        self.writer = None  # set by radix_cache.build (needs the pool)
        if fetch_backend is not None:
            self.set_paths([FetchPath("dpu", fetch_backend, codec)])
        else:
            self.set_paths([self.inproc_path()])

    def inproc_path(self) -> FetchPath:
        keep_codes = self.kv_writer is not None and self.kv_writer.device_dequant  # GPU dequant at install
        be = InProcessFetchBackend(
            self.client,
            self.codec,
            self.fingerprint,
            self.config.chunk_size,
            on_done=self.wakeup.set,
            keep_codes=keep_codes,
        )
        return FetchPath("inproc", be, self.codec)

    def set_paths(self, paths: list[FetchPath]) -> None:
        """Install the fetch paths (first = primary: the one whose codec write-back uses)."""
        old = getattr(self, "paths", {})
        self.paths = {p.name: p for p in paths}
        for name, p in old.items():
            if self.paths.get(name) is not p:
                _close_path(p)
        self.fetch_path = paths[0].name
        self.fetcher = paths[0].backend
        pcfg = PolicyConfig(
            mode=self.config.mode, margin=self.config.policy_margin, timeout_cap_s=self.settings.fetch_timeout_s
        )
        self.policy = Policy(pcfg, available=tuple(self.paths))

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def namespace(self, salt: str | None, codec: Codec | None = None) -> bytes:
        codec = codec or self.codec
        memo = (salt, codec.name, codec.params_bytes())
        ns = self._namespaces.get(memo)
        if ns is None:
            ns = keys_mod.namespace(self.fingerprint, codec.name, codec.params_bytes(), salt)
            if len(self._namespaces) < 4096:
                self._namespaces[memo] = ns
        return ns

    def keys_for(self, token_ids, n_chunks: int, salt: str | None, codec: Codec | None = None) -> list[bytes]:
        c = self.chunk_size
        return keys_mod.chunk_keys(self.namespace(salt, codec), list(token_ids[: n_chunks * c]), c)

    def close(self) -> None:
        for p in self.paths.values():
            _close_path(p)
        if self.writer is not None:
            self.writer.close()
        self.client.close()


def _close_path(p: FetchPath) -> None:
    p.backend.close()
    for c in p.closers:
        c.close()


_RUNTIME: RemoteKVRuntime | None = None


def install(rt: RemoteKVRuntime) -> None:
    global _RUNTIME
    _RUNTIME = rt


def get() -> RemoteKVRuntime | None:
    return _RUNTIME


def open_store_client(config: RemoteKVConfig) -> StoreClient:
    return open_client(config.resolved_store_url(), ClientConfig())
