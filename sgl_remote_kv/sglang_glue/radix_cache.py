"""``RemoteKVRadixCache``: SGLang's ``UnifiedRadixCache`` plus write-back to the remote tier.

Registered as radix cache backend ``remote_kv`` (``register_radix_cache_backend``); the plugin selects
it automatically when ``--remote-kv`` is on and no other ``--radix-cache-backend`` was given. The
factory builds the process's ``RemoteKVRuntime`` (it is the first code that sees the KV pool, the
model config and the TP rank) and then the cache through SGLang's own ``create_unified_radix_cache``
(so HiCache and every component keep working).

Reads (remote hits) do not go through ``match_prefix`` at all: the waiting_for_KV queue
(``waiting_queue.py``) fetches a request's remote chunks *before* the request is admitted and
installs them into this tree as ordinary device nodes. ``match_prefix`` then sees a plain device hit,
so there is never a network round trip inside it, ``init_load_back`` is never asked for remote tokens
(no "all or nothing" promise can be broken), and a failed fetch is simply a shorter device hit.

Writes: ``checkpoint`` (called by the scheduler thread after each prefill chunk and at finish) hands
the newly computed full chunks to the write-back worker.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sgl_remote_kv import preflight
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.sglang_glue import kv_io, paths, runtime
from sgl_remote_kv.sglang_glue.writeback import WriteBack
from sgl_remote_kv.types import FailureKind

logger = logging.getLogger(__name__)

BACKEND_NAME = "remote_kv"


class RemoteKVRadixCache(UnifiedRadixCache):
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        super().checkpoint(req, up_to=up_to, **kwargs)
        rt = runtime.get()
        if rt is None or rt.writer is None:
            return
        try:
            rt.writer.offer(req, req.full_untruncated_fill_ids, up_to)
        except Exception as e:  # boundary: write-back must never break the scheduler
            rt.metrics.failure(FailureKind.WRITEBACK_OFFER)
            logger.warning("write-back offer failed for %s: %r", req.rid, e)
        if req.finished():
            rt.writer.forget(req.rid)


def build(ctx):
    """Radix cache factory (``TreeCacheBuildContext`` -> cache)."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    cache = create_unified_radix_cache(ctx, cache_class=RemoteKVRadixCache)
    cfg = RemoteKVConfig.current()
    if not cfg.enabled:
        return cache
    try:
        _install_runtime(ctx, cfg)
    except kv_io.UnsupportedPool as e:
        logger.warning("remote KV tier disabled: %s", e)
    except preflight.StartupError as e:  # impossible sizes: the server must not start (docs/RELIABILITY.md)
        logger.error("remote KV start-up error: %s", e)
        raise
    return cache


def _install_runtime(ctx, cfg: RemoteKVConfig) -> None:
    params = ctx.params
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    archs = getattr(ctx.model_config.hf_config, "architectures", None) or ["unknown"]
    fp = kv_io.fingerprint_for(kvcache, archs[0], ctx.server_args.model_path, ctx.tp_rank, ctx.tp_size)
    codec = paths.write_codec(cfg)
    data_plane = cfg.mode in ("dpu", "auto") and codec.name != paths.HEVC
    preflight.check_chunk_fits(cfg.chunk_size, int(kvcache.size), fp.layout, data_plane)
    kv_writer = kv_io.pool_writer(kvcache, fp.layout)
    rt = runtime.RemoteKVRuntime(cfg, fp, codec, runtime.open_store_client(cfg), kv_writer=kv_writer)
    rt.client.on_error = rt.metrics.store_error  # store_errors_total{op,kind}
    paths.install_paths(rt)
    if "dpu" in rt.paths:  # the data plane's own store client: its failures arrive per chunk
        rt.paths["dpu"].backend.client.on_store_error = rt.metrics.store_error
    rt.writer = WriteBack(rt, kv_writer, params.req_to_token_pool, rt.settings.writeback_queue)
    runtime.install(rt)
    logger.info(
        "remote KV tier ready: store %s, fetch paths %s, codec %r, chunk %d, layout %s",
        cfg.resolved_store_url(),
        list(rt.paths),
        codec,
        cfg.chunk_size,
        fp.layout,
    )


def register() -> None:
    """Register the backend (idempotent; runs in every process from the plugin's ``load``)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, build)
