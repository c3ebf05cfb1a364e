"""``build_runtime``: the process's ``RemoteKVRuntime`` from the linker's build context (the first code
that sees the KV pool, the model and the TP rank; ``linker.RemoteKVLinker`` calls it once per scheduler
process). Decides every part, then builds the runtime once (``runtime.py``): the write codec, the pool's
one ``KVWriter`` (kernels warmed up before any request), the store client, the fetch paths (which write
into the linker's host staging), the write-back worker, and the layer-wise installs.

Threads: the scheduler thread, at start-up.
"""

from __future__ import annotations

import logging
import os
import threading

from sgl_remote_kv import metrics as metrics_mod
from sgl_remote_kv import preflight, runtime
from sgl_remote_kv.admission import AdmissionSettings
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch import layerwise, paths
from sgl_remote_kv.kvpool.staged import StagedPages, staging_plan
from sgl_remote_kv.kvpool.warmup import warm_up
from sgl_remote_kv.sglang_glue import seam
from sgl_remote_kv.store import generation
from sgl_remote_kv.store.base import redact_url
from sgl_remote_kv.writeback.worker import WriteBack

logger = logging.getLogger(__name__)


class WriteBackRequests:
    """The write-back's view of SGLang's requests (``writeback.worker.RequestReader``), through the seam's
    accessors."""

    def __init__(self, req_to_token_pool) -> None:
        self.req_to_token_pool = req_to_token_pool

    def rid(self, req) -> str:
        return seam.SchedulerHost.rid(req)

    def fill_ids(self, req) -> list[int]:
        return seam.req_fill_ids(req)

    def salt(self, req) -> str | None:
        return seam.req_salt(req)

    def kv_indices(self, req, lo: int, hi: int):
        return seam.req_kv_indices(self.req_to_token_pool, req, lo, hi)


def build_runtime(b: seam.BuildContext, cfg: RemoteKVConfig) -> runtime.RemoteKVRuntime:
    """The runtime over pool ``b.kvcache``; the fetch paths write into its host staging (``rt.staged``,
    the rows the linker loads from), which the waiting_for_KV queue may fill entirely."""
    fp = b.fingerprint
    codec = paths.write_codec(cfg, fp, b.rope)
    data_plane = cfg.mode in ("dpu", "auto") and codec.name != paths.HEVC
    preflight.check_chunk_fits(cfg.chunk_size, int(b.kvcache.size), fp.layout, data_plane)
    metrics = metrics_mod.get()
    kv_writer = seam.pool_writer(b.kvcache, fp.layout)
    warm = warm_up(kv_writer, [codec], fp)  # device pools: every kernel variant, before any request
    if warm.writes:
        logger.info(
            "KV writer kernels compiled for %s in %.2f s; load into the pool (GB/s of KV): %s",
            ", ".join(warm.writes + warm.encodes),
            warm.seconds,
            {kind: round(bps / 1e9, 1) for kind, bps in warm.load_bps.items()},
        )
    staged = build_staging(cfg, codec, kv_writer, int(b.kvcache.size), b.page_size)
    load_bps = warm.load_bps.get(f"codes:{codec.name}" if staged.writer.keep_codes else "kv", 0.0)
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
        on_staging_write=metrics.dataplane_write,
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
        WriteBackRequests(b.req_to_token_pool),
        cfg.writeback_queue_mb << 20,
        cpu_share=writeback_share(cfg, kv_writer),
        tail_granule=tails,
        versions=paths.chunk_versions(cfg, codec, fp, metrics.nvdec_written),
        processes=cfg.writeback_encoder == "process",
        nice=0 if kv_writer.device_dequant else ENCODER_NICE_HOST_POOL,
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
        load_bps=load_bps,
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


def build_staging(cfg: RemoteKVConfig, codec, kv_writer, pool_tokens: int, page_size: int) -> StagedPages:
    """The host staging the fetch paths write into: ``--remote-kv-staging-tokens`` rows (0: half the
    pool, at most ``STAGING_AUTO_MAX``), holding codes where every path delivers codes and the pool's
    writer dequantizes on the device (``staged.staging_plan``), its arena pinned in place for the load."""
    lay = kv_writer.layout
    rows = max(cfg.chunk_size, cfg.staging_tokens or min(pool_tokens // 2, STAGING_AUTO_MAX))
    plan = staging_plan(lay, kv_writer.device_dequant, codec, plain_paths(cfg, codec))
    staged = StagedPages(lay, rows, page_size, keep_codes=plan.keep_codes, nbytes=rows * plan.bytes_per_token)
    kv_writer.register_host(staged.writer.arena.array)  # device pools: the load uploads from where rows lie
    # a host pool: nothing pinned the arena's pages; fault them in now, in the background (no byte changes),
    # so a fresh server's first remote hit does not pay for it
    if not kv_writer.device_dequant:
        prefault = staged.writer.arena.prefault
        threading.Thread(target=prefault, name="srkv-staging-prefault", daemon=True).start()
    metrics_mod.get().staging(staged.writer.bytes_per_token, plan.keep_codes)
    for why in plan.reasons:
        logger.info("remote KV staging: %s", why)
    logger.info(
        "remote KV staging: %d rows holding %s, %.0f bytes per token (KV: %d), %.1f MiB",
        rows,
        "codes (dequantized on the device at load)" if plan.keep_codes else "KV",
        staged.writer.bytes_per_token,
        lay.bytes_per_token(),
        staged.writer.arena.nbytes / 2**20,
    )
    return staged


def writeback_share(cfg: RemoteKVConfig, kv_writer) -> float:
    """``--remote-kv-writeback-cpu``, or its default for this pool: paced (``WRITEBACK_CPU_HOST_POOL``) where
    the pool is in host memory, since the encode then takes the forward's own cores; on a device pool, whose
    host cores the forward does not use, unpaced threads on a quarter of the cores (the write-back must keep
    up with a GPU's prefill; the DPU data plane takes another quarter)."""
    if cfg.writeback_cpu is not None:
        return cfg.writeback_cpu
    if not kv_writer.device_dequant:
        return WRITEBACK_CPU_HOST_POOL
    return float(max(1, min(WRITEBACK_THREADS_MAX, len(os.sched_getaffinity(0)) // 4)))


def plain_paths(cfg: RemoteKVConfig, codec) -> list[str]:
    """Why some fetch path of this mode writes KV, not codes, into staging (one line per path)."""
    out = []
    if cfg.mode in ("nvdec", "auto"):
        out.append("the NVDEC path writes decoded frames as KV (its frames come back to host memory)")
    if not codec.device_dequant:
        out.append(f"codec {codec.name!r} has no device dequant stage: its paths decode on the host")
    elif cfg.mode in ("dpu", "auto") and cfg.dpu_output == "kv":
        out.append("--remote-kv-dpu-output kv: the data plane dequantizes on its host cores")
    return out


STAGING_AUTO_MAX = 65536  # tokens of the automatic staging size (--remote-kv-staging-tokens 0)
# the write-back's default share while serving where the pool is in host memory, whose cores the forward
# uses (its TPOT against --remote-kv off: docs/RESULTS.md, "The write-back")
WRITEBACK_CPU_HOST_POOL = 0.1
WRITEBACK_THREADS_MAX = 8  # the device-pool default's cap (a quarter of the cores)
# where the pool is in host memory, the write-back's encoder processes run at this niceness: the forward's
# threads take the cores first, the encode what they leave
ENCODER_NICE_HOST_POOL = 19
