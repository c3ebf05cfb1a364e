"""Adaptive resolution (KVFetcher §3.2.1 (iii), §3.3.2, App. A.2 Alg. 1): which stored version of a chunk
to fetch next.

Every chunk may be stored at several *resolutions* (tokens per frame of the ``hevc`` codec's video
layout; all lossless over the same quantized codes, so every version decodes to the same KV). The
*anchor* version is the path codec's own layout (``tokens_per_frame=0``: the whole chunk on one frame,
:data:`FULL`), stored under the chunk's ordinary prefix-chain key (what lookups count and what servers
writing one resolution write). Every other version ``r`` lives under :func:`version_key`
``= sha256(tag || anchor key || r)``: the key names the resolution, so versions never collide, and it
still identifies the whole prefix (the anchor key does).

Before each chunk, :meth:`ResolutionAdapter.ranking` orders the resolutions by Alg. 1's estimate
(:func:`choose`): transmission ``size_r / B`` with ``B`` the bandwidth of the last chunk's transfer
(the paper's predictor, :class:`BandwidthEstimator`), decode ``lat(r, load)`` from the profiled table
(``nvdec/profile.py``) scaled by what this pool's live decodes measured, plus the switch penalty when
``r`` differs from the resolution the pool decoded last. Objectives:

- ``"stage"`` (default): ``max(t_trans, t_dec / min(load, instances))``, the per-chunk time of the
  slower pipeline stage, ties broken by the bubble;
- ``"bubble"``: the paper's ``|t_trans - t_dec - t_penalty|``. It prefers a *larger* video when the link
  is the bottleneck (it narrows the gap by raising the decode time; a unit test shows it), which
  ``stage`` never does.

The fetcher tries the ranking in order: a missing version falls back to the next one (a miss only when
none is stored). :meth:`ResolutionAdapter.estimate` gives the bandwidth-aware policy the same estimate
for a whole prefix. Thread-safe (one lock); plain Python, no decoder imports.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

FULL = 0  # tokens_per_frame=0: the whole chunk on one frame (the anchor version)
POWERS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # the other resolutions a chunk may be stored at
LABELS = (*(str(r) for r in POWERS), "full")  # closed label set of the per-resolution metrics
OBJECTIVES = ("bubble", "stage")
_VERSION_TAG = b"sgl-remote-kv/nvdec-resolution/v1"


def label(res: int) -> str:
    """Metric label of a resolution (``"full"`` for the anchor)."""
    return "full" if res == FULL else str(res)


def parse_resolution(text: str) -> int:
    """``"full"`` -> :data:`FULL`, ``"64"`` -> 64. Raises ``ValueError``."""
    t = text.strip().lower()
    if t == "full":
        return FULL
    try:
        r = int(t)
    except ValueError:
        raise ValueError(f"resolution must be 'full' or tokens per frame in {POWERS}, got {text!r}") from None
    if r not in POWERS:
        raise ValueError(f"resolution must be 'full' or tokens per frame in {POWERS}, got {r}")
    return r


def check_resolutions(resolutions: Iterable[int], chunk_size: int) -> tuple[int, ...]:
    """Sorted unique resolutions with the anchor (:data:`FULL`) added; each other one must divide a larger
    ``chunk_size``. Raises ``ValueError``."""
    out = {FULL}
    for r in resolutions:
        if r != FULL and (r not in POWERS or r >= chunk_size or chunk_size % r):
            raise ValueError(
                f"resolution {r} tokens/frame must be one of {POWERS} dividing a larger chunk ({chunk_size})"
            )
        out.add(r)
    return tuple(sorted(out))


def version_key(anchor_key: bytes, res: int, anchor_res: int = FULL) -> bytes:
    """Store key of chunk ``anchor_key``'s version at ``res`` (the anchor key itself for the anchor)."""
    if res == anchor_res:
        return anchor_key
    return hashlib.sha256(_VERSION_TAG + anchor_key + int(res).to_bytes(4, "little")).digest()


# ---- Alg. 1 ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileTable:
    """Decode latency (s per chunk) by resolution and pool load, switching penalty, typical chunk size."""

    resolutions: tuple[int, ...]  # tokens per frame (FULL = 0: one frame per chunk)
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
        t = cls(
            tuple(int(r) for r in d["resolutions"]),
            tuple(int(x) for x in d["loads"]),
            tuple(tuple(float(x) for x in r) for r in d["latency"]),
            tuple(float(x) for x in d["penalty"]),
            tuple(int(x) for x in d["size_bytes"]),
            int(d["instances"]),
            str(d.get("key", "")),
        )
        n = len(t.resolutions)
        if not n or len(t.latency) != n or len(t.penalty) != n or len(t.size_bytes) != n:
            raise ValueError("profile table rows do not match its resolutions")
        if any(len(row) != len(t.loads) for row in t.latency) or not t.loads:
            raise ValueError("profile table latency rows do not match its loads")
        if not all(math.isfinite(x) and x >= 0 for row in t.latency for x in row):
            raise ValueError("profile table latencies must be finite and >= 0")
        return t


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
    score: float = 0.0  # the objective's value (lower is better)


def _score(
    res: int,
    size: int,
    bandwidth: float,
    table: ProfileTable,
    load: int,
    active: int | None,
    objective: str,
    scale: float,
) -> tuple[tuple[float, float], Choice]:
    trans = size / max(bandwidth, 1e-9)
    lat, pen = table.lookup(res, max(load, 1))
    dec = lat * scale + (pen if active is not None and res != active else 0.0)
    bubble = abs(trans - dec)
    if objective == "bubble":
        score = (bubble, 0.0)
    else:
        score = (max(trans, dec / min(max(load, 1), table.instances)), bubble)
    return score, Choice(res, trans, dec, bubble, score[0])


def rank(
    sizes: Mapping[int, int],
    bandwidth: float,
    table: ProfileTable,
    load: int,
    active: int | None = None,
    objective: str = "stage",
    scale: Mapping[int, float] | None = None,
) -> list[Choice]:
    """Every resolution of ``sizes`` (resolution -> expected blob bytes) scored by Alg. 1, best first.

    ``load`` counts chunks decoding or queued including this one; ``active`` is the resolution the pool
    decoded last (switching to another costs its penalty); ``scale[r]`` multiplies the profiled latency
    (live decodes measured against the table)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}")
    scored = [
        _score(r, s, bandwidth, table, load, active, objective, (scale or {}).get(r, 1.0))
        for r, s in sizes.items()
    ]
    if not scored:
        raise ValueError("no resolutions to choose from")
    return [c for _, c in sorted(scored, key=lambda x: (x[0], x[1].resolution))]


def choose(
    sizes: Mapping[int, int],
    bandwidth: float,
    table: ProfileTable,
    load: int,
    active: int | None = None,
    objective: str = "stage",
    scale: Mapping[int, float] | None = None,
) -> Choice:
    """Alg. 1: the resolution among ``sizes`` to fetch next (see :func:`rank`)."""
    return rank(sizes, bandwidth, table, load, active, objective, scale)[0]


# ---- the serving path's adapter ------------------------------------------------------------------


class ResolutionAdapter:
    """Per fetch path (one link, one decoder pool): the live state Alg. 1 needs.

    ``table``: the profiled decode table (its resolutions are those this server fetches); ``fixed``: a
    resolution to always try first (``--remote-kv-nvdec-fetch``; None = adaptive); ``chunk_bytes``: KV bytes
    of one decoded chunk (the policy's estimates are in decoded bytes).
    """

    def __init__(
        self,
        table: ProfileTable,
        *,
        fixed: int | None = None,
        objective: str = "stage",
        initial_bps: float = 1e9,
        alpha: float = 1.0,
        chunk_bytes: int = 0,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}")
        if fixed is not None and fixed not in table.resolutions:
            raise ValueError(f"fixed resolution {label(fixed)} is not in the profile {table.resolutions}")
        self.table, self.fixed, self.objective, self.chunk_bytes = table, fixed, objective, chunk_bytes
        self._lock = threading.Lock()
        self._bw = BandwidthEstimator(initial_bps, alpha)
        self._sizes = {r: float(s) for r, s in zip(table.resolutions, table.size_bytes, strict=True)}
        self._scale = {r: 1.0 for r in table.resolutions}
        self.active: int | None = None

    @property
    def resolutions(self) -> tuple[int, ...]:
        return self.table.resolutions

    @property
    def bandwidth(self) -> float:
        with self._lock:
            return self._bw.value

    def sizes(self) -> dict[int, int]:
        with self._lock:
            return {r: int(s) for r, s in self._sizes.items()}

    def ranking(self, load: int) -> list[Choice]:
        """The resolutions to try for the next chunk, best first (a fixed resolution first, then Alg. 1)."""
        with self._lock:
            out = rank(
                self._sizes, self._bw.value, self.table, load, self.active, self.objective, self._scale
            )
        if self.fixed is not None:
            out.sort(key=lambda c: c.resolution != self.fixed)
        return out

    def observe_transfer(self, res: int, nbytes: int, seconds: float) -> None:
        """A chunk's version ``res`` of ``nbytes`` arrived after ``seconds`` on the link."""
        with self._lock:
            self._bw.update(nbytes, seconds)
            if res in self._sizes and nbytes > 0:
                self._sizes[res] = 0.5 * nbytes + 0.5 * self._sizes[res]

    def observe_decode(self, res: int, load: int, seconds: float) -> None:
        """The pool decoded a chunk at ``res`` in ``seconds`` (worker time) with ``load`` chunks in it."""
        if res not in self._scale or seconds <= 0:
            return
        lat, _ = self.table.lookup(res, load)
        if lat > 0:
            with self._lock:
                self._scale[res] = 0.7 * self._scale[res] + 0.3 * min(100.0, seconds / lat)

    def decoded(self, res: int) -> None:
        """The pool's active resolution is now ``res`` (switching away from it costs its penalty)."""
        with self._lock:
            self.active = res

    def estimate(self, nbytes: int, decoded: int, depth: int, spb: float) -> tuple[float, float]:
        """(fetch seconds, decode share) of a prefix of ``decoded`` KV bytes for the policy: every chunk at
        the resolution Alg. 1 picks at the link's ``1/spb`` bytes/s, pipelined on the pool (first chunk's
        transfer, then the slower stage per chunk, then the last decode), decode times ``1 + depth`` for
        fetches queued ahead. ``nbytes`` (the policy's wire guess) is used only without ``chunk_bytes``."""
        n = max(1, round(decoded / self.chunk_bytes)) if self.chunk_bytes > 0 else 1
        bw = 1.0 / max(spb, 1e-15)
        load = min(n, self.table.instances)
        with self._lock:
            sizes = dict(self._sizes)
            scale = {r: s * (1 + depth) for r, s in self._scale.items()}
        if self.fixed is not None:
            sizes = {self.fixed: sizes[self.fixed]}
        if self.chunk_bytes <= 0:  # no per-chunk view: the wire guess as one chunk
            sizes = {r: nbytes for r in sizes}
        c = choose(sizes, bw, self.table, load, None, self.objective, scale)
        stage = max(c.trans_s, c.dec_s / load)
        total = c.trans_s + (n - 1) * stage + c.dec_s
        return total, max(0.0, total - n * c.trans_s)
