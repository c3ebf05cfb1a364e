"""docs/results/gpu_rehearsal.json from the gpu_check.sh reports of ``scripts/gpu_rehearsal.sh`` (one per
wheel set). Exit status 1 when the rehearsal found a problem (see the shell script's header)."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu_gate import NO_CUDA, NOT_INSTALLED  # noqa: E402  (the gate's own words)

VERSIONS = ("torch", "triton", "numpy", "numba", "transformers", "pytest")


def judge(tests: list[dict], own_files: list[str]) -> tuple[dict[str, int], list[str]]:
    """Skip reasons (counted) and problems: anything not skipped; in the set's own files a skip other than
    a plain "no CUDA"; elsewhere a skip that is neither "no CUDA" nor a package the set does not carry."""
    reasons: dict[str, int] = {}
    problems = []
    for t in tests:
        if t["outcome"] != "skipped":
            problems.append(f"{t['nodeid']}: {t['outcome']}: {t.get('reason')}")
            continue
        why = t.get("reason") or ""
        reasons[why] = reasons.get(why, 0) + 1
        no_cuda, missing = why.startswith(NO_CUDA), NOT_INSTALLED in why
        mine = any(t["nodeid"].startswith(f) for f in own_files)
        if (mine and (missing or not no_cuda)) or (not mine and not (no_cuda or missing)):
            problems.append(f"{t['nodeid']}: skipped: {why}")
    return reasons, problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sets", required=True, help="'name:file,file name:file ...'")
    ap.add_argument("--python-note", default="")
    ap.add_argument("--env-built", default="false")
    ap.add_argument("--env-s", type=float, required=True)
    ap.add_argument("--total-s", type=float, required=True)
    ap.add_argument("--times", default="", help="'name=wheels_s,gpu_check_s ...'")
    ap.add_argument("reports", nargs="+", help="name=path of each set's gpu_check.sh report")
    a = ap.parse_args()
    own = {s.split(":")[0]: s.split(":")[1].split(",") for s in a.sets.split()}
    took = {t.split("=")[0]: [float(x) for x in t.split("=")[1].split(",")] for t in a.times.split()}
    doc: dict = {
        "schema": 1,
        "what": "scripts/gpu_rehearsal.sh (make gpu-rehearsal): scripts/gpu_check.sh's steps and pytest -m gpu "
        "for each wheel set of scripts/gpu_wheels.sh, without CUDA, in an environment of the GPU image's versions",
        "ok": True,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "python_note": a.python_note or None,
        "versions": {},
        "seconds": {"environment": a.env_s, "environment_built": a.env_built == "true", "total": a.total_s},
        "sets": {},
    }
    for item in a.reports:
        name, path = item.split("=", 1)
        r = json.loads(Path(path).read_text())
        tests, setup, pk = r.get("tests") or [], r.get("setup") or {}, r.get("packages") or {}
        import_errors = [
            {"nodeid": t["nodeid"], "reason": t["reason"]}
            for t in tests
            if t.get("phase") == "collect" and t["outcome"] == "error"
        ]
        reasons, problems = judge(tests, own[name])
        if not tests:
            problems.append(f"no tests collected (pytest exit status {r.get('pytest_exit_status')})")
        if not doc["versions"]:
            doc["versions"] = {k: pk.get(k) for k in VERSIONS}
            doc["versions"]["torch_cuda_build"] = (r.get("machine") or {}).get("torch_cuda")
        wheels_s, check_s = took.get(name, [None, None])
        doc["sets"][name] = entry = {
            "test_files": own[name],
            "wheels": sorted(setup.get("wheels") or {}),
            "wheels_install": setup.get("wheels_install"),
            "sgl_kernel_stub": setup.get("sgl_kernel_stub"),
            "collected": len(tests),
            "import_errors": import_errors,
            "totals": r.get("totals"),
            "skip_reasons": reasons,
            "problems": problems,
            "ok": not problems and not import_errors,
            "seconds": {"wheels": wheels_s, "gpu_check": check_s, "pytest": r.get("wall_s")},
        }
        doc["ok"] = doc["ok"] and entry["ok"]
    core = doc["sets"].get("core", {})
    doc["collected"] = core.get("collected")
    doc["import_errors"] = [e for s in doc["sets"].values() for e in s["import_errors"]]
    doc["skip_reasons"] = core.get("skip_reasons")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"[gpu_rehearsal] {a.out}: ok={doc['ok']}, python {doc['python']}, torch {doc['versions'].get('torch')}"
    )
    for name, s in doc["sets"].items():
        print(
            f"[gpu_rehearsal]   {name}: {s['collected']} collected, {len(s['import_errors'])} import errors, "
            f"{s['totals']}, {len(s['problems'])} problems"
        )
        for p in s["problems"][:20]:
            print(f"[gpu_rehearsal]     {p}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
