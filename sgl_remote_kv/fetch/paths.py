"""Which fetch paths a deployment runs, and which codec it writes (``--remote-kv dpu|nvdec|inproc|auto``).

One codec is *written* per deployment (write-back uses the primary path's codec); reads may use
several paths, each under its own codec's namespace (codec id + params are in every key, so chunks of
different codecs never collide):

- ``dpu``: write the configured codec (``default`` = the quantized default); read through the DPU data
  plane (in-process path if it cannot start).
- ``nvdec``: write ``hevc`` (``--remote-kv-codec default`` resolves to hevc: NVDEC decodes video only),
  each chunk at every ``--remote-kv-nvdec-resolutions`` (``chunk_versions``); read through
  ``NvdecFetchBackend`` over a ``DecoderPool`` of ``--remote-kv-nvdec-instances``, each chunk at the
  resolution KVFetcher's Alg. 1 picks (``nvdec/adapter.py``; decode table profiled at start-up on that
  pool, ``nvdec/profile.py``) unless ``--remote-kv-nvdec-fetch`` fixes one. An
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

Threads: built once on the scheduler thread by ``assemble.build_runtime``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sgl_remote_kv.codec.base import Codec, default_codec, get_codec
from sgl_remote_kv.codec.calibration import CalibrationError
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.codec.transform import TransformCodec
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch.base import FetchPath
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.store.client import StoreClient
from sgl_remote_kv.types import DEFAULT_QUALITY, SCALAR_QUANTIZER, ModelFingerprint, PathName, RopeSpec

logger = logging.getLogger(__name__)

HEVC = "hevc"


def resolve_codec(
    name: str,
    fingerprint: ModelFingerprint | None = None,
    rope: RopeSpec | None = None,
    quality: str = DEFAULT_QUALITY,
    entropy: str = "deflate",
    quantizer: str = SCALAR_QUANTIZER,
) -> Codec:
    """The codec a deployment writes. ``default``: the transform codec of the model's calibration at
    ``quality`` (needs ``fingerprint`` and the model's ``rope``) with ``entropy`` as its lossless stage
    (``deflate``: what a DPU inflates; ``zstd``: faster to decode on a CPU; ``rans``: smaller, scalar
    symbols only), or, when the model
    has no usable calibration, the default quantized codec (logged once, naming the command that calibrates);
    ``transform``: the same, but a missing calibration is logged as an error; anything else by registry
    name."""
    if name in ("", "default", "transform"):
        try:
            if fingerprint is None or rope is None:
                raise CalibrationError("no model RoPE the transform codec can undo")
            return TransformCodec.for_model(fingerprint, quality, entropy, rope=rope, quantizer=quantizer)
        except CalibrationError as e:
            log = logger.error if name == "transform" else logger.warning
            log("transform codec unavailable, writing %s instead: %s", default_codec().name, e)
        try:
            return default_codec()
        except (ImportError, KeyError) as e:  # default codec module not present in this build
            logger.warning("default codec unavailable (%r); using lossless", e)
            return get_codec("lossless")
    return get_codec(name)


def write_codec(
    cfg: RemoteKVConfig, fingerprint: ModelFingerprint | None = None, rope: RopeSpec | None = None
) -> Codec:
    """The codec this deployment writes (and its primary path reads)."""
    if cfg.mode == "nvdec" and cfg.codec in ("", "default"):
        return get_codec(HEVC)
    entropy = cfg.entropy if cfg.entropy != "default" else default_entropy(cfg.mode, cfg.quantizer)
    return resolve_codec(cfg.codec, fingerprint, rope, cfg.quality, entropy, cfg.quantizer)


def default_entropy(mode: str, quantizer: str) -> str:
    """The transform codec's entropy stage a ``mode`` writes by default: Deflate where a data plane decodes
    (what its engine inflates); where only the host does, the stage cheapest for it: rANS for scalar symbols
    (its tables fit those), zstd for the trellis."""
    if mode != "inproc":
        return "deflate"
    return "rans" if quantizer == SCALAR_QUANTIZER else "zstd"


@dataclass(frozen=True)
class PathParts:
    """What every fetch path is built from."""

    config: RemoteKVConfig
    fingerprint: ModelFingerprint
    codec: Codec  # the write codec
    client: StoreClient
    kv_writer: object  # where fetched KV is written: the linker's staging writer (None: a test without one)
    wakeup: threading.Event
    on_store_error: object = None  # (op, kind, n): the data plane's own store client's failures
    on_restart: object = None  # (reason): the data plane was replaced
    on_staging_write: object = None  # (seconds, layers, output): the DPU client's receiver wrote staging rows
    pool_device: object = None  # the KV pool's torch device (None: the writer's): picks NVDEC on a GPU


def inproc_path(parts: PathParts) -> FetchPath:
    w = parts.kv_writer
    try:  # the serving process decodes: load the codec's kernels now, not on the first remote hit
        parts.codec.warm_up(parts.fingerprint)
    except (ValueError, KeyError, ChunkError) as e:
        logger.warning("codec warm-up failed (%r); the first in-process decode loads its kernels", e)
    be = InProcessFetchBackend(
        parts.client,
        parts.codec,
        parts.fingerprint,
        parts.config.chunk_size,
        on_done=parts.wakeup.set,
        keep_codes=w is not None and w.device_dequant,  # GPU dequant at install
    )
    return FetchPath(PathName.INPROC, be, parts.codec)


def nvdec_path(parts: PathParts, codec: Codec) -> FetchPath:
    from sgl_remote_kv import metrics as metrics_mod
    from sgl_remote_kv.fetch.nvdec import NvdecFetchBackend
    from sgl_remote_kv.nvdec.pool import DecoderPool

    device, gpu_id, instances = _decoder_device(parts)
    pool = DecoderPool(instances=instances, device=device, gpu_id=gpu_id)
    adapter = _resolution_adapter(parts, codec, pool)
    be = NvdecFetchBackend(
        parts.client,
        pool,
        codec,
        parts.fingerprint,
        parts.config.chunk_size,
        parts.kv_writer,
        on_done=parts.wakeup.set,
        adapter=adapter,
        metrics=metrics_mod.get(),
    )
    estimate = be.estimate if adapter is not None else None
    return FetchPath(PathName.NVDEC, be, codec, closers=(pool,), estimate=estimate)


def _resolution_adapter(parts: PathParts, codec: Codec, pool):
    """Adaptive resolution over ``--remote-kv-nvdec-resolutions`` (None: one resolution, the anchor):
    the decode table profiled on ``pool`` (or read from its cache file), then ``ResolutionAdapter``."""
    from sgl_remote_kv.nvdec.adapter import ResolutionAdapter, label, parse_resolution
    from sgl_remote_kv.nvdec.profile import serving_table

    cfg, fp = parts.config, parts.fingerprint
    versions = cfg.nvdec_versions
    if len(versions) < 2 or getattr(codec, "tokens_per_frame", None) not in versions:
        return None
    t0 = time.perf_counter()
    try:
        table = serving_table(pool, codec, versions, fp, cfg.chunk_size)
        fixed = None if cfg.nvdec_fetch == "adaptive" else parse_resolution(cfg.nvdec_fetch)
        adapter = ResolutionAdapter(
            table, fixed=fixed, chunk_bytes=cfg.chunk_size * fp.layout.bytes_per_token()
        )
    except (
        ChunkError,
        ValueError,
        OSError,
        RuntimeError,
    ) as e:  # a decoder that cannot profile: one resolution
        logger.warning("NVDEC decode profile failed (%r): fetching the full-frame version only", e)
        return None
    logger.info(
        "NVDEC resolutions %s (fetch %s), decode table %s in %.1f s: %s s per chunk at load 1",
        [label(r) for r in table.resolutions],
        cfg.nvdec_fetch,
        table.key,
        time.perf_counter() - t0,
        {label(r): round(row[0], 3) for r, row in zip(table.resolutions, table.latency, strict=True)},
    )
    return adapter


def chunk_versions(cfg: RemoteKVConfig, codec: Codec, fingerprint: ModelFingerprint, on_written):
    """What the write-back adds per chunk for adaptive resolution (``nvdec.versions.ChunkVersions``): the
    other ``--remote-kv-nvdec-resolutions`` of an hevc write codec; None when one resolution is written."""
    if codec.name != HEVC or len(cfg.nvdec_versions) < 2:
        return None
    from sgl_remote_kv.nvdec.versions import ChunkVersions

    return ChunkVersions(codec, cfg.nvdec_versions, fingerprint, cfg.chunk_size, on_written)


def _decoder_device(parts: PathParts) -> tuple[str, int, int]:
    """(device, gpu id, instances) of the decoder pool: NVDEC through PyNvVideoCodec, one decoder per
    engine, when the KV pool is on a GPU whose NVDEC decodes 8-bit 4:4:4 HEVC (its frames come back to
    host memory, where the staging rows are); FFmpeg's software decoder (``--remote-kv-nvdec-instances``
    threads) otherwise, on the same bitstreams."""
    dev = parts.pool_device
    if dev is None and parts.kv_writer is not None:
        dev = parts.kv_writer.pool.k[0].device
    if dev is None or dev.type != "cuda":
        return "cpu", 0, parts.config.nvdec_instances
    from sgl_remote_kv.nvdec import nvcodec

    gpu = dev.index or 0
    reason = nvcodec.unavailable_reason(gpu)
    if reason is not None:
        logger.warning("NVDEC unusable on GPU %d (%s): software HEVC decoding", gpu, reason)
        return "cpu", 0, parts.config.nvdec_instances
    return "cuda", gpu, nvcodec.nvdec_engines(gpu)


def _dpu_or_inproc(parts: PathParts) -> FetchPath:
    if parts.codec.name != HEVC:
        from sgl_remote_kv.fetch.dpu import start_dpu_backend

        be = start_dpu_backend(
            parts.config,
            parts.fingerprint,
            parts.codec,
            parts.kv_writer,
            parts.wakeup.set,
            parts.on_store_error,
            parts.on_restart,
            parts.on_staging_write,
        )
        if be is not None:
            return FetchPath(PathName.DPU, be, parts.codec)
    return inproc_path(parts)


def build_paths(parts: PathParts) -> list[FetchPath]:
    """The mode's fetch paths, primary first (see module docstring)."""
    mode, codec = parts.config.mode, parts.codec
    if mode == "dpu":
        out = [_dpu_or_inproc(parts)]
    elif mode == "nvdec" and codec.name == HEVC:
        out = [nvdec_path(parts, codec)]
    elif mode == "auto" and codec.name == HEVC:
        out = [nvdec_path(parts, codec), inproc_path(parts)]
    elif mode == "auto":
        out = [_dpu_or_inproc(parts), nvdec_path(parts, get_codec(HEVC))]
    else:
        if mode == "nvdec":
            logger.warning("--remote-kv nvdec needs the hevc codec, got %r: in-process path", codec.name)
        out = [inproc_path(parts)]
    logger.info("remote KV fetch paths: %s", {p.name.value: p.codec.name for p in out})
    return out
