"""Adaptive resolution (KVFetcher §3.3.2, Alg. 1): pick each chunk's resolution from a bandwidth estimate
and a decode-latency table profiled on this machine.

Each chunk is stored in several resolutions (``tokens_per_frame`` values of the ``hevc`` codec). Before a
chunk is fetched, :func:`choose` estimates, for every resolution ``r``, the transmission time
``S_r / B`` and the decode time ``lat(r, load) + penalty(r)`` (penalty only if ``r`` differs from the
resolution the pool decoded last), and returns the ``r`` with the smallest objective:

- ``"bubble"`` — the paper's ``|t_trans - t_dec - t_penalty|``;
- ``"stage"`` (default) — ``max(t_trans, t_dec_eff)``, the per-chunk time of the slower pipeline stage,
  ties broken by the bubble. ``t_dec_eff = lat(r, load) / min(load, instances)``: with ``load`` chunks
  decoding on parallel instances the decode stage serves one chunk per ``lat / load``. The paper's
  objective prefers a *larger* chunk when the link is the bottleneck (it narrows the gap by raising the
  decode time); ``"stage"`` never does. Both are measured in ``benchmarks/bench_nvdec.py``.

The table (:class:`ProfileTable`) is JSON in ``sgl_remote_kv.env.cache_dir()`` keyed by codec params and
decoder device; :func:`load_or_profile` measures it with the real pool when missing or on ``refresh``.
Called from the fetch controller's thread; nothing here is shared mutable state except
:class:`BandwidthEstimator` (one per link, single-threaded use).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sgl_remote_kv import env

logger = logging.getLogger(__name__)

OBJECTIVES = ("bubble", "stage")


@dataclass(frozen=True)
class ProfileTable:
    """Decode latency (s per chunk) by resolution and pool load, switching penalty, typical chunk size."""

    resolutions: tuple[int, ...]  # tokens per frame
    loads: tuple[int, ...]  # 1..instances
    latency: tuple[tuple[float, ...], ...]  # [resolution][load index]
    penalty: tuple[float, ...]  # [resolution]
    size_bytes: tuple[int, ...]  # [resolution], mean blob size of the profiled chunks
    instances: int
    key: str = ""

    def index(self, res: int) -> int:
        return self.resolutions.index(res)

    def lookup(self, res: int, load: int) -> tuple[float, float]:
        """(latency, penalty) for ``res`` at ``load`` (clamped to the profiled loads)."""
        i = self.index(res)
        load = min(max(load, self.loads[0]), self.loads[-1])
        return self.latency[i][self.loads.index(load)], self.penalty[i]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ProfileTable:
        d = json.loads(text)
        return cls(
            tuple(d["resolutions"]),
            tuple(d["loads"]),
            tuple(tuple(r) for r in d["latency"]),
            tuple(d["penalty"]),
            tuple(d["size_bytes"]),
            int(d["instances"]),
            d.get("key", ""),
        )


class BandwidthEstimator:
    """Bytes/second from completed transfers: the last chunk's rate (the paper), optionally an EWMA."""

    def __init__(self, initial: float, alpha: float = 1.0):
        self.value, self.alpha = float(initial), alpha

    def update(self, nbytes: int, seconds: float) -> float:
        if seconds > 0 and nbytes > 0:
            self.value = self.alpha * (nbytes / seconds) + (1 - self.alpha) * self.value
        return self.value


@dataclass(frozen=True)
class Choice:
    resolution: int
    trans_s: float
    dec_s: float
    bubble_s: float


def choose(
    sizes: Mapping[int, int],
    bandwidth: float,
    table: ProfileTable,
    load: int,
    active: int | None = None,
    objective: str = "stage",
) -> Choice:
    """Alg. 1: the resolution among ``sizes`` (resolution -> blob bytes of this chunk) to fetch next.

    ``load`` counts chunks decoding or queued including this one; ``active`` is the resolution the pool
    decoded last (switching to another costs its penalty).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}")
    best: tuple[tuple[float, float], Choice] | None = None
    for res, size in sizes.items():
        trans = size / max(bandwidth, 1e-9)
        lat, pen = table.lookup(res, max(load, 1))
        dec = lat + (pen if active is not None and res != active else 0.0)
        bubble = abs(trans - dec)
        if objective == "bubble":
            score = (bubble, 0.0)
        else:
            score = (max(trans, dec / min(max(load, 1), table.instances)), bubble)
        if best is None or score < best[0]:
            best = (score, Choice(res, trans, dec, bubble))
    if best is None:
        raise ValueError("no resolutions to choose from")
    return best[1]


# ---- profiling ---------------------------------------------------------------------------------------


def table_key(codec_params: Mapping, device: str, instances: int) -> str:
    raw = json.dumps({"params": dict(codec_params), "device": device, "instances": instances}, sort_keys=True)
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

    ``blobs[res]`` holds sample chunks (>= ``pool.instances``) encoded at ``res``. Penalty: the mean extra
    latency of a chunk decoded right after a chunk of another resolution on the same instance count 1.
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
            _timed_batch(pool, fingerprint, [blobs[other][0]], sink_factory)
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
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable profile %s: %s", path, e)
    t0 = time.perf_counter()
    table = replace(build(), key=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(table.to_json())
    tmp.replace(path)
    logger.info("profiled decode table %s in %.1f s -> %s", key, time.perf_counter() - t0, path)
    return table
