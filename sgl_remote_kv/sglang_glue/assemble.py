"""``build_runtime``: the process's ``RemoteKVRuntime`` from the linker's build context (the first code
that sees the KV pool, the model and the TP rank; ``linker.RemoteKVLinker`` calls it once per scheduler
process). Decides every part, then builds the runtime once (``runtime.py``): the write codec, the pool's
one ``KVWriter`` (kernels warmed up before any request), the store client, the fetch paths (which write
into the linker's host staging), the write-back worker, and the layer-wise installs.

Threads: the scheduler thread, at start-up.
"""

from __future__ import annotations

import logging
import threading

from sgl_remote_kv import metrics as metrics_mod
from sgl_remote_kv import preflight, runtime
from sgl_remote_kv.admission import AdmissionSettings
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch import layerwise, paths
from sgl_remote_kv.kvpool.staged import StagedPages
from sgl_remote_kv.kvpool.warmup import warm_up
from sgl_remote_kv.sglang_glue import seam
from sgl_remote_kv.sglang_glue.writeback import WriteBack
from sgl_remote_kv.store import generation
from sgl_remote_kv.store.base import redact_url

logger = logging.getLogger(__name__)


def build_runtime(b: seam.BuildContext, cfg: RemoteKVConfig, staged: StagedPages) -> runtime.RemoteKVRuntime:
    """The runtime over pool ``b.kvcache``; the fetch paths write into ``staged`` (host rows the linker
    loads from), which the waiting_for_KV queue may fill entirely."""
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
        staged.writer,
        wakeup,
        on_store_error=metrics.store_error,
        on_restart=metrics.dataplane_restart,
        on_pool_write=metrics.dataplane_write,
        pool_device=kv_writer.pool.k[0].device,
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
    # layer-wise: installs into the staging rows, awaited by the linker's load thread before each copy
    counter = layerwise.LayerwiseInstalls(staged.writer, fp, metrics) if cfg.layerwise else None
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
        admission=AdmissionSettings(cfg.chunk_size, cfg.tail_granule, max_pool_fraction=1.0),
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
