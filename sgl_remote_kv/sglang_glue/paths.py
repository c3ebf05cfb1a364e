"""Which fetch paths a deployment runs, and which codec it writes (``--remote-kv dpu|nvdec|inproc|auto``).

One codec is *written* per deployment (write-back uses the primary path's codec); reads may use
several paths, each under its own codec's namespace (codec id + params are in every key, so chunks of
different codecs never collide):

- ``dpu``: write the configured codec (``default`` = the quantized default); read through the DPU data
  plane (in-process path if it cannot start).
- ``nvdec``: write ``hevc`` (``--remote-kv-codec default`` resolves to hevc: NVDEC decodes video only);
  read through ``NvdecFetchBackend`` over a ``DecoderPool`` of ``--remote-kv-nvdec-instances``. An
  explicit non-hevc codec cannot be decoded by NVDEC: a warning, then the in-process path.
- ``inproc``: write the configured codec like ``dpu``; read and decode on worker threads *inside the
  serving process* (``InProcessFetchBackend``). The CacheGen-Async-like baseline the interference
  measurement compares the DPU against (decode competes with the forward pass for the same cores
  and the GIL); also the fallback of the other modes.
- ``auto``: write the configured codec like ``dpu`` and read it through the DPU data plane; *also*
  read hevc chunks (written by ``nvdec`` servers sharing the store) through the NVDEC pool. The policy
  picks per request among the paths that have the prefix, and recompute. (The DPU pipeline cannot
  decode hevc — its ``lossless_stage`` needs the chunk header — so with ``--remote-kv-codec hevc``,
  auto reads hevc through NVDEC and the in-process path.)

Threads: built once on the scheduler thread by ``radix_cache.build``.
"""

from __future__ import annotations

import logging

from sgl_remote_kv.codec.base import Codec, get_codec
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.sglang_glue.runtime import FetchPath, RemoteKVRuntime, resolve_codec

logger = logging.getLogger(__name__)

HEVC = "hevc"


def write_codec(cfg: RemoteKVConfig) -> Codec:
    """The codec this deployment writes (and its primary path reads)."""
    if cfg.mode == "nvdec" and cfg.codec in ("", "default"):
        return get_codec(HEVC)
    return resolve_codec(cfg.codec)


def nvdec_path(rt: RemoteKVRuntime, codec: Codec) -> FetchPath:
    from sgl_remote_kv.nvdec.fetch_nvdec import NvdecFetchBackend
    from sgl_remote_kv.nvdec.pool import DecoderPool

    device, gpu_id, instances = _decoder_device(rt)
    pool = DecoderPool(instances=instances, device=device, gpu_id=gpu_id)
    be = NvdecFetchBackend(
        rt.client, pool, codec, rt.fingerprint, rt.chunk_size, rt.kv_writer, on_done=rt.wakeup.set
    )
    return FetchPath("nvdec", be, codec, closers=(pool,))


def _decoder_device(rt: RemoteKVRuntime) -> tuple[str, int, int]:
    """(device, gpu id, instances) of the decoder pool: NVDEC through PyNvVideoCodec, one decoder per
    engine, when the KV pool is on a GPU whose NVDEC decodes 8-bit 4:4:4 HEVC; FFmpeg's software decoder
    (``--remote-kv-nvdec-instances`` threads) otherwise, on the same bitstreams."""
    dev = rt.kv_writer.pool.k[0].device if rt.kv_writer is not None else None
    if dev is None or dev.type != "cuda":
        return "cpu", 0, rt.config.nvdec_instances
    from sgl_remote_kv.nvdec import nvcodec

    gpu = dev.index or 0
    reason = nvcodec.unavailable_reason(gpu)
    if reason is not None:
        logger.warning("NVDEC unusable on GPU %d (%s): software HEVC decoding", gpu, reason)
        return "cpu", 0, rt.config.nvdec_instances
    return "cuda", gpu, nvcodec.nvdec_engines(gpu)


def _dpu_or_inproc(rt: RemoteKVRuntime) -> FetchPath:
    if rt.codec.name != HEVC and rt.settings.use_dpu:
        from sgl_remote_kv.sglang_glue.fetch_dpu import start_dpu_backend

        be = start_dpu_backend(rt.config, rt.fingerprint, rt.codec, rt.kv_writer, on_done=rt.wakeup.set)
        if be is not None:
            return FetchPath("dpu", be, rt.codec)
    return rt.paths.get("inproc") or rt.inproc_path()


def install_paths(rt: RemoteKVRuntime) -> None:
    """Replace the runtime's default in-process path with the mode's paths."""
    mode = rt.config.mode
    if mode == "inproc":
        rt.set_paths([rt.paths.get("inproc") or rt.inproc_path()])
    elif mode == "dpu":
        rt.set_paths([_dpu_or_inproc(rt)])
    elif mode == "nvdec":
        if rt.codec.name == HEVC:
            rt.set_paths([nvdec_path(rt, rt.codec)])
        else:
            logger.warning("--remote-kv nvdec needs the hevc codec, got %r: in-process path", rt.codec.name)
    elif mode == "auto":
        if rt.codec.name == HEVC:
            rt.set_paths([nvdec_path(rt, rt.codec), rt.paths.get("inproc") or rt.inproc_path()])
        else:
            rt.set_paths([_dpu_or_inproc(rt), nvdec_path(rt, get_codec(HEVC))])
    logger.info("remote KV fetch paths: %s", {n: p.codec.name for n, p in rt.paths.items()})
