"""The fit of a transform-codec calibration (``cli.py`` runs it on the texts ``Scorer`` read).

Fits, per (layer, K/V, head group of consecutive KV heads), the mean and PCA basis of position-free KV
(RoPE undone on keys; the first ``FIT_SKIP`` tokens of each text left out of the fit: ``fit_basis``), then
chooses the quantization steps of every quality level in ``codec.calibration.LEVELS`` by measuring the
model itself (``Calibrator``):

0. within a (layer, K/V), each component's step is shaped by how much the model sees of it: keys by the
   energy of the queries that read them (per RoPE pair, averaged over rotations), values by the norm
   their direction gets through the output projection; ``step_c ~ 1/sqrt(weight_c)`` (the rate-optimal
   shape for a weighted squared error), geometric mean 1 (``step_shape``);
1. sensitivity: the next-token KL (against the exact KV) when only one (layer, K/V) is coded at a
   reference step, for every (layer, K/V);
2. allocation: with KL roughly additive and proportional to step^2, equal KL shares are the
   rate-optimal split, so each (layer, K/V) gets ``step = ref * sqrt(share / its KL)``;
3. a global factor per level, bisected until the KL of everything coded at once is ``MARGIN`` x the
   level's target on the calibration texts (the floor is judged on texts the calibration never saw);
4. the rANS frequencies of the symbols those steps produce (``Calibrator.tables``).

Reproducible: the fit has no random step and its reductions run in a fixed order (the thread count is
pinned by ``cli.py``).
"""

from __future__ import annotations

import logging

import numpy as np

from sgl_remote_kv.codec import calibration as calib_mod
from sgl_remote_kv.codec import rans, transform_ops
from sgl_remote_kv.codec.calibration.scorer import FIT_SKIP, Scorer, Text
from sgl_remote_kv.types import RopeSpec

logger = logging.getLogger(__name__)

SINKS = 1  # positions stored exactly (the attention sink); measured: 4 gave the same KL as 1 here
REF_STEP = 0.15
MARGIN = 0.6  # calibrate to this fraction of each level's KL target
STEP_RANGE = (0.004, 2.0)
PROBE = calib_mod.DEFAULT_LEVEL  # the level name provisional calibrations carry their candidate steps under
BISECT = 5


def position_free(t: Text, layer: int, kv: int, rope: RopeSpec) -> np.ndarray:
    """[T, H, D] float32 KV of ``layer`` with RoPE undone on keys."""
    x = np.array((t.k if kv == 0 else t.v)[layer], np.float32)
    if kv == 0:
        transform_ops.apply_rope(x, rope, 0, -1.0)
    return x


def fit_basis(texts: list[Text], rope: RopeSpec, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean [L, 2, G, C] and PCA basis [L, 2, G, C, C] (descending variance) of position-free KV, where
    each of the ``groups`` groups holds ``H / groups`` consecutive KV heads (C = their channels)."""
    n_l, _, n_h, d = texts[0].k.shape
    c = n_h // groups * d
    mean = np.zeros((n_l, 2, groups, c), np.float32)
    basis = np.zeros((n_l, 2, groups, c, c), np.float32)
    for layer in range(n_l):
        for kv in range(2):
            x = np.concatenate([position_free(t, layer, kv, rope)[FIT_SKIP:] for t in texts]).astype(
                np.float64
            )
            x = x.reshape(x.shape[0], groups, c)
            for g in range(groups):
                mu = x[:, g].mean(0)
                xc = x[:, g] - mu
                w, vecs = np.linalg.eigh(xc.T @ xc)
                mean[layer, kv, g], basis[layer, kv, g] = mu, vecs[:, ::-1]
    return mean, basis


def step_shape(scorer: Scorer, texts: list[Text], basis: np.ndarray, rope: RopeSpec) -> np.ndarray:
    """Per-component step factors [L, 2, G, C] (geometric mean 1 per (layer, K/V, group)) from how much
    the model sees of each component; all ones when the model's attention modules are not Llama-like."""
    n_l, _, groups, c, _ = basis.shape
    shape = np.ones((n_l, 2, groups, c), np.float32)
    if any(t.q_energy is None for t in texts):
        logger.warning("query projections not found: components get equal steps")
        return shape
    d = rope.rotary_dim
    n_kv = groups * c // d
    for layer in range(n_l):
        wo = scorer.out_proj(layer)
        qe = np.mean([t.q_energy[layer] for t in texts], axis=0)  # [query heads, D]
        per_kv = qe.shape[0] // n_kv
        w_k = np.empty(n_kv * d)
        w_v_blocks = []
        for h in range(n_kv):
            e = qe[h * per_kv : (h + 1) * per_kv].sum(0)
            half = d // 2
            pair = (
                (e[:half] + e[half:]) / 2 if rope.style == "neox" else np.repeat((e[0::2] + e[1::2]) / 2, 2)
            )
            w_k[h * d : (h + 1) * d] = np.concatenate([pair, pair]) if rope.style == "neox" else pair
            if wo is not None:
                cols = [wo[:, qh * d : (qh + 1) * d] for qh in range(h * per_kv, (h + 1) * per_kv)]
                w_v_blocks.append(sum(m.T @ m for m in cols))
        for g in range(groups):
            b_k, b_v = basis[layer, 0, g].astype(np.float64), basis[layer, 1, g].astype(np.float64)
            wk = (np.square(b_k) * w_k[g * c : (g + 1) * c, None]).sum(0)
            if w_v_blocks:
                m_v = np.zeros((c, c))
                for j in range(c // d):
                    m_v[j * d : (j + 1) * d, j * d : (j + 1) * d] = w_v_blocks[g * (c // d) + j]
                wv = np.einsum("dc,de,ec->c", b_v, m_v, b_v)
            else:
                wv = np.ones(c)
            for kv, w in ((0, wk), (1, wv)):
                f = np.maximum(w, w.max() * 1e-6) ** -0.5
                shape[layer, kv, g] = f / np.exp(np.log(f).mean())
    return shape


def _uniform_freq(n_l: int, c: int) -> np.ndarray:
    return np.full((n_l, 2, c, calib_mod.SYMBOLS), (1 << rans.PROB_BITS) // calib_mod.SYMBOLS, np.uint16)


class Calibrator:
    def __init__(
        self,
        scorer: Scorer,
        texts: list[Text],
        key: bytes,
        rope: RopeSpec,
        mean,
        basis,
        shape: np.ndarray,
        sinks: int = SINKS,
    ) -> None:
        self.scorer, self.texts, self.key, self.rope, self.sinks = scorer, texts, key, rope, sinks
        self.mean, self.basis, self.step_shape = mean, basis, shape
        n_l, _, groups, c = mean.shape
        self.shape = (n_l, 2, groups, c)
        self._freq = _uniform_freq(n_l, groups * c)
        self.evals = 0

    def provisional(self, steps: np.ndarray) -> calib_mod.Calibration:
        return calib_mod.Calibration(
            self.key, self.rope, self.mean, self.basis, {PROBE: steps}, {PROBE: self._freq}, sinks=self.sinks
        )

    def _code(self, cal: calib_mod.Calibration, a: np.ndarray, layer: int, kv: int) -> np.ndarray:
        g_n = self.shape[2]
        hg = a.shape[2] // g_n
        return np.concatenate(
            [
                transform_ops.roundtrip(cal, PROBE, layer, kv, a[layer][:, g * hg : (g + 1) * hg], 0, g)
                for g in range(g_n)
            ],
            axis=1,
        )

    def score(self, steps: np.ndarray, only: tuple[int, int] | None = None) -> tuple[float, float]:
        """Mean (KL, top-1) over the texts with KV coded at ``steps`` (only one (layer, kv) if given)."""
        cal = self.provisional(steps)
        kls, tops = [], []
        for t in self.texts:
            k, v = t.k, t.v
            if only is None:
                k = np.stack([self._code(cal, t.k, i, 0) for i in range(k.shape[0])])
                v = np.stack([self._code(cal, t.v, i, 1) for i in range(v.shape[0])])
            else:
                layer, kv = only
                k, v = t.k.copy(), t.v.copy()
                dst = k if kv == 0 else v
                dst[layer] = self._code(cal, dst, layer, kv)
            kl, top = self.scorer.kl(t, k, v)
            kls.append(kl)
            tops.append(top)
            self.evals += 1
        return float(np.mean(kls)), float(np.mean(tops))

    def sensitivity(self) -> np.ndarray:
        """KL [L, 2] of coding only that (layer, K/V) at ``REF_STEP``."""
        n_l = self.shape[0]
        sens = np.zeros((n_l, 2))
        steps = (REF_STEP * self.step_shape).astype(np.float32)
        for layer in range(n_l):
            for kv in range(2):
                sens[layer, kv] = max(self.score(steps, (layer, kv))[0], 1e-9)
        return sens

    def level_steps(self, sens: np.ndarray, target: float) -> tuple[np.ndarray, dict]:
        share = target * MARGIN / sens.size
        per = np.clip(REF_STEP * np.sqrt(share / sens), *STEP_RANGE)
        lo, hi = 0.25, 4.0
        best = None
        for _ in range(BISECT):
            g = float(np.sqrt(lo * hi))
            steps = self._steps(per * g)
            kl, top = self.score(steps)
            if kl <= target * MARGIN:
                lo, best = g, (steps, {"kl": kl, "top1": top, "factor": g})
            else:
                hi = g
        if best is None:  # even the finest factor misses the target: keep it, and say so
            steps = self._steps(per * lo)
            kl, top = self.score(steps)
            best = (steps, {"kl": kl, "top1": top, "factor": lo, "missed": True})
        return best

    def _steps(self, per_layer: np.ndarray) -> np.ndarray:
        """[L, 2] step factors spread over components by the step shape, clipped to ``STEP_RANGE``."""
        return np.clip(per_layer[:, :, None, None] * self.step_shape, *STEP_RANGE).astype(np.float32)

    def tables(self, steps: np.ndarray, smoothing: float = 0.5) -> np.ndarray:
        """rANS frequencies [L, 2, C, 256] of the calibration texts' symbols at ``steps``: observed
        symbols, their neighbours within 2 and the escape stay codable; anything else is escaped."""
        cal = self.provisional(steps)
        n_l, _, g_n, c = self.shape
        counts = np.zeros((n_l, 2, g_n * c, calib_mod.SYMBOLS))
        offs = (np.arange(c) * calib_mod.SYMBOLS)[:, None]
        for t in self.texts:
            hg = t.k.shape[2] // g_n
            for layer in range(n_l):
                for kv, a in enumerate((t.k, t.v)):
                    for g in range(g_n):
                        x = a[layer][:, g * hg : (g + 1) * hg]
                        sym = transform_ops.symbols(cal, PROBE, layer, kv, x, 0, g).astype(np.int64)
                        hist = np.bincount((sym + offs).ravel(), minlength=c * 256).reshape(c, 256)
                        counts[layer, kv, g * c : (g + 1) * c] += hist
        seen = counts > 0
        near = seen.copy()
        for s in (1, 2):
            near[..., s:] |= seen[..., :-s]
            near[..., :-s] |= seen[..., s:]
        counts += near * smoothing
        counts[..., transform_ops.ESC] += 1.0
        flat = rans.normalize_counts(counts.reshape(-1, calib_mod.SYMBOLS), rans.PROB_BITS)
        return flat.reshape(counts.shape)
