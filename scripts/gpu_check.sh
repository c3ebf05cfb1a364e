#!/usr/bin/env bash
# Run the GPU suite (`pytest -m gpu`) on a bare, offline CUDA machine and write a JSON report.
#
#   bash scripts/gpu_check.sh [pytest args...]
#
# Without arguments it runs every tests/test_*.py that marks tests `gpu`. Steps:
#  1. installs .whl/*.whl (scripts/gpu_wheels.sh, run where pip works) into /tmp/site, with the device
#     README's command (only on Python 3.12, the version the wheels are built for; GPU_CHECK_INSTALL=1
#     forces it, 0 skips it);
#  2. makes sgl_remote_kv importable from this working tree WITHOUT installing it: a shim directory whose
#     sgl_remote_kv/ holds symlinks to sgl_remote_kv/* plus the top-level dirs pyproject's package-dir
#     maps into it (dpu/, nvdec/, kernels/, ...), and tests -> tests/. PYTHONSAFEPATH=1 keeps the
#     working tree's own sgl_remote_kv/ (no dpu/ inside) off sys.path, in pytest and in every child
#     process (the data plane `python -m sgl_remote_kv.dpu` inherits the environment);
#  3. where SGLang is there but sgl_kernel is not and CUDA is, writes an import-only sgl_kernel stub
#     (SGLang imports it at module level on CUDA; the real wheel is 373 MB; calling anything raises);
#  4. prints nvidia-smi and the torch / triton / CUDA versions, runs pytest -m gpu with the report plugin
#     tests/gpu_report.py, and prints the totals.
#
# Rehearsal (GPU_CHECK_REHEARSAL=1; scripts/gpu_rehearsal.sh, `make gpu-rehearsal`): the same steps on a
# machine without CUDA, in an environment with the GPU image's versions: step 1 installs whatever the
# Python version (the rehearsal downloads the wheels for its own), step 3 writes the stub as CUDA would
# have it imported, and the report's setup says "rehearsal": true. Every test then skips "no CUDA".
#
# Report: $GPU_CHECK_JSON, else $OUT/gpu_check.json when OUT is set, else docs/results/gpu_check.json.
# Exit status: pytest's (non-zero when a test failed or errored or none was collected), else 1 when the
# wheels did not install. The report is written in every case.
# Env: PYTHON (default python3, or .venv/bin/python where python3 has no torch), GPU_CHECK_WHEELS (.whl),
#      GPU_CHECK_SITE (/tmp/site), GPU_CHECK_WORK (/tmp/gpu_check: shim, stub, setup record),
#      GPU_CHECK_INSTALL (auto|0|1), GPU_CHECK_STUB (auto|0|1), GPU_CHECK_TIMEOUT (per test, s; 300),
#      GPU_CHECK_REHEARSAL (0|1).
set -uo pipefail
CALLER_PWD=$PWD
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif ! python3 -c 'import torch' 2>/dev/null && [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
if [ -n "${GPU_CHECK_JSON:-}" ]; then REPORT=$GPU_CHECK_JSON
elif [ -n "${OUT:-}" ]; then REPORT=$OUT/gpu_check.json
else REPORT=$ROOT/docs/results/gpu_check.json; fi
case "$REPORT" in /*) ;; *) REPORT=$CALLER_PWD/$REPORT ;; esac
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
mkdir -p "$(dirname "$REPORT")" "$WORK"
rm -f "$REPORT"
log() { echo "[gpu_check] $*"; }
REHEARSAL=${GPU_CHECK_REHEARSAL:-0}
[ "$REHEARSAL" = 1 ] && log "rehearsal: the GPU machine's steps without CUDA ($PY)"

# -- 1. carried wheels -------------------------------------------------------------------------------
setup_failed=0
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "?")
shopt -s nullglob
whls=("$WHEELS"/*.whl)
shopt -u nullglob
mode=${GPU_CHECK_INSTALL:-auto}
[ "$mode" = auto ] && [ "$REHEARSAL" = 1 ] && mode=1
if [ ${#whls[@]} -eq 0 ]; then
  install="none: no wheels in ${WHEELS#"$ROOT"/}"
elif [ "$mode" = 0 ] || { [ "$mode" = auto ] && [ "$pyver" != 3.12 ]; }; then
  install="skipped: python $pyver (the wheels are for 3.12; GPU_CHECK_INSTALL=1 forces)"
elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${whls[@]}"; then
  install="ok: ${#whls[@]} wheels into the --target dir (GPU_CHECK_SITE)"
else
  install="FAILED: pip install of ${#whls[@]} wheels into the --target dir (GPU_CHECK_SITE)"
  setup_failed=1
fi
log "wheels: $install"

# -- 2. sgl_remote_kv from this working tree (shim of symlinks, per pyproject's package-dir) ----------
SHIM=$WORK/shim
if ! "$PY" - "$ROOT" "$SHIM" <<'EOF'; then
import os, shutil, sys

root, shim = sys.argv[1:3]
try:
    import tomllib

    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
except Exception as e:  # Python < 3.11 or no mapping: the layout of docs/ARCHITECTURE.md
    print(f"[gpu_check] pyproject package-dir not read ({e}); using the default map", file=sys.stderr)
    package_dir = {"sgl_remote_kv": "sgl_remote_kv", "sgl_remote_kv.dpu": "dpu",
                   "sgl_remote_kv.nvdec": "nvdec", "sgl_remote_kv.kernels": "kernels"}
shutil.rmtree(shim, ignore_errors=True)
for pkg, src in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
    dst = os.path.join(shim, *pkg.split("."))
    if "." not in pkg:  # the top-level package: a real dir of links, so mapped subpackages fit in
        os.makedirs(dst)
        for name in os.listdir(os.path.join(root, src)):
            if name != "__pycache__":
                os.symlink(os.path.join(root, src, name), os.path.join(dst, name))
    elif not os.path.lexists(dst):
        os.symlink(os.path.join(root, src), dst)
for extra in ("tests", "benchmarks"):  # `from tests.strict_device import ...` without the repo root on sys.path
    if os.path.isdir(os.path.join(root, extra)):
        os.symlink(os.path.join(root, extra), os.path.join(shim, extra))
EOF
  log "could not build the import shim in $SHIM"
  setup_failed=1
fi
STUBS=$WORK/stubs
rm -rf "$STUBS"
mkdir -p "$STUBS"
PYTHONPATH=$SHIM
[ -d "$SITE" ] && PYTHONPATH=$PYTHONPATH:$SITE
export PYTHONPATH=$PYTHONPATH:$STUBS${GPU_CHECK_PYTHONPATH:+:$GPU_CHECK_PYTHONPATH}
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1

# -- 3. sgl_kernel: import-only stub where SGLang would import it on CUDA and it is not there ---------
stub_mode=${GPU_CHECK_STUB:-auto}
stub=0
if [ "$stub_mode" = 1 ]; then stub=1
elif [ "$stub_mode" = auto ]; then
  stub=$("$PY" -c '
import importlib.util as u, sys
need = u.find_spec("sglang") is not None and u.find_spec("sgl_kernel") is None
if need and sys.argv[1] != "1":  # a rehearsal stands in for CUDA
    import torch
    need = torch.cuda.is_available()
print(int(need))' "$REHEARSAL" 2>/dev/null || echo 0)
fi
if [ "$stub" = 1 ]; then
  mkdir -p "$STUBS/sgl_kernel"
  cat > "$STUBS/sgl_kernel/__init__.py" <<'EOF'
"""Import-only stand-in for sglang-kernel, written by scripts/gpu_check.sh (the real wheel is 373 MB).

SGLang imports sgl_kernel at module level on CUDA; the GPU suite does not call it. Any attribute and any
submodule resolves; calling anything raises NotImplementedError, so a test that does reach sgl_kernel
fails loudly instead of running a fake."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+gpu-check-stub"
STUB = True
# submodules SGLang imports under an ImportError fallback of its own: let it take the fallback (allreduce:
# else SGLang believes its custom all-reduce is there)
_ABSENT = {__name__ + ".scalar_type", __name__ + ".allreduce"}


def _stub(qualname):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"{qualname}: sgl_kernel is an import-only stub on this machine")

    stub.__name__ = stub.__qualname__ = qualname.rsplit(".", 1)[-1]
    return stub


def _getattr_for(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{modname}.{name}")

    return __getattr__


__getattr__ = _getattr_for(__name__)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + ".") and fullname not in _ABSENT:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _getattr_for(spec.name)
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
EOF
  log "sgl_kernel: import-only stub in $STUBS"
fi

# -- 4. machine, suite ---------------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi || true; else log "nvidia-smi: not found"; fi
"$PY" -c '
import platform, sys
print(f"[gpu_check] python {platform.python_version()} ({sys.executable}), {platform.platform()}")
try:
    import torch
    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability(0) if cuda else None
    dev = f", {torch.cuda.get_device_name(0)} (sm_{cap[0]}{cap[1]})" if cuda else ""
    print(f"[gpu_check] torch {torch.__version__} (CUDA build {torch.version.cuda}), cuda available: {cuda}{dev}")
except Exception as e:
    print(f"[gpu_check] torch: {type(e).__name__}: {e}")
try:
    import triton
    print(f"[gpu_check] triton {triton.__version__}")
except Exception as e:
    print(f"[gpu_check] triton: {type(e).__name__}: {e}")
' || true
log "PYTHONPATH=$PYTHONPATH"

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(grep -lE 'mark\.gpu\b' tests/test_*.py)
  [ ${#targets[@]} -gt 0 ] || targets=(tests/)
fi
log "targets: ${targets[*]}"

"$PY" - "$WORK/setup.json" "$install" "$stub" "$WHEELS" "$PYTHONPATH" "$REHEARSAL" "${targets[@]}" <<'EOF' || true
import glob, json, os, sys

path, install, stub, wheels, pythonpath, rehearsal, *targets = sys.argv[1:]
manifests = {os.path.basename(m): open(m).read().splitlines() for m in sorted(glob.glob(os.path.join(wheels, "MANIFEST-*.txt")))}
json.dump({
    "wheels_install": install,
    "wheels": {os.path.basename(w): os.path.getsize(w) for w in sorted(glob.glob(os.path.join(wheels, "*.whl")))},
    "wheel_manifests": manifests,
    "sgl_kernel_stub": stub == "1",
    "pythonpath": pythonpath.split(":"),
    "pythonsafepath": os.environ.get("PYTHONSAFEPATH"),
    "targets": targets,
    "rehearsal": rehearsal == "1",
}, open(path, "w"), indent=1)
EOF
export GPU_CHECK_SETUP_FILE=$WORK/setup.json

args=(-m gpu -p no:cacheprovider -p tests.gpu_report --gpu-report "$REPORT" -rA)
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then args+=(--timeout "${GPU_CHECK_TIMEOUT:-300}"); fi
log "$PY -m pytest ${args[*]} ${targets[*]}"
"$PY" -m pytest "${args[@]}" "${targets[@]}"
rc=$?

if [ ! -s "$REPORT" ]; then  # pytest died before its session finished: still leave a report
  "$PY" - "$REPORT" "$rc" "$WORK/setup.json" <<'EOF' || echo "{\"pytest_exit_status\": $rc, \"error\": \"no report\"}" > "$REPORT"
import json, platform, sys

path, rc, setup = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    setup = json.load(open(setup))
except Exception as e:
    setup = {"error": str(e)}
json.dump({"schema": 1, "pytest_exit_status": rc, "error": "pytest ended without writing its report (see the log)",
           "machine": {"python": platform.python_version()}, "setup": setup, "totals": None, "tests": []},
          open(path, "w"), indent=1)
EOF
fi
"$PY" -c '
import json, sys
r = json.load(open(sys.argv[1]))
t = r.get("totals") or {}
print(f"[gpu_check] report {sys.argv[1]}: " + (", ".join(f"{k} {v}" for k, v in t.items()) or r.get("error", "?")))
' "$REPORT" || true

if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$setup_failed"
