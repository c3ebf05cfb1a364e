"""Online estimates and the fetch-vs-recompute decision.

- ``Ewma``: exponentially weighted mean (link bandwidth, decode throughput per path).
- ``PrefillModel``: least-squares fit ``t(n) = a + b*n + c*n^2`` of prefill time over prompt tokens,
  from the server's own prefills (attention makes long prefills super-linear).
- ``Policy.decide``: for ``n`` tokens the store has (``nbytes`` compressed), estimate each decode
  path's time (transfer + decode + queueing) and the recompute time; pick the fastest path allowed
  by the mode (``dpu``/``nvdec`` force the path but still fall back to recompute when fetching cannot
  win; ``auto`` chooses). Unknown estimates start optimistic so the tier gets used and measured.

Threads: the scheduler thread calls ``decide`` and ``observe_prefill``; fetch workers call
``observe_fetch`` (a lock guards the estimates). Everything here is plain Python: unit-testable.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

PATHS = ("dpu", "nvdec", "inproc")


class Ewma:
    def __init__(self, alpha: float, initial: float) -> None:
        self.alpha, self.value, self.samples = alpha, initial, 0

    def update(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1


class PrefillModel:
    """``t(n) = b n + c n^2`` (b, c >= 0) fitted on the last ``window`` (tokens, seconds) samples.

    No intercept and non-negative coefficients: a handful of noisy samples (warm-up batches, a
    loaded machine) must never produce a model that says a long prefill is free. Batches shorter
    than ``min_tokens`` are ignored (their time is dominated by fixed overheads).
    """

    def __init__(self, window: int = 64, default_tok_per_s: float = 400.0, min_tokens: int = 32) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.min_tokens = min_tokens
        self._coef = (1.0 / default_tok_per_s, 0.0)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < self.min_tokens or seconds <= 0:
            return
        self._samples.append((float(tokens), float(seconds)))
        if len(self._samples) >= 3:
            self._coef = self._fit()

    def _fit(self) -> tuple[float, float]:
        n = np.array([s[0] for s in self._samples])
        t = np.array([s[1] for s in self._samples])
        (b, c), *_ = np.linalg.lstsq(np.stack([n, n * n], axis=1), t, rcond=None)
        if b >= 0 and c >= 0:
            return float(b), float(c)
        # One coefficient negative: the best fit with it at zero (1-D least squares, closed form).
        b_only = float(n @ t / (n @ n))
        c_only = float((n * n) @ t / ((n * n) @ (n * n)))
        err_b = float(np.sum((t - b_only * n) ** 2))
        err_c = float(np.sum((t - c_only * n * n) ** 2))
        return (b_only, 0.0) if err_b <= err_c else (0.0, c_only)

    def predict(self, tokens: int) -> float:
        b, c = self._coef
        return float(b * tokens + c * tokens * tokens)


@dataclass(frozen=True)
class Decision:
    path: str  # one of PATHS or "recompute"
    est_fetch_s: float
    est_recompute_s: float


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "dpu"  # dpu | nvdec | auto (inproc is what "dpu" uses until the data plane runs)
    bw_initial_bps: float = 1e9
    decode_initial_bps: float = 200e6
    margin: float = 1.0  # fetch must be estimated at most margin x the recompute time


class Policy:
    def __init__(self, config: PolicyConfig | None = None, available: tuple[str, ...] = ("inproc",)) -> None:
        self.config = cfg = config or PolicyConfig()
        self.available = available
        self._lock = threading.Lock()
        # EWMAs of seconds per byte (not bytes per second): time estimates need the harmonic mean,
        # and one slow sample must be able to pull a fast estimate down.
        self.link_spb = Ewma(0.3, 1.0 / cfg.bw_initial_bps)
        self.decode_spb = {p: Ewma(0.3, 1.0 / cfg.decode_initial_bps) for p in PATHS}
        self.prefill = PrefillModel()

    def observe_fetch(
        self, path: str, nbytes: int, fetch_s: float, decoded_bytes: int, decode_s: float
    ) -> None:
        with self._lock:
            if nbytes > 0 and fetch_s > 0:
                self.link_spb.update(fetch_s / nbytes)
            if decoded_bytes > 0 and decode_s > 0:
                self.decode_spb[path].update(decode_s / decoded_bytes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill.observe(tokens, seconds)

    def _candidates(self) -> tuple[str, ...]:
        mode = self.config.mode
        if mode == "auto":
            return self.available
        if mode in self.available:
            return (mode,)
        return ("inproc",) if "inproc" in self.available else self.available

    def decide(self, tokens: int, nbytes: int, decoded_bytes: int, queue_depth: dict[str, int]) -> Decision:
        """Pick the path for fetching ``tokens`` tokens (``nbytes`` on the wire)."""
        with self._lock:
            recompute = self.prefill.predict(tokens)
            best, best_t = "recompute", float("inf")
            for path in self._candidates():
                dec = decoded_bytes * self.decode_spb[path].value
                t = nbytes * self.link_spb.value + dec * (1 + queue_depth.get(path, 0))
                if t < best_t:
                    best, best_t = path, t
        if best_t > self.config.margin * recompute:
            best = "recompute"
        logger.debug(
            "policy: %d tokens -> %s (fetch %.3fs, recompute %.3fs)", tokens, best, best_t, recompute
        )
        return Decision(best, best_t, recompute)

    def decide_among(self, options: dict[str, tuple[int, int, int]], queue_depth: dict[str, int]) -> Decision:
        """Pick among paths that may cover different prefix lengths.

        ``options[path] = (tokens, wire bytes, decoded bytes)`` that ``path`` could fetch. The winner
        maximises the time saved, ``margin * recompute(tokens) - fetch time``; recompute if no path
        saves time. With one option this is exactly ``decide``.
        """
        allowed = set(self._candidates())
        best: Decision = Decision("recompute", float("inf"), 0.0)
        best_gain = 0.0
        with self._lock:
            for path, (tokens, nbytes, decoded) in options.items():
                if path not in allowed or tokens <= 0:
                    continue
                recompute = self.prefill.predict(tokens)
                dec = decoded * self.decode_spb[path].value
                t = nbytes * self.link_spb.value + dec * (1 + queue_depth.get(path, 0))
                gain = self.config.margin * recompute - t
                if gain >= best_gain and (best.path == "recompute" or gain > best_gain):
                    best, best_gain = Decision(path, t, recompute), gain
        logger.debug("policy: options %s depth %s -> %s", options, queue_depth, best)
        return best
