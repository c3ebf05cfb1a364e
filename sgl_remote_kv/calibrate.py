"""Calibrate the transform codec for one model: ``python -m sgl_remote_kv.calibrate --model-path DIR``.

Runs the model (transformers, float32, on the CPU) over calibration texts and fits, per (layer, K/V, head
group: ``--group-heads`` consecutive KV heads, by default all the heads one rank of ``--tp`` holds), the mean and PCA basis of position-free KV (RoPE undone on
keys; the first ``FIT_SKIP`` tokens of each text left out of the fit), then chooses the quantization steps
of every quality level in ``codec.calibration.LEVELS`` by measuring the model itself:

0. within a (layer, K/V), each component's step is shaped by how much the model sees of it: keys by the
   energy of the queries that read them (per RoPE pair, averaged over rotations), values by the norm
   their direction gets through the output projection; ``step_c ~ 1/sqrt(weight_c)`` (the rate-optimal
   shape for a weighted squared error), geometric mean 1;
1. sensitivity: the next-token KL (against the exact KV) when only one (layer, K/V) is coded at a
   reference step, for every (layer, K/V);
2. allocation: with KL roughly additive and proportional to step^2, equal KL shares are the
   rate-optimal split, so each (layer, K/V) gets ``step = ref * sqrt(share / its KL)``;
3. a global factor per level, bisected until the KL of everything coded at once is ``MARGIN`` x the
   level's target on the calibration texts (the floor is judged on texts the calibration never saw);
4. the rANS frequencies of the symbols those steps produce.

Writes ``<cache>/calibration/<id>.npz`` (``codec.calibration``), which servers of this model load at
start. Minutes on 2 CPU cores for a 135M model. The texts should resemble what the tier will serve
(default: ``calibration_texts.CALIBRATION``, every kind of text); never calibrate on the texts you
report quality on.

Reproducible: the same model, texts and code give the same calibration id on any x86-64 machine. The
CLI re-executes itself with pinned numerics (``env.pinned_numerics_env``: AVX2 code paths in torch,
MKL, oneDNN, OpenBLAS and numba, strict MKL reproducibility, ``--threads`` threads), the fit has no
random step, its reductions run in a fixed order, and its report (covered by the id) holds no timing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgl_remote_kv import calibration_texts, env
from sgl_remote_kv.codec import calibration as calib_mod
from sgl_remote_kv.codec import rans, transform_ops
from sgl_remote_kv.types import KVLayout, ModelFingerprint, RopeSpec

logger = logging.getLogger(__name__)

PREFIX, CONT, FIT_SKIP = 1792, 64, 4
SINKS = 1  # positions stored exactly (the attention sink); measured: 4 gave the same KL as 1 here
REF_STEP = 0.15
MARGIN = 0.6  # calibrate to this fraction of each level's KL target
STEP_RANGE = (0.004, 2.0)
PROBE = calib_mod.DEFAULT_LEVEL  # the level name provisional calibrations carry their candidate steps under
BISECT = 5
# The fit's thread count, part of what makes it reproducible (measured: the model's KV has equal bits at 1
# and 2 threads). One: an OpenMP team of 2 on a busy 2-core machine spent 7.8 CPU-s per KL evaluation
# instead of 1.2 (spinning at barriers).
THREADS = 1


@dataclass
class Text:
    name: str
    digest: str  # SHA-256 of the text as the model read it
    prefix: np.ndarray  # [P] int64
    cont: np.ndarray  # [C] int64
    k: np.ndarray  # [L, P, H, D] float32 (RoPE applied, as cached)
    v: np.ndarray
    base_logp: object  # torch [C, vocab] from the exact KV
    q_energy: np.ndarray | None  # [L, query heads, D] mean squared pre-RoPE query (None: not found)


class Scorer:
    """The model, and the KL of continuations under a prefix KV against the exact one."""

    def __init__(self, model_path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()

    def text(self, name: str, content: str) -> Text:
        ids = np.asarray(self.tok(content)["input_ids"], np.int64)
        if len(ids) < 512 + CONT:
            raise ValueError(f"{name}: {len(ids)} tokens, need >= {512 + CONT}")
        p = min(PREFIX, (len(ids) - CONT) // 256 * 256)
        layers_mod = getattr(getattr(self.model, "model", None), "layers", None) or []
        qs: dict[int, np.ndarray] = {}
        hooks = [
            lay.self_attn.q_proj.register_forward_hook(
                lambda _m, _i, o, i=i: qs.__setitem__(i, o[0, FIT_SKIP:p].detach().numpy())
            )
            for i, lay in enumerate(layers_mod)
            if hasattr(getattr(lay, "self_attn", None), "q_proj")
        ]
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.from_numpy(ids[None, : p + CONT]), use_cache=True)
        for h in hooks:
            h.remove()
        logp = self.torch.log_softmax(out.logits[0, p:].float(), -1)
        layers = out.past_key_values.layers
        k = np.stack([lay.keys[0, :, :p].permute(1, 0, 2).numpy() for lay in layers])
        v = np.stack([lay.values[0, :, :p].permute(1, 0, 2).numpy() for lay in layers])
        q = None
        if len(qs) == k.shape[0]:
            d = k.shape[3]
            q = np.stack(
                [np.mean(np.square(qs[i].reshape(qs[i].shape[0], -1, d)), axis=0) for i in range(len(qs))]
            )
        digest = hashlib.sha256(content.encode()).hexdigest()
        return Text(name, digest, ids[:p], ids[p : p + CONT], k, v, logp, q)

    def out_proj(self, layer: int) -> np.ndarray | None:
        """The output projection [hidden, query heads * D] of ``layer`` (None if not Llama-like)."""
        try:
            return self.model.model.layers[layer].self_attn.o_proj.weight.detach().numpy()
        except AttributeError:
            return None

    def kl(self, t: Text, k: np.ndarray, v: np.ndarray) -> tuple[float, float]:
        """(mean KL in nats, top-1 agreement) of the continuation given prefix KV ``k, v`` (float32)."""
        from transformers import DynamicCache

        torch = self.torch
        pairs = [
            (
                torch.from_numpy(np.ascontiguousarray(k[i].transpose(1, 0, 2)))[None],
                torch.from_numpy(np.ascontiguousarray(v[i].transpose(1, 0, 2)))[None],
            )
            for i in range(k.shape[0])
        ]
        cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
        n = k.shape[1]
        with torch.no_grad():
            out = self.model(
                input_ids=torch.from_numpy(t.cont[None]),
                past_key_values=cache,
                position_ids=torch.arange(n, n + len(t.cont))[None],
                use_cache=True,
            )
        logp = torch.log_softmax(out.logits[0].float(), -1)
        kl = (t.base_logp.exp() * (t.base_logp - logp)).sum(-1).clamp_min(0)
        top1 = (t.base_logp.argmax(-1) == logp.argmax(-1)).float().mean()
        return float(kl.mean()), float(top1)


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


def fingerprint_for(model_path: Path, cfg: dict) -> ModelFingerprint:
    from sgl_remote_kv.model import model_identity

    n_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    lay = KVLayout(cfg["num_hidden_layers"], n_kv, d, "float32")
    return ModelFingerprint(
        (cfg.get("architectures") or ["unknown"])[0], lay, model_identity(model_path, cfg)
    )


def calibrate(
    model_path: Path,
    sources: list[calibration_texts.TextSource],
    levels: tuple[str, ...] = calib_mod.LEVELS,
    out_dir: Path | None = None,
    group_heads: int | None = None,
    log=print,
) -> calib_mod.Calibration:
    """Fit and save a calibration; ``group_heads``: KV heads per transform (default all of them)."""
    cfg = json.loads((model_path / "config.json").read_text())
    rope = RopeSpec.from_hf_config(cfg)
    fp = fingerprint_for(model_path, cfg)
    heads = fp.layout.num_kv_heads
    group_heads = group_heads or heads
    if heads % group_heads:
        raise ValueError(f"{heads} KV heads do not split into groups of {group_heads}")
    t0 = time.monotonic()
    scorer = Scorer(model_path)
    texts = [scorer.text(s.name, s.text(scorer.tok)) for s in sources]
    log(f"texts: {', '.join(f'{t.name} ({len(t.prefix)}+{len(t.cont)} tokens)' for t in texts)}")
    mean, basis = fit_basis(texts, rope, heads // group_heads)
    cal = Calibrator(
        scorer, texts, calib_mod.model_key(fp), rope, mean, basis, step_shape(scorer, texts, basis, rope)
    )
    sens = cal.sensitivity()
    log(f"sensitivity measured ({cal.evals} evaluations, {time.monotonic() - t0:.0f} s)")
    steps, freq, rows = {}, {}, []
    for lv in levels:
        s, row = cal.level_steps(sens, float(lv))
        steps[lv], freq[lv] = s, cal.tables(s)
        rows.append(
            {"level": lv, **row, "mean_step_k": float(s[:, 0].mean()), "mean_step_v": float(s[:, 1].mean())}
        )
        log(
            f"level {lv}: KL {row['kl']:.5f} top-1 {row['top1']:.3f} on the calibration texts "
            f"(mean step K {rows[-1]['mean_step_k']:.3f} V {rows[-1]['mean_step_v']:.3f})"
        )
    report = {
        "texts": [t.name for t in texts],
        "text_sha256": [t.digest for t in texts],
        "prefix": PREFIX,
        "cont": CONT,
        "margin": MARGIN,
        "group_heads": group_heads,
        "ref_step": REF_STEP,
        "levels": rows,
        "sensitivity": sens.tolist(),
    }
    result = calib_mod.Calibration(
        cal.key, rope, mean, basis, steps, freq, json.dumps(report, sort_keys=True), sinks=cal.sinks
    )
    path = result.save(out_dir)
    calib_mod.register(result)
    log(f"wrote {path} ({cal.evals} model evaluations, {time.monotonic() - t0:.0f} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", type=Path, required=True, help="local HF model directory")
    ap.add_argument(
        "--text",
        type=Path,
        action="append",
        default=None,
        help="calibration text file (repeatable; default: the built-in set of every kind, "
        f"{', '.join(calibration_texts.CALIBRATION)})",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help=f"threads of the fit (default {THREADS}; another count may give another calibration id)",
    )
    ap.add_argument("--levels", default=",".join(calib_mod.LEVELS), help="quality levels (KL targets) to fit")
    ap.add_argument(
        "--tp", type=int, default=1, help="TP size the servers run with (each rank's heads: one group)"
    )
    ap.add_argument(
        "--group-heads",
        type=int,
        default=None,
        help="KV heads per transform (default: all of one rank's); 1 = a third of the decode work "
        "on a 3-head model, at some ratio",
    )
    ap.add_argument("--out", type=Path, default=None, help=f"directory (default {calib_mod.default_dir()})")
    ap.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when a calibration of this model, TP size and every level exists",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.text:
        sources = [
            calibration_texts.TextSource(p.name, calibration_texts.TextKind.PROSE, lambda p=p: p)
            for p in args.text
        ]
    else:
        sources = calibration_texts.calibration_sources()
    levels = tuple(lv.strip() for lv in args.levels.split(",") if lv.strip())
    bad = [lv for lv in levels if lv not in calib_mod.LEVELS]
    missing = [p for p in sources if not p.path.is_file()]
    if not args.model_path.is_dir() or not (args.model_path / "config.json").is_file():
        ap.error(f"{args.model_path} is not a model directory with a config.json")
    if missing:
        ap.error(f"calibration text missing: {', '.join(str(s.path) for s in missing)}; pass --text FILE")
    for s in sources:
        if why := s.check():  # found but not the pinned text: the fit works, its id will differ
            logger.warning("%s: the calibration id will differ from the published one", why)
    if bad or not levels:
        ap.error(f"levels must be among {','.join(calib_mod.LEVELS)}")
    cfg = json.loads((args.model_path / "config.json").read_text())
    fp = fingerprint_for(args.model_path, cfg)
    heads = fp.layout.num_kv_heads
    if args.tp < 1 or heads % args.tp:
        ap.error(f"{heads} KV heads do not split over --tp {args.tp}")
    group_heads = args.group_heads or heads // args.tp
    if args.if_missing:
        calib_mod.load_dir(args.out) if args.out else calib_mod.load_dir()
        have = [
            c
            for c in calib_mod.registered()
            if c.model_key == calib_mod.model_key(fp)
            and c.group_dim == group_heads * fp.layout.head_dim
            and set(levels) <= set(c.levels)
            and json.loads(c.report).get("texts") == [t.name for t in sources]
        ]
        if have:
            print(
                f"calibration {have[-1].calib_id.hex()} exists for this model ({group_heads} heads per group, "
                "these texts)"
            )
            return 0
    try:
        calibrate(args.model_path, sources, levels, args.out, group_heads)
    except ValueError as e:  # RoPE this codec cannot undo, texts too short, ...
        print(f"calibration failed: {e}", file=sys.stderr)
        return 2
    return 0


def _reexec_pinned() -> None:
    """Run this CLI again in a process whose numeric libraries load with pinned code paths (see module doc)."""
    threads = THREADS
    for i, a in enumerate(sys.argv[1:], 1):  # argparse validates it after the re-exec
        if a.startswith("--threads="):
            threads = int(a.split("=", 1)[1])
        elif a == "--threads" and i + 1 < len(sys.argv):
            threads = int(sys.argv[i + 1])
    cmd = [sys.executable, "-m", "sgl_remote_kv.calibrate", *sys.argv[1:]]
    os.execve(sys.executable, cmd, env.pinned_numerics_env(threads))


if __name__ == "__main__":
    if not env.numerics_pinned():
        _reexec_pinned()
    sys.exit(main())
