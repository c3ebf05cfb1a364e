"""The calibration a user's ``make calibration`` makes, and the ratios it gives (``make bench-calibration``).

For the registered calibration fitted on the default text set (``sgl_remote_kv.codec.calibration.texts``):
its id, the KL per level it measured on its own texts (its report), and the transform codec's ratio
(bf16 bytes / blob bytes, 256-token chunks at their real positions) on every held-out text of the
catalogue, per kind, entropy coder and level. No model runs: the KV comes from ``benchmarks.kvdata``.

Writes ``docs/results/calibration.json``; ``tests/test_calibration_reproducible.py`` (in ``make test``)
checks that a fresh fit has the same id and reproduces these ratios within 0.5%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks import kvdata
from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.calibration import texts as calibration_texts

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "calibration.json"
ENTROPY = ("deflate", "rans", "auto")
CHUNK = 256


def default_set_calibration() -> cm.Calibration:
    """The newest registered calibration of the benchmark model fitted on the default text set."""
    cm.load_dir()
    key = cm.model_key(kvdata.fingerprint())
    cands = [
        c
        for c in cm.registered()
        if c.model_key == key and json.loads(c.report).get("texts") == list(calibration_texts.CALIBRATION)
    ]
    if not cands:
        raise LookupError("no calibration fitted on the default text set: run `make calibration`")
    return cands[-1]


def ratio(codec, text: kvdata.TextKV, fp) -> float:
    """bf16 bytes / blob bytes of ``text``'s KV in 256-token chunks at their positions."""
    blob = 0
    for s in range(0, text.k.shape[1], CHUNK):
        k = np.ascontiguousarray(text.k[:, s : s + CHUNK])
        v = np.ascontiguousarray(text.v[:, s : s + CHUNK])
        blob += len(codec.encode(k, v, fp, start=s))
    return (text.k.nbytes + text.v.nbytes) / blob


def measure(cal: cm.Calibration, levels, entropies=ENTROPY, texts=None) -> dict:
    """{entropy: {level: {text: ratio}}} on the held-out texts."""
    fp = kvdata.fingerprint()
    texts = texts if texts is not None else [t for t in kvdata.load_texts() if t.role == "heldout"]
    out: dict = {}
    for e in entropies:
        for lv in levels:
            codec = get_codec("transform", calibration=cal.calib_id.hex(), quality=lv, entropy=e)
            out.setdefault(e, {})[lv] = {t.name: ratio(codec, t, fp) for t in texts}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    cal = default_set_calibration()
    texts = [t for t in kvdata.load_texts() if t.role == "heldout"]
    ratios = measure(cal, cal.levels, texts=texts)
    report = json.loads(cal.report)
    kinds = {t.name: t.kind for t in texts}
    per_kind = {
        e: {
            lv: {
                k: float(np.mean([r for n, r in by_text.items() if kinds[n] == k]))
                for k in dict.fromkeys(kinds.values())
            }
            for lv, by_text in by_level.items()
        }
        for e, by_level in ratios.items()
    }
    res = {
        "calibration": cal.calib_id.hex(),
        "cpu": kvdata.cpu_model(),
        "cpu_isa": kvdata.cpu_isa(),
        "fit_texts": report.get("texts"),
        "fit_text_sha256": report.get("text_sha256"),
        "fit_levels": report.get("levels"),
        "heldout": [{"name": t.name, "kind": t.kind, "path": t.path} for t in texts],
        "ratios": ratios,
        "ratios_per_kind": per_kind,
    }
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"calibration {res['calibration']} ({res['cpu']})")
    print("| entropy | level | " + " | ".join(dict.fromkeys(kinds.values())) + " |")
    print("|---|---|" + "---|" * len(set(kinds.values())))
    for e, by_level in per_kind.items():
        for lv, by_kind in by_level.items():
            print(f"| {e} | {lv} | " + " | ".join(f"{r:.2f}" for r in by_kind.values()) + " |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
