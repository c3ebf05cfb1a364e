"""Calibrate the transform codec for one model: ``python -m sgl_remote_kv.codec.calibration --model-path DIR``.

Runs the model (transformers, float32, on the CPU: ``scorer.py``) over calibration texts and
fits, per (layer, K/V, head group: ``--group-heads`` consecutive KV heads, by default all the heads one
rank of ``--tp`` holds), the mean and PCA basis of position-free KV, then chooses the quantization steps of
every quality level in ``codec.calibration.LEVELS`` by measuring the model itself (``fit.py``
says how).

Writes ``<cache>/calibration/<id>.npz`` (``codec.calibration``), which servers of this model load at
start. Minutes on 2 CPU cores for a 135M model. The texts should resemble what the tier will serve
(default: ``texts.CALIBRATION``, every kind of text); never calibrate on the texts you
report quality on.

Reproducible: the same model, texts and code give the same calibration id on any x86-64 machine. The
CLI re-executes itself with pinned numerics (``env.pinned_numerics_env``: AVX2 code paths in torch,
MKL, oneDNN, OpenBLAS and numba, strict MKL reproducibility, ``--threads`` threads), the fit has no
random step, its reductions run in a fixed order, and its report (covered by the id) holds no timing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from sgl_remote_kv import env
from sgl_remote_kv.codec import calibration as calib_mod
from sgl_remote_kv.codec.calibration import texts as calibration_texts
from sgl_remote_kv.codec.calibration.fit import MARGIN, REF_STEP, Calibrator, fit_basis, step_shape
from sgl_remote_kv.codec.calibration.scorer import CONT, PREFIX, Scorer
from sgl_remote_kv.types import KVLayout, ModelFingerprint, RopeSpec

logger = logging.getLogger(__name__)

# The fit's thread count, part of what makes it reproducible (measured: the model's KV has equal bits at 1
# and 2 threads). One: an OpenMP team of 2 on a busy 2-core machine spent 7.8 CPU-s per KL evaluation
# instead of 1.2 (spinning at barriers).
THREADS = 1


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
    cmd = [sys.executable, "-m", "sgl_remote_kv.codec.calibration", *sys.argv[1:]]
    os.execve(sys.executable, cmd, env.pinned_numerics_env(threads))


def run() -> None:
    """``python -m sgl_remote_kv.codec.calibration``: re-executes with pinned numerics first, then ``main``."""
    if not env.numerics_pinned():
        _reexec_pinned()
    sys.exit(main())
