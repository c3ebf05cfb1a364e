"""Rate-distortion sweep (issue 11): every codec family's quality knobs, on real SmolLM2 KV.

Each point is one codec configuration run over every text (``benchmarks.bench_codec.EvalContext``): ratio
(bf16 bytes / blob bytes incl. headers and tables), mean next-token KL and top-1 against recomputation,
greedy match. Points are cached in ``.cache/rd_points.json`` (keyed by codec, params, text set, the
transform codec's calibration and a digest of the codec sources, so a changed encoder or calibration is a
new point) so an interrupted sweep resumes.

Selection is honest: for each family and floor the best-ratio configuration is chosen on the ``tune``
texts only, then reported on the ``heldout`` texts (``benchmarks.kvdata.TEXT_SOURCES`` says which).
Floors: near-lossless = mean KL <= 0.001 nats and top-1 >= 0.98; loose = mean KL <= 0.01.

Per kind of text (``per_kind``: prose, code, JSON, non-English prose, chat turns; held-out texts of
that kind only): our best point at KL <= 0.001 and the transform codec at the default level, each
against the best peer point (every budget of every peer family) of at most the same KL on those texts,
with ``meets_goal`` (>= 1.5x that peer) and ``meets_stretch`` (>= 2x).

The transform codec's numbers come from the calibration a user's ``make calibration`` makes: the
registered one must have been fitted on the default text set, and its id is recorded (``meta.calibration``);
``--fresh-calibration`` fits one from scratch first (``python -m sgl_remote_kv.codec.calibration``, pinned
numerics) into the cache directory.

Writes ``docs/results/codec_rd.json`` and the plots ``codec_rd_kl.png`` / ``codec_rd_top1.png``.
CLI: ``python -m benchmarks.bench_codec_rd [--families a,b] [--greedy] [--texts a,b]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import kvdata  # noqa: E402
from benchmarks.bench_codec import (  # noqa: E402
    CACHEGEN_K,
    CACHEGEN_V,
    OUT,
    PEER_ROWS,
    EvalContext,
    Spec,
    quant,
    spec_row,
    tune_calibration,
)

RD_OUT = OUT.with_name("codec_rd.json")
POINTS_CACHE = kvdata.CACHE.parent / "rd_points.json"
FLOORS = {"near_lossless": {"kl": 0.001, "top1": 0.98}, "loose": {"kl": 0.01, "top1": 0.0}}
OURS = (
    "ours-deflate",
    "ours-rans",
    "transform-deflate",
    "transform-rans",
    "transform-auto",
    "transform-trellis",
    "transform-rans-perhead",
)
PEERS = ("cachegen", "shadowserve", "int8", "kvtc", "turboquant", "turboquant-prod", "turboquant-vllm", "ans")
# the transform codec's families: label stem, and its params before / after the quality level (the params
# tuple is part of a point's cache key, so its order stays)
TRANSFORM_FAMILIES = {
    "transform-deflate": ("transform deflate", (("entropy", "deflate"),), ()),
    "transform-rans": ("transform rans", (("entropy", "rans"),), ()),
    "transform-auto": ("transform auto", (("entropy", "auto"),), ()),
    "transform-trellis": (
        "transform deflate trellis",
        (("entropy", "deflate"),),
        (("quantizer", "trellis"),),
    ),
    "transform-rans-perhead": (
        "transform rans, per-head transform,",
        (("entropy", "rans"), ("group_heads", 1)),
        (),
    ),
}
GOAL, STRETCH = 1.5, 2.0  # issue 38: ratio against the best peer of at most the same KL, per kind of text
KVTC_BITS = ("1", "1.5", "2", "2.5", "3", "3.5", "4", "5", "6", "8")
UNIFORM = ("256", "192", "128", "96", "64", "32")


def _scaled_cachegen(f: int) -> tuple[str, str]:
    """CacheGen's layer-group shape with f times its bins (capped at 256)."""
    return tuple(
        ",".join(f"{min(256, int(b) * f)}@{s}" for b, s in (p.split("@") for p in x.split(",")))
        for x in (CACHEGEN_K, CACHEGEN_V)
    )


def family_specs(family: str) -> list[Spec]:
    """The knob grid of one family."""
    if family in ("ours-deflate", "ours-rans"):
        codec = "quant_deflate" if family == "ours-deflate" else "quant_rans"
        out = []
        for gran, cs in (("token", False), ("head", True), ("token", True), ("head", False)):
            for b in UNIFORM if (gran, cs) == ("token", False) else UNIFORM[:-1]:
                out.append(quant(f"{b}b/{gran}{'+kcs' if cs else ''}", family, codec, b, b, gran, cs))
        asym = [
            quant(f"K{kb}/V{vb}/{g}{'+kcs' if cs else ''}", family, codec, kb, vb, g, cs)
            for kb, vb, g, cs in (
                ("256", "128", "token", False),
                ("128", "256", "token", False),
                ("256", "192", "token", False),
                ("256", "96", "token", False),
                ("256", "64", "token", False),
                ("192", "96", "token", False),
                ("256", "128", "head", True),
                ("256", "64", "head", True),
            )
        ]
        from sgl_remote_kv.codec.base import DEFAULT_K_BINS, DEFAULT_V_BINS

        dv = DEFAULT_V_BINS
        extra = [
            quant(f"codec default K{DEFAULT_K_BINS}/V{dv}/token", family, codec, DEFAULT_K_BINS, dv),
            quant("K128+4 exact/V128/token", family, codec, "128", "128", k_outliers=4),
            quant(f"K128+4 exact/V{dv}/token", family, codec, "128", dv, k_outliers=4),
        ]
        n = len(UNIFORM)
        return out[:n] + extra + asym[:6] + out[n : n + 4] + asym[6:] + out[n + 4 :]
    if family in ("cachegen", "shadowserve"):
        codec = "cachegen" if family == "cachegen" else "quant_deflate"
        out = [quant(f"{b}b/token", family, codec, b, b) for b in UNIFORM]
        for f in (1, 2, 4, 8):
            k, v = _scaled_cachegen(f)
            out.append(quant(f"CacheGen bins x{f} ({k} | {v})", family, codec, k, v))
        return out
    if family in TRANSFORM_FAMILIES:
        from sgl_remote_kv.codec.calibration import LEVELS

        stem, before, after = TRANSFORM_FAMILIES[family]
        return [
            Spec(f"{stem} KL<={lv}", family, "transform", (*before, ("quality", lv), *after)) for lv in LEVELS
        ]
    if family == "kvtc":
        return [Spec(f"KVTC {b} bits/value", family, "kvtc", (("bits", b),)) for b in KVTC_BITS]
    if family.startswith("turboquant") or family == "ans":  # peers in benchmarks/ (bench_codec.PEER_ROWS)
        codec = "ans" if family == "ans" else "turboquant"
        mod = importlib.import_module(PEER_ROWS[codec])
        return [Spec(label, family, codec, tuple(sorted(p.items()))) for label, p in mod.grid(family)]
    if family == "int8":
        return [quant("256b/token stored", family, "quant_deflate", method="raw")]
    if family == "lossless":
        return [Spec("zstd byte-shuffled", family, "lossless", (("method", "zstd"),))]
    raise KeyError(family)


FAMILIES = (
    "lossless",
    "int8",
    "shadowserve",
    "cachegen",
    "kvtc",
    "turboquant",
    "turboquant-prod",
    "turboquant-vllm",
    "ans",
    "ours-deflate",
    "ours-rans",
    "transform-deflate",
    "transform-rans",
    "transform-auto",
    "transform-rans-perhead",
)


def _code_digest() -> str:
    """BLAKE2b of the codec sources (``sgl_remote_kv/codec``) and the KVTC peer's: any change to them is a
    new point, whatever its params say."""
    import hashlib

    from sgl_remote_kv import codec

    h = hashlib.blake2b(digest_size=8)
    for f in sorted([*Path(codec.__file__).parent.glob("*.py"), Path(__file__).with_name("kvtc_peer.py")]):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _key(spec: Spec, ctx: EvalContext) -> str:
    """A point's cache key: codec, params, texts, the codec sources and, for the transform codec, the
    calibration it would use."""
    texts = ",".join(sorted(t.name for t in ctx.texts))
    params = dict(spec.params, code=_CODE_DIGEST)
    if spec.codec in PEER_ROWS:  # and its own source
        src = Path(importlib.import_module(PEER_ROWS[spec.codec]).__file__).read_bytes()
        params["peer_code"] = hashlib.blake2b(src, digest_size=8).hexdigest()
    if spec.codec == "transform":
        try:
            params["calibration"] = tune_calibration(
                ctx, params["quality"], params.get("group_heads")
            ).calib_id.hex()
        except (ValueError, KeyError):
            params["calibration"] = None
    return json.dumps([spec.codec, params, texts, ctx.greedy], sort_keys=True)


_CODE_DIGEST = _code_digest()


def _jobs(families: list[str], levels: tuple[str, ...] | None = None) -> list[tuple[str, Spec]]:
    """(family, spec) in run order; each ours-rans config right after its ours-deflate twin (same
    quantization, so its quality is a memo hit) so that an interrupted sweep still compares them. The
    transform families run level by level (finest first), only ``levels`` if given."""
    jobs = [(f, s) for f in families if f != "ours-rans" for s in family_specs(f)]
    quality = {s.label: dict(s.params).get("quality") for _, s in jobs}
    if levels is not None:
        jobs = [(f, s) for f, s in jobs if quality[s.label] is None or quality[s.label] in levels]
    order = {lv: i for i, lv in enumerate(sorted({q for q in quality.values() if q}, key=float))}
    jobs.sort(
        key=lambda fs: order.get(quality[fs[1].label], -1)
    )  # stable: non-transform jobs keep their order
    if "ours-rans" not in families:
        return jobs
    rans = {s.label: s for s in family_specs("ours-rans")}
    out = []
    for f, s in jobs:
        out.append((f, s))
        if f == "ours-deflate" and s.label in rans:
            out.append(("ours-rans", rans.pop(s.label)))
    return out + [("ours-rans", s) for s in rans.values()]


def sweep(ctx: EvalContext, families: list[str], levels: tuple[str, ...] | None = None) -> list[dict]:
    cache = json.loads(POINTS_CACHE.read_text()) if POINTS_CACHE.exists() else {}
    points = []
    for fam, spec in _jobs(families, levels):
        key = _key(spec, ctx)
        if key not in cache:
            t0 = time.perf_counter()
            try:
                row = spec_row(ctx, spec, timing=False)
            except LookupError:
                continue
            if row is None:
                continue
            row["eval_s"] = round(time.perf_counter() - t0, 1)
            cache[key] = row
            POINTS_CACHE.write_text(json.dumps(cache))
            print(
                f"  {fam:12s} {spec.label:40s} ratio {row['ratio']:6.2f} kl {row['kl']:.5f} "
                f"top1 {row['top1']:.3f} ({row['eval_s']} s)",
                file=sys.stderr,
            )
        points.append({**cache[key], "family": fam, "codec": spec.label})
    return points


def subset_metrics(point: dict, role: str | None) -> dict | None:
    """Aggregate a point's per-text results over texts of ``role`` (None: all)."""
    pt = [p for p in point["per_text"].values() if role is None or p["role"] == role]
    if not pt:
        return None
    res = {"ratio": sum(p["bf16_bytes"] for p in pt) / sum(p["blob_bytes"] for p in pt), "texts": len(pt)}
    for k in ("kl", "top1", "greedy_match"):
        vals = [p[k] for p in pt if p.get(k) is not None]
        res[k] = float(np.mean(vals)) if vals else None
    return res


def meets(m: dict, floor: dict) -> bool:
    return m["kl"] <= floor["kl"] and m["top1"] >= floor["top1"]


def best_at_floors(points: list[dict], tune_role: str = "tune", report_role: str = "heldout") -> dict:
    """Per floor and family: best-ratio config on the tune texts, with its held-out and all-text numbers."""
    out = {}
    for fname, floor in FLOORS.items():
        out[fname] = {}
        for fam in dict.fromkeys(p["family"] for p in points):
            ok = [(subset_metrics(p, tune_role), p) for p in points if p["family"] == fam]
            ok = [(m, p) for m, p in ok if m and meets(m, floor)]
            if not ok:
                out[fname][fam] = None
                continue
            m, p = max(ok, key=lambda mp: mp[0]["ratio"])
            held = subset_metrics(p, report_role)
            out[fname][fam] = {
                "codec": p["codec"],
                "codec_name": p["codec_name"],
                "params": p["params"],
                "family": fam,
                "tune": m,
                "heldout": held,
                "heldout_meets_floor": bool(held and meets(held, floor)),
                "all": subset_metrics(p, None),
            }
    return out


def peer_comparison(best: dict, points: list[dict] | None = None) -> dict:
    """Ratio of our best to the best peer, per floor: held-out ratios of tune-selected configs (as the
    defaults are chosen); with ``points``, also ``<floor>_heldout``: the best config of each side whose
    tune *and* held-out numbers meet the floor (a comparison that used the held-out texts to choose)."""
    res = {}
    for fname, fams in best.items():
        ours = [v for f, v in fams.items() if f in OURS and v]
        peers = [v for f, v in fams.items() if f in PEERS and v]
        if ours and peers:
            res[fname] = _gain(
                max(ours, key=lambda v: v["heldout"]["ratio"]),
                max(peers, key=lambda v: v["heldout"]["ratio"]),
            )
    for fname, floor in FLOORS.items():
        ours, peers = [], []
        for p in points or []:
            t, h = subset_metrics(p, "tune"), subset_metrics(p, "heldout")
            if t and h and meets(t, floor) and meets(h, floor):
                v = {"codec": p["codec"], "family": p["family"], "heldout": h}
                (ours if p["family"] in OURS else peers if p["family"] in PEERS else []).append(v)
        if ours and peers:
            res[f"{fname}_heldout"] = _gain(
                max(ours, key=lambda v: v["heldout"]["ratio"]),
                max(peers, key=lambda v: v["heldout"]["ratio"]),
            )
    return res


def kind_metrics(point: dict, kind: str) -> dict | None:
    """A point's held-out metrics over the texts of ``kind``."""
    kinds = {n: k for n, _, k in kvdata.TEXT_SOURCES}
    sub = {n: v for n, v in point["per_text"].items() if v["role"] == "heldout" and kinds.get(n) == kind}
    return subset_metrics({"per_text": sub}, None)


def per_kind(points: list[dict], kinds: list[str], default_level: str, kl_floor: float = 0.001) -> dict:
    """Per kind of held-out text: ours vs the best peer at KL <= ``kl_floor``, and the transform codec at
    ``default_level`` (each entropy) vs the best peer of at most its KL there."""
    out = {}
    for kind in kinds:
        rows = [(p, kind_metrics(p, kind)) for p in points]
        rows = [(p, m) for p, m in rows if m]
        ours = [(p, m) for p, m in rows if p["family"] in OURS]
        peers = [(p, m) for p, m in rows if p["family"] in PEERS]

        def best(cands, kl_max):
            ok = [(p, m) for p, m in cands if m["kl"] <= kl_max]
            return max(ok, key=lambda pm: pm[1]["ratio"]) if ok else None

        def row(o, pe):
            if not o:
                return None
            r = {"ours": o[0]["codec"], "ours_ratio": o[1]["ratio"], "ours_kl": o[1]["kl"]}
            if pe:
                r |= {
                    "peer": pe[0]["codec"],
                    "peer_family": pe[0]["family"],
                    "peer_ratio": pe[1]["ratio"],
                    "peer_kl": pe[1]["kl"],
                    "gain": o[1]["ratio"] / pe[1]["ratio"],
                }
                r["meets_goal"] = r["gain"] >= GOAL
                r["meets_stretch"] = r["gain"] >= STRETCH
            return r

        res = {"texts": next((m["texts"] for _, m in rows), 0)}
        res["kl_le_0.001"] = row(best(ours, kl_floor), best(peers, kl_floor))
        for p, m in ours:
            if p["codec_name"] == "transform" and p["params"].get("quality") == default_level:
                if "group_heads" not in p["params"]:
                    name = p["params"]["entropy"] + (
                        "_trellis" if p["params"].get("quantizer") == "trellis" else ""
                    )
                    res[f"default_level_{name}"] = row((p, m), best(peers, m["kl"]))
        out[kind] = res
    return out


def check_calibration(fresh: bool) -> str:
    """The calibration the transform points use: fitted from scratch with ``fresh``, else the registered
    one, which must have been fitted on the default text set (what ``make calibration`` makes)."""
    import subprocess

    from sgl_remote_kv.codec import calibration
    from sgl_remote_kv.codec.calibration import texts as calibration_texts

    if fresh:
        model = kvdata.model_dir()
        subprocess.run(
            [sys.executable, "-m", "sgl_remote_kv.codec.calibration", "--model-path", str(model)], check=True
        )
        calibration.load_dir(force=True)
    cal = calibration.find_for(kvdata.fingerprint(), calibration.DEFAULT_LEVEL)
    texts = json.loads(cal.report).get("texts")
    if texts != list(calibration_texts.CALIBRATION):
        raise SystemExit(
            f"calibration {cal.calib_id.hex()} was fitted on {texts}, not the default set: run `make calibration` "
            "or pass --fresh-calibration"
        )
    return cal.calib_id.hex()


def _gain(o: dict, p: dict) -> dict:
    return {
        "ours": o["codec"],
        "ours_family": o["family"],
        "ours_ratio": o["heldout"]["ratio"],
        "peer": p["codec"],
        "peer_family": p["family"],
        "peer_ratio": p["heldout"]["ratio"],
        "gain": o["heldout"]["ratio"] / p["heldout"]["ratio"],
    }


def recommend(best: dict) -> dict:
    """Default quantized codec: best tune-selected ratio at the near-lossless floor among our families."""
    fams = best["near_lossless"]
    rec = {}
    cands = [fams.get(f) for f in OURS if fams.get(f)]
    if cands:
        rec["near_lossless"] = max(cands, key=lambda v: v["tune"]["ratio"])
    if fams.get("ours-deflate"):
        rec["near_lossless_deflate"] = fams["ours-deflate"]
    return rec


# ---- plots ---------------------------------------------------------------------------------------------


def frontier(xs: list[float], ys: list[float], lower_better: bool) -> list[int]:
    """Indices of the Pareto frontier (higher ratio x, better y), sorted by x."""
    order = sorted(range(len(xs)), key=lambda i: -xs[i])
    keep, best = [], None
    for i in order:
        y = ys[i] if lower_better else -ys[i]
        if best is None or y < best:
            keep.append(i)
            best = y
    return sorted(keep, key=lambda i: xs[i])


def plot(points: list[dict], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    for fam in dict.fromkeys(p["family"] for p in points):
        ps = [p for p in points if p["family"] == fam and p.get(metric) is not None]
        xs, ys = [p["ratio"] for p in ps], [max(p[metric], 1e-6) if metric == "kl" else p[metric] for p in ps]
        (line,) = ax.plot([], [])
        ax.scatter(xs, ys, s=12, alpha=0.35, color=line.get_color())
        idx = frontier(xs, ys, lower_better=metric == "kl")
        ax.plot([xs[i] for i in idx], [ys[i] for i in idx], "o-", color=line.get_color(), label=fam, ms=4)
    if metric == "kl":
        ax.set_yscale("log")
        for fname, floor in FLOORS.items():
            ax.axhline(floor["kl"], ls="--", lw=0.8, color="gray")
            ax.text(ax.get_xlim()[0], floor["kl"], f" {fname} KL<={floor['kl']}", va="bottom", fontsize=8)
    else:
        ax.axhline(FLOORS["near_lossless"]["top1"], ls="--", lw=0.8, color="gray")
    ax.set_xlabel("compression ratio (bf16 bytes / blob bytes, headers and tables included)")
    ax.set_ylabel({"kl": "mean next-token KL vs recompute (nats, log)", "top1": "top-1 agreement"}[metric])
    ax.set_title(f"SmolLM2-135M real KV, all texts: ratio vs {metric} (lines: Pareto front per codec)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right" if metric == "kl" else "lower left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="rate-distortion sweep over codec quality knobs")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--texts", default="")
    ap.add_argument("--greedy", action="store_true", help="also the 32-token greedy match (slow)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cached-only", action="store_true", help="no model runs: only points whose quality is memoized"
    )
    ap.add_argument("--out", type=Path, default=RD_OUT)
    ap.add_argument(
        "--levels", default="", help="transform families: only these quality levels (default: all)"
    )
    ap.add_argument(
        "--fresh-calibration", action="store_true", help="fit the calibration from scratch first (minutes)"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    families = [f for f in args.families.split(",") if f]
    # peers alone need no calibration (their points can be computed, and cached, before the fit is done)
    calib_id = check_calibration(args.fresh_calibration) if any(f in OURS for f in families) else None
    names = [n for n in args.texts.split(",") if n] or None
    ctx = EvalContext.create(names, greedy=args.greedy, threads=args.threads)
    ctx.memo_only = args.cached_only
    points = sweep(ctx, families, tuple(q for q in args.levels.split(",") if q) or None)
    best = best_at_floors(points)
    from sgl_remote_kv.codec.calibration import DEFAULT_LEVEL

    kinds = list(dict.fromkeys(t.kind for t in ctx.texts if t.role == "heldout"))
    meta = {
        "calibration": calib_id,
        "cpu": kvdata.cpu_model(),
        "default_level": DEFAULT_LEVEL,
        "texts": kvdata.describe(ctx.texts),
        "floors": FLOORS,
        "runtime_s": round(time.perf_counter() - t0, 1),
        "selection": "best ratio on role=tune texts; reported on role=heldout texts",
    }
    res = {
        "meta": meta,
        "best_at_floor": best,
        "peer_comparison": peer_comparison(best, points),
        "recommended": recommend(best),
        "per_kind": per_kind(points, kinds, DEFAULT_LEVEL),
        "points": points,
    }
    args.out.write_text(json.dumps(res, indent=1))
    for metric in ("kl", "top1"):
        plot(points, metric, args.out.with_name(f"codec_rd_{metric}.png"))
    print_summary(res)
    return 0


def print_summary(res: dict) -> None:
    for fname, fams in res["best_at_floor"].items():
        print(f"== {fname} floor (selected on tune texts, reported on held-out) ==")
        for fam, v in fams.items():
            if v is None:
                print(f"  {fam:14s} no config meets the floor")
                continue
            h, t = v["heldout"], v["tune"]
            print(
                f"  {fam:14s} {v['codec']:38s} tune ratio {t['ratio']:.2f} kl {t['kl']:.5f} top1 {t['top1']:.3f}"
                f" | held-out ratio {h['ratio']:.2f} kl {h['kl']:.5f} top1 {h['top1']:.3f}"
                f"{'' if v['heldout_meets_floor'] else '  (misses floor on held-out)'}"
            )
    for fname, c in res["peer_comparison"].items():
        print(
            f"{fname}: ours {c['ours_ratio']:.2f} ({c['ours']}) vs best peer {c['peer_ratio']:.2f} "
            f"({c['peer_family']}: {c['peer']}) = {c['gain']:.2f}x"
        )
    print("== per kind of held-out text ==")
    for kind, r in res.get("per_kind", {}).items():
        for what in (
            "kl_le_0.001",
            *(f"default_level_{e}" for e in ("deflate", "deflate_trellis", "rans", "auto")),
        ):
            c = r.get(what)
            if not c:
                continue
            peer = (
                f"best peer {c['peer_ratio']:.2f} ({c['peer']}, KL {c['peer_kl']:.5f}) = {c['gain']:.2f}x"
                if "peer" in c
                else "no peer"
            )
            print(
                f"  {kind:12s} {what:22s} ours {c['ours_ratio']:.2f} ({c['ours']}, KL {c['ours_kl']:.5f}) vs {peer}"
                + (
                    ""
                    if "peer" not in c
                    else "  goal met"
                    if c["meets_goal"]
                    else f"  below the {GOAL}x goal"
                )
            )
    print(f"runtime {res['meta']['runtime_s']} s")


if __name__ == "__main__":
    sys.exit(main())
