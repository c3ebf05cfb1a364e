"""Online estimates and the fetch-vs-recompute decision.

- ``Ewma``: exponentially weighted mean (link seconds per byte, decode seconds per byte per path).
- ``PrefillModel``: least-squares fit ``t(n) = b*n + c*n^2`` of prefill time over prompt tokens,
  from the server's own prefills (attention makes long prefills super-linear).
- ``Policy.decide_among``: for the prefix each path could fetch, estimate the path's time (transfer +
  decode + queueing; a path with its own model, ``estimators``, gives it: the NVDEC path pipelines
  transfer and decode at the resolutions its adapter would pick, from the same link estimate) and the
  recompute time; pick the path that saves the most time among those the
  mode allows (``dpu``/``nvdec``/``inproc`` force the path but still recompute when fetching cannot
  win; ``auto`` chooses). Unknown estimates start optimistic so the tier gets used and measured.

Keeping the estimates honest when the link changes (``InflightFetches``):

- **In-flight fetches feed the link estimate.** Every fetch the waiting queue starts is registered
  (``fetch_started``) with its expected wire bytes and the decode time the policy predicted for it.
  A decision uses ``max(EWMA, in-flight bound)``: for each running fetch, ``link_s / received`` once
  the backend reports its transfer finished, else ``(elapsed - predicted decode) / expected bytes``
  (a lower bound: the bytes are not all there yet). So requests deciding while a slow fetch runs see
  the slow link before that fetch ends.
- **Losing fetches are abandoned.** ``check`` says ``"abandoned"`` once a fetch has run longer than
  ``max(abandon_floor_s, abandon_factor x margin x its recompute estimate)`` (recompute would have
  been faster), and ``"fetch_timeout"`` past a byte-scaled hang guard
  ``min(timeout_cap_s, timeout_floor_s + bytes / timeout_bw_Bps)`` (slow links that still win are
  not killed; the fixed cap only bounds it). The caller cancels and recomputes; ``fetch_ended``
  feeds the censored elapsed/bytes into the link EWMA and raises the estimate to at least that
  bound, so the loss is learned at once (one transient loss costs at most one probe interval).
- **Re-probing.** When the estimates say "recompute" but no link sample arrived for
  ``probe_interval_s`` and nothing is in flight, one request fetches anyway (``Decision.probe``):
  at most one probe per interval, each bounded by the abandon rule. A sample arriving after such a
  gap *replaces* the stale EWMA value instead of being averaged in, so one probe on a recovered link
  is enough to fetch again.

Threads: the scheduler thread calls ``decide*``, ``fetch_started``/``check``/``fetch_ended`` and
``observe_prefill``; ``observe_fetch`` may come from any thread (a lock guards the estimates).
Everything here is plain Python with an injectable clock (``now``): unit-testable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from sgl_remote_kv.types import PathName

logger = logging.getLogger(__name__)

PATHS = tuple(p.value for p in PathName)  # the fetch paths, in one order everywhere


class Ewma:
    def __init__(self, alpha: float, initial: float) -> None:
        self.alpha, self.value, self.samples = alpha, initial, 0

    def update(self, x: float, replace: bool = False) -> None:
        """Blend ``x`` in; the first sample (or ``replace``: the old value is stale) replaces it."""
        fresh = self.samples == 0 or replace
        self.value = x if fresh else self.alpha * x + (1 - self.alpha) * self.value
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
    est_decode_s: float = 0.0  # the decode (+ queueing) share of est_fetch_s
    probe: bool = False  # fetched although the estimates said recompute (re-probing a stale link)


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "dpu"  # dpu | nvdec | inproc | auto
    bw_initial_bps: float = 1e9  # optimistic prior (bytes/s) so the tier gets used and measured
    decode_initial_bps: float = 200e6
    # decoded KV bytes per second of the load from staging into a device pool (measured at start-up by
    # ``kvpool.warmup``: the device decode of staged codes); 0: not modeled (host pools)
    load_bps: float = 0.0
    margin: float = 1.0  # fetch must be estimated at most margin x the recompute time
    abandon_factor: float = 1.5  # abandon a fetch running > factor x margin x est. recompute ...
    # ... but never one younger than this: RTT jitter and tiny prefixes, and a hung data plane is
    # detected by the DPU client's 5 s heartbeat (+ its check period, on a loaded host) and counted
    # as ``dataplane_lost``, not as a loss
    abandon_floor_s: float = 8.0
    timeout_floor_s: float = 10.0  # hang guard: floor + wire bytes / timeout_bw_Bps ...
    timeout_bw_Bps: float = 250e3  # ... (2 Mbit/s: a conservative link bound) ...
    timeout_cap_s: float = 120.0  # ... capped at this
    probe_interval_s: float = 30.0  # no link sample for this long: one probe fetch; next sample replaces


@dataclass
class _Inflight:
    started: float
    wire_bytes: int
    est_decode_s: float
    est_recompute_s: float
    received: int = 0  # wire bytes the backend reports received (0: unknown yet)
    link_s: float = 0.0  # transfer time once the backend reports it finished (0: still running)

    def spb_bound(self, now: float) -> float:
        """Seconds per wire byte this fetch shows so far (a lower bound while it is running)."""
        if self.link_s > 0 and self.received > 0:
            return self.link_s / self.received
        return max(0.0, now - self.started - self.est_decode_s) / max(1, self.wire_bytes)


class InflightFetches:
    """Running fetches by request id, for the in-flight link bound and the abandon/timeout rules."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.items: dict[str, _Inflight] = {}

    def spb_bound(self, now: float) -> float:
        return max((f.spb_bound(now) for f in self.items.values()), default=0.0)

    def deadlines(self, f: _Inflight) -> tuple[float, float]:
        """(abandon after, time out after) in seconds since the fetch started."""
        c = self.cfg
        abandon = max(c.abandon_floor_s, c.abandon_factor * c.margin * f.est_recompute_s)
        timeout = min(c.timeout_cap_s, c.timeout_floor_s + f.wire_bytes / c.timeout_bw_Bps)
        return abandon, timeout

    def verdict(self, rid: str, now: float) -> str | None:
        f = self.items.get(rid)
        if f is None:
            return None
        abandon, timeout = self.deadlines(f)
        elapsed = now - f.started
        if elapsed > timeout:
            return "fetch_timeout"
        if elapsed > abandon:
            return "abandoned"
        return None


class Policy:
    def __init__(
        self,
        config: PolicyConfig | None = None,
        available: tuple[str, ...] = ("inproc",),
        estimators: dict | None = None,
    ) -> None:
        self.config = cfg = config or PolicyConfig()
        self.available = available
        # path -> estimate(wire bytes, decoded bytes, queue depth, link s/B) -> (fetch s, decode share):
        # a path's own model (the NVDEC path: Alg. 1 over its profiled decode table and its versions'
        # sizes, ``nvdec/adapter.py``) instead of the per-byte decode EWMA
        self.estimators = dict(estimators or {})
        self._lock = threading.Lock()
        # EWMAs of seconds per byte (not bytes per second): time estimates need the harmonic mean,
        # and one slow sample must be able to pull a fast estimate down.
        self.link_spb = Ewma(0.3, 1.0 / cfg.bw_initial_bps)
        self.decode_spb = {p: Ewma(0.3, 1.0 / cfg.decode_initial_bps) for p in PATHS}
        self.wire_ratio = {p: Ewma(0.3, 0.0) for p in PATHS}  # wire bytes per decoded byte, learned
        self.prefill = PrefillModel()
        self.inflight = InflightFetches(cfg)
        self.last_link_sample = self.last_probe = time.monotonic()  # (construction counts as both)
        self.probes = 0

    # -- observations ------------------------------------------------------------------------------
    def observe_fetch(
        self,
        path: str,
        nbytes: int,
        fetch_s: float,
        decoded_bytes: int,
        decode_s: float,
        now: float | None = None,
    ) -> None:
        with self._lock:
            if nbytes > 0 and fetch_s > 0:
                self._link_sample(fetch_s / nbytes, _now(now))
            # decode_s == 0 with a timed fetch: the path pipelines decode behind the transfer (the DPU
            # reports one job time), which ``fetch_s`` already holds; its separate decode cost is 0
            if decoded_bytes > 0 and (decode_s > 0 or fetch_s > 0):
                self.decode_spb[path].update(decode_s / decoded_bytes)
            if decoded_bytes > 0 and nbytes > 0:
                self.wire_ratio[path].update(nbytes / decoded_bytes)

    def wire_bytes(self, path: str, decoded_bytes: int, guess_ratio: float) -> int:
        """Expected wire bytes of ``decoded_bytes`` of KV on ``path``: the learned compression ratio of
        the path's fetches, ``guess_ratio`` before the first one."""
        r = self.wire_ratio[path]
        return int(decoded_bytes * (r.value if r.samples else guess_ratio))

    def _link_sample(self, spb: float, now: float) -> None:
        # stale: no *sample* for an interval (a probe's start is not one: its own sample must replace)
        stale = now - self.last_link_sample > self.config.probe_interval_s
        self.link_spb.update(spb, replace=stale)
        self.last_link_sample = now

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill.observe(tokens, seconds)

    # -- in-flight fetches (scheduler thread) --------------------------------------------------------
    def fetch_started(self, rid: str, decision: Decision, wire_bytes: int, now: float | None = None) -> None:
        now = _now(now)
        with self._lock:
            self.inflight.items[rid] = _Inflight(
                now, wire_bytes, decision.est_decode_s, decision.est_recompute_s
            )

    def check(self, rid: str, received: int = 0, link_s: float = 0.0, now: float | None = None) -> str | None:
        """Record a running fetch's progress; ``"abandoned"``/``"fetch_timeout"`` if it should stop."""
        with self._lock:
            f = self.inflight.items.get(rid)
            if f is not None and received > 0:
                f.received, f.link_s = received, link_s
            return self.inflight.verdict(rid, _now(now))

    def fetch_ended(self, rid: str, censored: bool = False, now: float | None = None) -> None:
        """Forget a fetch. ``censored`` (cancelled before the end): its elapsed/bytes bound is a sample."""
        now = _now(now)
        with self._lock:
            f = self.inflight.items.pop(rid, None)
            if f is not None and censored:  # a proven loss: the estimate must at least say so
                bound = f.spb_bound(now)
                self._link_sample(bound, now)
                self.link_spb.value = max(self.link_spb.value, bound)

    # -- decisions -----------------------------------------------------------------------------------
    def _candidates(self) -> tuple[str, ...]:
        mode = self.config.mode
        if mode == "auto":
            return self.available
        if mode in self.available:
            return (mode,)
        inproc = PathName.INPROC.value
        return (inproc,) if inproc in self.available else self.available

    def _estimate(self, path: str, nbytes: int, decoded: int, depth: int, spb: float) -> tuple[float, float]:
        """(fetch seconds, its decode share): transfer + the path's decode + the load into the pool (the
        device decode of staged codes, ``PolicyConfig.load_bps``; counted in full, not overlapped)."""
        load = decoded / self.config.load_bps if self.config.load_bps > 0 else 0.0
        est = self.estimators.get(path)
        if est is not None:
            t, dec = est(nbytes, decoded, depth, spb)
            return t + load, dec + load
        dec = decoded * self.decode_spb[path].value * (1 + depth) + load
        return nbytes * spb + dec, dec

    def decide(
        self,
        tokens: int,
        nbytes: int,
        decoded_bytes: int,
        queue_depth: dict[str, int],
        now: float | None = None,
    ) -> Decision:
        """Pick the path for fetching ``tokens`` tokens (``nbytes`` on the wire) on every path."""
        options = {p: (tokens, nbytes, decoded_bytes) for p in self._candidates()}
        return self.decide_among(options, queue_depth, now)

    def decide_among(
        self, options: dict[str, tuple[int, int, int]], queue_depth: dict[str, int], now: float | None = None
    ) -> Decision:
        """Pick among paths that may cover different prefix lengths.

        ``options[path] = (tokens, wire bytes, decoded bytes)`` that ``path`` could fetch. The winner
        maximises the time saved, ``margin * recompute(tokens) - fetch time``; recompute if no path
        saves time (unless a re-probe is due: see the module docstring).
        """
        now = _now(now)
        allowed = set(self._candidates())
        best, best_gain = Decision("recompute", float("inf"), 0.0), 0.0
        loser, loser_gain = None, -float("inf")  # the best path that does not win (probe candidate)
        with self._lock:
            spb = max(self.link_spb.value, self.inflight.spb_bound(now))
            for path, (tokens, nbytes, decoded) in options.items():
                if path not in allowed or tokens <= 0:
                    continue
                recompute = self.prefill.predict(tokens)
                t, dec = self._estimate(path, nbytes, decoded, queue_depth.get(path, 0), spb)
                gain = self.config.margin * recompute - t
                d = Decision(path, t, recompute, dec)
                if gain >= best_gain and (best.path == "recompute" or gain > best_gain):
                    best, best_gain = d, gain
                elif gain > loser_gain:
                    loser, loser_gain = d, gain
            if best.path == "recompute" and loser is not None:
                probe = self._probe_due(now)
                best = Decision(
                    loser.path if probe else "recompute",
                    loser.est_fetch_s,
                    loser.est_recompute_s,
                    loser.est_decode_s,
                    probe,
                )
                if probe:
                    self.last_probe, self.probes = now, self.probes + 1
        logger.debug("policy: options %s depth %s link %.3g s/B -> %s", options, queue_depth, spb, best)
        return best

    def _probe_due(self, now: float) -> bool:
        last = max(self.last_link_sample, self.last_probe)
        return not self.inflight.items and now - last >= self.config.probe_interval_s


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
