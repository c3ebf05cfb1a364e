"""The remote KV tier of one SGLang scheduler process: built once, then read-only.

``assemble.build_runtime`` (the first code that sees the KV pool, the model and the TP rank) decides
everything first — store client, write codec, fetch paths, KV writer, write-back, layer-wise counter —
and then constructs one ``RemoteKVRuntime`` (``build``) and publishes it (``publish``). The scheduler
hooks read it through ``get()``; nothing mutates it afterwards.

Tenant isolation: a request's ``cache_salt`` and ``extra_key`` (SGLang folds the LoRA id into
``extra_key``) go into the key namespace (``KeySpace``), so tenants never share chunk keys (and cannot
probe each other's prefixes by timing).

Threads: built and read on the scheduler thread; the objects it holds document their own threading.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from sgl_remote_kv import metrics as metrics_mod
from sgl_remote_kv.admission import AdmissionSettings
from sgl_remote_kv.codec.base import Codec
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch.base import FetchPath
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import ClientConfig, StoreClient, open_client
from sgl_remote_kv.types import ModelFingerprint, PathName

logger = logging.getLogger(__name__)

WRITEBACK_DRAIN_S = 10.0  # /flush_cache and a graceful scheduler exit wait at most this long


class KeySpace:
    """Chunk keys of one deployment: namespace per (tenant salt, codec) within the store's current
    generation of the fingerprint (``keys.generation_key``), memoised. Scheduler thread only."""

    def __init__(
        self, fingerprint: ModelFingerprint, codec: Codec, chunk_size: int, generation: bytes = b""
    ) -> None:
        self.fingerprint, self.codec, self.chunk_size = fingerprint, codec, chunk_size
        self.generation = generation
        self._namespaces: dict[tuple[str | None, str, bytes], bytes] = {}

    def set_generation(self, generation: bytes) -> None:
        self.generation = generation
        self._namespaces.clear()

    def namespace(self, salt: str | None, codec: Codec | None = None) -> bytes:
        codec = codec or self.codec
        memo = (salt, codec.name, codec.params_bytes())
        ns = self._namespaces.get(memo)
        if ns is None:
            ns = keys_mod.namespace(self.fingerprint, codec.name, codec.params_bytes(), salt, self.generation)
            if len(self._namespaces) < 4096:
                self._namespaces[memo] = ns
        return ns

    def keys_for(self, token_ids, n_chunks: int, salt: str | None, codec: Codec | None = None) -> list[bytes]:
        c = self.chunk_size
        return keys_mod.chunk_keys(self.namespace(salt, codec), list(token_ids[: n_chunks * c]), c)

    def tail_keys(
        self, token_ids, region: int, prev: bytes | None, salt: str | None, codec: Codec | None, granule: int
    ) -> list[bytes]:
        """Keys of the ``granule``-token sub-chunks of chunk region ``region`` of ``token_ids``; ``prev``
        is the key of chunk ``region - 1`` (None for region 0: the namespace)."""
        c = self.chunk_size
        start = prev if prev is not None else self.namespace(salt, codec)
        return keys_mod.tail_keys(start, list(token_ids[region * c : (region + 1) * c]), granule)


@dataclass(frozen=True)
class RemoteKVRuntime:
    """Everything the hooks need, decided before construction (see module docstring)."""

    config: RemoteKVConfig
    fingerprint: ModelFingerprint
    codec: Codec  # the codec the write-back writes (and the primary path reads)
    client: StoreClient
    paths: Mapping[PathName, FetchPath]  # first = primary
    policy: Policy
    admission: AdmissionSettings
    keys: KeySpace
    wakeup: threading.Event  # set by workers when something completes
    metrics: object  # metrics.RemoteKVMetrics (the process's)
    kv_writer: object = None  # the pool's one KVWriter (kvpool); every fetched write goes through it
    writeback: object = None  # writeback.worker.WriteBack, or None (tests of the read path)
    layerwise: object = None  # layerwise.LayerwiseInstalls (--remote-kv-layerwise), or None
    generation: object = None  # generation.GenerationWatch (follows other servers' tier flushes), or None
    # kvpool.staged.StagedPages: the linker's host staging, which the fetch paths write into (``kv_writer``
    # stays the pool's: the linker's loads and the write-back's reads); None only in read-path tests
    staged: object = None

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def primary(self) -> FetchPath:
        return next(iter(self.paths.values()))

    def on_flush(self) -> None:
        """``/flush_cache`` emptied the local cache (scheduler thread; SGLang flushes only when idle).
        First the write-back finishes what it queued (at most ``WRITEBACK_DRAIN_S``), so a prompt served
        before the flush is in the store right after it. ``--remote-kv-flush tier``: then write a new
        store generation, so every chunk stored before it is unreachable — on this server at once, on
        others sharing the store within their ``generation.POLL_S`` (``generation.GenerationWatch``)."""
        if not self._drain_writeback():
            logger.warning(
                "flush: the write-back did not drain in %.0f s; its remaining chunks land later",
                WRITEBACK_DRAIN_S,
            )
        if self.config.flush != "tier":
            return
        generation = keys_mod.GENERATION_MAGIC + os.urandom(16)
        stored = self.client.put_many([(keys_mod.generation_key(self.fingerprint), generation)])
        self.keys.set_generation(generation)
        if self.generation is not None:
            self.generation.forget_pending()
        if stored:
            logger.info("flush: remote tier retired (new store generation %s)", generation.hex()[:8])
        else:
            logger.warning(
                "flush: the store did not take the new generation; only this server retired its chunks"
            )

    def on_shutdown(self) -> None:
        """A graceful scheduler exit (scheduler thread, after its event loop ended): a server's SIGTERM, or
        ``sglang.Engine.shutdown`` with the tier on (``engine_api``). The write-back stores what it queued,
        waiting at most ``WRITEBACK_DRAIN_S``, so the tail of the last request is in the store once the
        process is gone; what is still queued after that is lost (logged). Then the fetch paths close
        (nothing fetches after the scheduler's loop ended): a DPU client attached to a data-plane service
        says ``Goodbye``, so the service logs one INFO detach line instead of dropping a silent client
        with a WARNING ``--client-timeout`` later; a spawned data plane is stopped with SIGTERM."""
        t0 = time.monotonic()
        try:
            if self._drain_writeback():
                logger.info("shutdown: write-back drained in %.2f s", time.monotonic() - t0)
            else:
                logger.warning(
                    "shutdown: the write-back did not drain in %g s; %d queued jobs are lost",
                    WRITEBACK_DRAIN_S,
                    self.writeback.pending(),
                )
        finally:
            self._close_paths()

    def _close_paths(self) -> None:
        """Close every fetch path (idempotent: ``close`` closes them again); a failure is logged, the
        other paths still close."""
        for p in self.paths.values():
            try:
                p.close()
            except Exception as e:  # boundary (shutdown): one path must not keep the others open
                logger.warning("closing fetch path %s at shutdown failed: %r", p.name.value, e)

    def _drain_writeback(self) -> bool:
        return self.writeback is None or self.writeback.flush(WRITEBACK_DRAIN_S)

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()
        self._close_paths()
        if self.writeback is not None:
            self.writeback.close()
        self.client.close()


def build(
    config: RemoteKVConfig,
    fingerprint: ModelFingerprint,
    codec: Codec,
    client: StoreClient,
    paths: list[FetchPath],
    wakeup: threading.Event,
    *,
    kv_writer=None,
    keys: KeySpace | None = None,
    writeback=None,
    layerwise=None,
    generation=None,
    admission: AdmissionSettings | None = None,
    staged=None,
    load_bps: float = 0.0,
) -> RemoteKVRuntime:
    """The runtime over decided parts; the policy is built here from the paths and the config
    (``load_bps``: the measured rate of the load into a device pool, ``PolicyConfig.load_bps``)."""
    if not paths:
        raise ValueError("a runtime needs at least one fetch path")
    admission = admission or AdmissionSettings(chunk_size=config.chunk_size, tail_granule=config.tail_granule)
    pcfg = PolicyConfig(
        mode=config.mode,
        margin=config.policy_margin,
        timeout_cap_s=admission.fetch_timeout_s,
        load_bps=load_bps,
    )
    by_name = {p.name: p for p in paths}
    return RemoteKVRuntime(
        config=config,
        fingerprint=fingerprint,
        codec=codec,
        client=client,
        paths=by_name,
        policy=Policy(
            pcfg,
            available=tuple(p.value for p in by_name),
            estimators={p.name.value: p.estimate for p in paths if p.estimate is not None},
        ),
        admission=admission,
        keys=keys or KeySpace(fingerprint, codec, config.chunk_size),
        wakeup=wakeup,
        metrics=metrics_mod.get(),
        kv_writer=kv_writer,
        writeback=writeback,
        layerwise=layerwise,
        generation=generation,
        staged=staged,
    )


_RUNTIME: RemoteKVRuntime | None = None


def publish(rt: RemoteKVRuntime) -> None:
    global _RUNTIME
    _RUNTIME = rt


def get() -> RemoteKVRuntime | None:
    """The process's runtime (None while the tier is off): the hooks' one accessor."""
    return _RUNTIME


def open_store_client(config: RemoteKVConfig) -> StoreClient:
    return open_client(config.resolved_store_url(), ClientConfig())
