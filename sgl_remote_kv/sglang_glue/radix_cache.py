"""``RemoteKVRadixCache``: SGLang's ``UnifiedRadixCache`` plus write-back to the remote tier.

Registered as radix cache backend ``remote_kv`` (``register_radix_cache_backend``); the plugin selects
it automatically when ``--remote-kv`` is on and no other ``--radix-cache-backend`` was given. The
factory builds the process's ``RemoteKVRuntime`` (it is the first code that sees the KV pool, the
model config and the TP rank) and then the cache through SGLang's own ``create_unified_radix_cache``
(so HiCache and every component keep working).

Reads (remote hits) do not go through ``match_prefix`` at all: the waiting_for_KV queue
(``sgl_remote_kv.admission``) fetches a request's remote chunks *before* the request is admitted and
installs them into this tree as ordinary device nodes. ``match_prefix`` then sees a plain device hit,
so there is never a network round trip inside it, ``init_load_back`` is never asked for remote tokens
(no "all or nothing" promise can be broken), and a failed fetch is simply a shorter device hit.

Writes: an AFTER hook on ``UnifiedRadixCache.checkpoint`` (scheduler thread, after each prefill chunk
and at finish; also on the linker integration's plain cache) hands the newly computed full chunks to the
write-back worker; ``release_host_resources`` (SGLang's graceful
scheduler exit) lets it store what it queued before the process ends.
"""

from __future__ import annotations

import logging
import threading

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_remote_kv import metrics as metrics_mod
from sgl_remote_kv import preflight, runtime
from sgl_remote_kv.admission import AdmissionSettings
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch import paths
from sgl_remote_kv.kvpool.warmup import warm_up
from sgl_remote_kv.sglang_glue import layerwise, seam
from sgl_remote_kv.sglang_glue.writeback import WriteBack
from sgl_remote_kv.store import generation
from sgl_remote_kv.store.base import redact_url
from sgl_remote_kv.types import FailureKind

logger = logging.getLogger(__name__)

BACKEND_NAME = "remote_kv"


class RemoteKVRadixCache(UnifiedRadixCache):
    tier_attached = False  # set by ``build`` once this cache's runtime is published

    def reset(self) -> None:
        """``/flush_cache`` (and SGLang's own resets): the local tree, then the tier's flush scope."""
        super().reset()
        rt = runtime.get()
        if self.tier_attached and rt is not None:
            rt.on_flush()

    def release_host_resources(self) -> None:
        """SGLang's graceful scheduler exit (``run_scheduler_process`` after a ``ShutdownReq``: a server's
        SIGTERM, ``Engine.shutdown`` with the tier on): the write-back drains first (``on_shutdown``)."""
        rt = runtime.get()
        if self.tier_attached and rt is not None:
            try:
                rt.on_shutdown()
            except Exception as e:  # boundary: SGLang's own release must still run
                rt.metrics.failure(FailureKind.WRITEBACK)
                logger.warning("remote-kv write-back drain at shutdown failed: %r", e)
        super().release_host_resources()


def after_checkpoint(result, cache, req, *args, up_to: int, **kwargs):
    """AFTER hook on ``UnifiedRadixCache.checkpoint`` (scheduler thread, after each prefill chunk and at
    finish; both integrations): hand the newly computed full chunks to the write-back worker."""
    rt = runtime.get()
    if rt is None or rt.writeback is None:
        return result
    try:
        rt.writeback.offer(req, up_to, final=seam.req_finished(req))
    except Exception as e:  # boundary: write-back must never break the scheduler
        rt.metrics.failure(FailureKind.WRITEBACK_OFFER)
        logger.warning("write-back offer failed for %s: %r", seam.SchedulerHost.rid(req), e)
    if seam.req_finished(req):
        rt.writeback.forget(seam.SchedulerHost.rid(req))
    return result


def build(ctx):
    """Radix cache factory (``TreeCacheBuildContext`` -> cache)."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    cache = create_unified_radix_cache(ctx, cache_class=RemoteKVRadixCache)
    cfg = RemoteKVConfig.current()
    if not cfg.enabled:
        return cache
    why = seam.tier_unsupported(ctx)
    if why is not None:  # a configuration SGLang accepts: the server runs, without the tier
        logger.warning("remote KV tier off: %s", why)
        return cache
    seam.check_version()
    try:
        runtime.publish(build_runtime(seam.build_context(ctx), cfg))
        cache.tier_attached = True
    except seam.UnsupportedPool as e:
        logger.warning("remote KV tier disabled: %s", e)
    except preflight.StartupError as e:  # impossible sizes: the server must not start (docs/RELIABILITY.md)
        logger.error("remote KV start-up error: %s", e)
        raise
    return cache


def build_runtime(b: seam.BuildContext, cfg: RemoteKVConfig, staged=None) -> runtime.RemoteKVRuntime:
    """Decide every part, then build the runtime once (``runtime.py``). ``staged`` (the linker
    integration's ``StagedPages``): the fetch paths write there, and the queue may fill all of it."""
    fp = b.fingerprint
    codec = paths.write_codec(cfg, fp, b.rope)
    data_plane = cfg.mode in ("dpu", "auto") and codec.name != paths.HEVC
    preflight.check_chunk_fits(cfg.chunk_size, int(b.kvcache.size), fp.layout, data_plane)
    metrics = metrics_mod.get()
    kv_writer = seam.pool_writer(b.kvcache, fp.layout)
    warm = warm_up(kv_writer, [codec], fp)  # device pools: every kernel variant, before any request
    if warm.writes:
        logger.info("KV writer kernels compiled for %s in %.2f s", ", ".join(warm.writes), warm.seconds)
    client = runtime.open_store_client(cfg)
    client.on_error = metrics.store_error  # store_errors_total{op,kind}
    client.on_breaker = metrics.store_breaker  # store_breaker_state{circuit}
    wakeup = threading.Event()
    parts = paths.PathParts(
        cfg,
        fp,
        codec,
        client,
        kv_writer if staged is None else staged.writer,
        wakeup,
        on_store_error=metrics.store_error,
        on_restart=metrics.dataplane_restart,
        on_pool_write=metrics.dataplane_write,
    )
    keys = runtime.KeySpace(fp, codec, cfg.chunk_size, generation.read(client, fp) or b"")
    tails = cfg.tail_granule if codec.sub_chunks else 0  # hevc: a frame layout per chunk size
    writeback = WriteBack(
        codec,
        fp,
        client,
        keys,
        metrics,
        kv_writer,
        b.req_to_token_pool,
        runtime.WRITEBACK_QUEUE,
        tail_granule=tails,
        versions=paths.chunk_versions(cfg, codec, fp, metrics.nvdec_written),
    )
    # the seam queue may hold half the pool (the default); the linker's staging is the queue's alone
    queue_share = (
        None if staged is None else AdmissionSettings(cfg.chunk_size, cfg.tail_granule, max_pool_fraction=1.0)
    )
    counter = None
    if cfg.layerwise and staged is None:  # the pool's layer counter: the forward waits on it per layer
        counter = layerwise.attach(b.kvcache, kv_writer, fp, metrics)
    elif cfg.layerwise:  # linker: installs into the staging rows, awaited by the linker's load thread
        counter = layerwise.LayerwiseInstalls(staged.writer, fp, metrics)
    rt = runtime.build(
        cfg,
        fp,
        codec,
        client,
        paths.build_paths(parts),
        wakeup,
        kv_writer=kv_writer,
        keys=keys,
        writeback=writeback,
        layerwise=counter,
        generation=generation.GenerationWatch(client, fp, keys),
        admission=queue_share,
        staged=staged,
    )
    logger.info(
        "remote KV tier ready: store %s, fetch paths %s, codec %r, chunk %d, layout %s",
        redact_url(cfg.resolved_store_url()),
        [p.value for p in rt.paths],
        codec,
        cfg.chunk_size,
        fp.layout,
    )
    return rt


def register() -> None:
    """Register the backend and the write-back hook (idempotent; every process, from the plugin's ``load``)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
        after_checkpoint,
        HookType.AFTER,
    )
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, build)
