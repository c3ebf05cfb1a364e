"""Issue 16's leads, reproduced before anything is built on them: does a decorrelating transform pay?

Not a codec: a measurement. On the real SmolLM2 KV of ``benchmarks.kvdata`` (bf16, 1,792-token prefixes),
three quantizers are compared at several step sizes, each scored the same way:

- ``token-maxabs``: per token, per layer, K and V separately, uniform bins over [-max|x|, max|x|] of the
  token's channels (the default codec's family; K and V bins chosen per point);
- ``hadamard``: the same after an orthonormal Walsh-Hadamard transform of each head's ``head_dim``
  channels (TurboQuant/QuaRot-style rotation; inverse applied after dequantization);
- ``pca``: per layer and K/V, the eigenbasis of the channel covariance (all heads' channels together)
  fitted on the *tune* texts; per token a step of ``a`` x the token's RMS in that basis, the same step for
  every component (KVTC-like, without its bit allocation).

Size: the cross-entropy of the codes under frequency tables fitted on the tune texts (per layer, K/V and,
for ``pca``, per component; add-one smoothing), plus 2 bytes per token, layer and K/V for the scale: what
an ideal entropy coder with shipped tables would pay, not a real blob. Ratio = bf16 bytes / that size.
Quality: ``benchmarks.quality`` (mean next-token KL and top-1 over 64 teacher-forced positions against
recomputation) on the held-out texts. Keys carry RoPE here (undoing it is the issue's next lead; not
measured). Writes ``docs/results/transform_probe.json`` and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import kvdata, quality  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "transform_probe.json"


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"head_dim {n} is not a power of two")
    return (h / np.sqrt(n)).astype(np.float32)


class Scheme:
    """``forward(x, layer, kv) -> y`` (same shape ``[T, H*D]``) and its inverse; identity by default."""

    name = "token-maxabs"

    def fit(self, texts) -> None:
        pass

    def forward(self, x, layer, kv):
        return x

    def inverse(self, y, layer, kv):
        return y

    def quantize(self, y: np.ndarray, knob: float) -> tuple[np.ndarray, np.ndarray]:
        """Max-abs per token: ``knob`` bins; returns integer codes and per-token steps."""
        half = (knob - 1) / 2
        step = np.maximum(np.abs(y).max(axis=1, keepdims=True), 1e-12) / half
        return np.round(y / step).astype(np.int32), step


class Hadamard(Scheme):
    name = "hadamard"

    def __init__(self, heads: int, dim: int) -> None:
        self.h, self.heads, self.dim = hadamard(dim), heads, dim

    def forward(self, x, layer, kv):
        return (x.reshape(-1, self.heads, self.dim) @ self.h.T).reshape(x.shape)

    def inverse(self, y, layer, kv):
        return (y.reshape(-1, self.heads, self.dim) @ self.h).reshape(y.shape)


class PCA(Scheme):
    name = "pca"

    def __init__(self) -> None:
        self.basis: dict = {}

    def fit(self, texts) -> None:
        for t in texts:
            for kv, a in (("k", t.k), ("v", t.v)):
                x = kvdata.to_f32(a)
                for layer in range(x.shape[0]):
                    m = x[layer].reshape(x.shape[1], -1)
                    acc = self.basis.setdefault((layer, kv), np.zeros((m.shape[1], m.shape[1])))
                    acc += m.T.astype(np.float64) @ m
        for key, cov in self.basis.items():
            w, vecs = np.linalg.eigh(cov)
            self.basis[key] = vecs[:, ::-1].astype(np.float32)  # descending variance

    def forward(self, x, layer, kv):
        return x @ self.basis[(layer, kv)]

    def inverse(self, y, layer, kv):
        return y @ self.basis[(layer, kv)].T

    def quantize(self, y, knob):
        """Step = ``knob`` x the token's RMS in this basis, every component alike."""
        step = np.maximum(np.sqrt((y * y).mean(axis=1, keepdims=True)), 1e-12) * knob
        return np.round(y / step).astype(np.int32), step


def codes_of(scheme: Scheme, t, knobs: tuple[float, float]):
    """Per (layer, kv): codes [T, C], steps [T, 1], and the reconstruction (bf16 bits like the input)."""
    out, rec = {}, {}
    for kv, a, knob in (("k", t.k, knobs[0]), ("v", t.v, knobs[1])):
        x = kvdata.to_f32(a)
        r = np.empty_like(x)
        for layer in range(x.shape[0]):
            m = x[layer].reshape(x.shape[1], -1)
            y = scheme.forward(m, layer, kv)
            q, step = scheme.quantize(y, knob)
            out[(layer, kv)] = q
            r[layer] = scheme.inverse(q * step, layer, kv).reshape(x.shape[1:])
        rec[kv] = kvdata.f32_to_bf16(r)
    return out, rec


def fit_tables(codes_list, per_component: bool) -> dict:
    tables: dict = {}
    for codes in codes_list:
        for key, q in codes.items():
            cols = range(q.shape[1]) if per_component else [None]
            for c in cols:
                vals = q[:, c] if c is not None else q.ravel()
                hist = tables.setdefault(key + (c,), {})
                u, n = np.unique(vals, return_counts=True)
                for a, b in zip(u.tolist(), n.tolist(), strict=True):
                    hist[a] = hist.get(a, 0) + b
    return tables


def bits(codes, tables, per_component: bool) -> float:
    total = 0.0
    for key, q in codes.items():
        cols = range(q.shape[1]) if per_component else [None]
        for c in cols:
            vals = q[:, c] if c is not None else q.ravel()
            hist = tables.get(key + (c,), {})
            lo, hi = min([*hist, int(vals.min())]), max([*hist, int(vals.max())])
            counts = np.ones(hi - lo + 1)
            for a, b in hist.items():
                counts[a - lo] += b
            p = counts / counts.sum()
            total += float(-np.log2(p[vals - lo]).sum())
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    model, tok = kvdata.load_model(2)
    texts = kvdata.load_texts(None, (model, tok))
    tune = [t for t in texts if t.role == "tune"]
    held = [t for t in texts if t.role == "heldout"]
    base = {t.name: quality.recompute_baseline(model, t) for t in held}
    lay = held[0].k.shape
    heads, dim = lay[2], lay[3]
    grid = {
        "token-maxabs": [(256, 128), (256, 96), (192, 96), (128, 64)],
        "hadamard": [(256, 96), (128, 64), (96, 48), (64, 32)],
        "pca": [(0.05, 0.08), (0.08, 0.10), (0.10, 0.12), (0.14, 0.16)],
    }
    rows = []
    for scheme in (Scheme(), Hadamard(heads, dim), PCA()):
        scheme.fit(tune)
        per_comp = scheme.name == "pca"
        for knobs in grid[scheme.name]:
            tables = fit_tables([codes_of(scheme, t, knobs)[0] for t in tune], per_comp)
            raw = size = 0.0
            kls, top1s = [], []
            for t in held:
                codes, rec = codes_of(scheme, t, knobs)
                n_scales = 2 * t.k.shape[0] * t.k.shape[1]
                size += bits(codes, tables, per_comp) / 8 + 2 * n_scales
                raw += t.k.nbytes + t.v.nbytes
                q = quality.evaluate(model, t, base[t.name], rec["k"], rec["v"], greedy=False)
                kls.append(q["kl"])
                top1s.append(q["top1"])
            row = {"scheme": scheme.name, "k_knob": knobs[0], "v_knob": knobs[1], "ratio": raw / size,
                   "kl": float(np.mean(kls)), "top1": float(np.mean(top1s))}  # fmt: skip
            rows.append(row)
            print(f"{row['scheme']:13} K {knobs[0]:<5} V {knobs[1]:<5} ratio {row['ratio']:.2f}  "
                  f"KL {row['kl']:.5f}  top1 {row['top1']:.3f}", flush=True)  # fmt: skip
    args.out.write_text(json.dumps({"heldout": [t.name for t in held], "tune": [t.name for t in tune],
                                    "rows": rows}, indent=1) + "\n")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
