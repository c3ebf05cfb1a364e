"""The decode-time table of adaptive resolution, measured on the decoder actually in use, cached on disk.

:func:`profile` decodes sample chunks on the real :class:`~sgl_remote_kv.nvdec.pool.DecoderPool`: for
every resolution and every load ``L = 1..instances``, ``L`` chunks submitted at once (mean per-chunk
decode time, the queue wait excluded), plus the switch penalty (extra latency of a chunk decoded right
after one of another resolution). Nothing in the table is hard-coded.

:func:`serving_table` is what a server runs at start-up: sample chunks of *one* layer group (three layers
of the model's KV layout, synthetic KV from a fixed seed, encoded at each resolution by the path's
codec) are profiled and the latencies and sizes scaled by the model's group count (a chunk's decode is
one K and one V video per group, each group alike), so start-up costs seconds, not minutes. The
fetcher then corrects each resolution's latency by what live decodes measure
(``ResolutionAdapter.observe_decode``).

Cache: JSON at ``env.cache_dir()/nvdec/profile-<key>.json``, ``key`` = hash of the codec params, the
resolutions, the KV layout, the chunk size, the decoder (``hevc`` software / ``pynvvideocodec``), the device
(CPU model or GPU name) and the instance count; :func:`load_or_profile` re-profiles when it is missing,
unreadable, for another key, or on ``refresh``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import wait
from dataclasses import replace
from pathlib import Path

import numpy as np
from sgl_remote_kv.nvdec.adapter import ProfileTable
from sgl_remote_kv.nvdec.hevc_codec import GROUP, HevcCodec
from sgl_remote_kv.nvdec.versions import version_codec

from sgl_remote_kv import env
from sgl_remote_kv.types import KVLayout, ModelFingerprint

logger = logging.getLogger(__name__)


def device_name(device: str, gpu_id: int = 0) -> str:
    """What the decoder runs on, for the cache key: the GPU's name, or the CPU model and core count."""
    if device == "cuda":
        try:
            import torch

            return f"cuda:{torch.cuda.get_device_name(gpu_id)}"
        except (ImportError, RuntimeError, AssertionError) as e:
            return f"cuda:{gpu_id}:{type(e).__name__}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu:{model}:{os.cpu_count()}"


def table_key(
    codec_params: Mapping,
    device: str,
    instances: int,
    *,
    decoder: str = "",
    resolutions: Sequence[int] = (),
    layout: KVLayout | None = None,
    chunk_size: int = 0,
) -> str:
    raw = json.dumps(
        {
            "params": dict(codec_params),
            "device": device,
            "instances": instances,
            "decoder": decoder,
            "resolutions": list(resolutions),
            "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype]
            if layout
            else [],
            "chunk": chunk_size,
        },
        sort_keys=True,
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def default_path(key: str) -> Path:
    return env.cache_dir() / "nvdec" / f"profile-{key}.json"


def _timed_batch(pool, fingerprint, blobs: list, sink_factory: Callable[[], Callable]) -> float:
    """Submit ``blobs`` at once; mean per-chunk latency (queue wait excluded)."""
    futs = [pool.submit(b, fingerprint, sink_factory()) for b in blobs]
    wait(futs)
    return statistics.mean(f.result().decode_s for f in futs)


def profile(
    pool,
    fingerprint,
    blobs: Mapping[int, list],
    sink_factory: Callable[[], Callable],
    repeats: int = 2,
    key: str = "",
) -> ProfileTable:
    """Measure the table with the real ``pool``: for each resolution and load L, decode L chunks at once.

    ``blobs[res]`` holds sample chunks encoded at ``res``. Latency: the best of ``repeats``. Penalty: the
    extra latency of a chunk decoded right after a chunk of another resolution, at load 1.
    """
    res_list = sorted(blobs)
    loads = tuple(range(1, pool.instances + 1))
    latency, penalty = [], []
    for res in res_list:
        sample = blobs[res]
        row = []
        for load in loads:
            batch = [sample[i % len(sample)] for i in range(load)]
            row.append(min(_timed_batch(pool, fingerprint, batch, sink_factory) for _ in range(repeats)))
        latency.append(tuple(row))
    for res in res_list:
        other = next((r for r in res_list if r != res), res)
        extra = []
        for _ in range(repeats):
            _timed_batch(pool, fingerprint, [blobs[other][0]] * pool.instances, sink_factory)
            extra.append(_timed_batch(pool, fingerprint, [blobs[res][0]], sink_factory))
        penalty.append(max(0.0, min(extra) - latency[res_list.index(res)][0]))
    sizes = tuple(int(statistics.mean(len(b) for b in blobs[r])) for r in res_list)
    return ProfileTable(tuple(res_list), loads, tuple(latency), tuple(penalty), sizes, pool.instances, key)


def load_or_profile(
    key: str, build: Callable[[], ProfileTable], refresh: bool = False, path: Path | None = None
) -> ProfileTable:
    """The stored table for ``key``; profiled with ``build()`` and saved if missing, stale or ``refresh``."""
    path = path or default_path(key)
    if not refresh and path.exists():
        try:
            table = ProfileTable.from_json(path.read_text())
            if table.key == key:
                return table
            logger.info("profile %s is for another key; re-profiling", path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable profile %s: %s", path, e)
    t0 = time.perf_counter()
    table = replace(build(), key=key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(table.to_json())
        tmp.replace(path)
    except OSError as e:  # an unwritable cache dir costs a re-profile next start, nothing else
        logger.warning("could not save the decode profile to %s: %s", path, e)
    logger.info("profiled decode table %s in %.1f s -> %s", key, time.perf_counter() - t0, path)
    return table


def sample_kv(layout: KVLayout, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic ``[L, T, H, D]`` KV in the layout's storage dtype (Gaussian, per-channel scales)."""
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, tokens, layout.num_kv_heads, layout.head_dim)
    chan = rng.gamma(2.0, 0.5, size=(layout.num_layers, 1, layout.num_kv_heads, layout.head_dim))
    k = (rng.standard_normal(shape) * chan).astype(np.float32)
    v = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    if layout.dtype == "bfloat16":
        return _bf16(k), _bf16(v)
    from sgl_remote_kv.types import numpy_storage_dtype

    return k.astype(numpy_storage_dtype(layout.dtype)), v.astype(numpy_storage_dtype(layout.dtype))


def _bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def serving_table(
    pool,
    anchor: HevcCodec,
    resolutions: Sequence[int],
    fingerprint: ModelFingerprint,
    chunk_size: int,
    *,
    device: str = "",
    samples: int = 2,
    repeats: int = 2,
    refresh: bool = False,
    path: Path | None = None,
) -> ProfileTable:
    """The table for a server's decoder ``pool`` (cached; see module docstring)."""
    from sgl_remote_kv.nvdec.video import decoder_name

    lay = fingerprint.layout
    key = table_key(
        anchor.params(),
        device or device_name(pool.device, pool.gpu_id),
        pool.instances,
        decoder=decoder_name(pool.device),
        resolutions=resolutions,
        layout=lay,
        chunk_size=chunk_size,
    )

    def build() -> ProfileTable:
        fp, blobs = sample_chunks(anchor, resolutions, fingerprint, chunk_size, samples)
        t = profile(pool, fp, blobs, discard_sink, repeats=repeats, key=key)
        return per_model(t, lay.num_layers)

    return load_or_profile(key, build, refresh=refresh, path=path)


def group_fingerprint(fingerprint: ModelFingerprint) -> ModelFingerprint:
    """The fingerprint of one layer group of ``fingerprint``'s KV layout (what the profile encodes)."""
    lay = fingerprint.layout
    group = KVLayout(min(GROUP, lay.num_layers), lay.num_kv_heads, lay.head_dim, lay.dtype)
    return ModelFingerprint(fingerprint.architecture, group, "nvdec-profile")


def sample_chunks(
    anchor: HevcCodec,
    resolutions: Sequence[int],
    fingerprint: ModelFingerprint,
    chunk_size: int,
    samples: int,
) -> tuple[ModelFingerprint, dict[int, list[bytes]]]:
    """(group fingerprint, ``{resolution: sample chunks}``): ``samples`` synthetic chunks (fixed seeds) of
    one layer group, encoded at each resolution with ``anchor``'s quantization and tiling."""
    fp = group_fingerprint(fingerprint)
    kvs = [sample_kv(fp.layout, chunk_size, seed=7 + i) for i in range(samples)]
    return fp, {r: [version_codec(anchor, r).encode(k, v, fp) for k, v in kvs] for r in resolutions}


def per_model(table: ProfileTable, num_layers: int) -> ProfileTable:
    """A one-group table scaled to a model of ``num_layers`` (a chunk decodes every group alike). The switch
    penalty is not scaled: a chunk is one pool job on one decoder, which switches once, at its first group."""
    groups = -(-num_layers // GROUP)
    return replace(
        table,
        latency=tuple(tuple(x * groups for x in row) for row in table.latency),
        size_bytes=tuple(s * groups for s in table.size_bytes),
    )


def discard_sink():
    """A sink factory whose sinks drop frames: the profile times decoding, not restoration."""
    return _discard


def _discard(_frame) -> None:
    """A sink that drops frames: the profile times decoding, not restoration."""
