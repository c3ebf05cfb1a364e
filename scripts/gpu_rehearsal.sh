#!/usr/bin/env bash
# Rehearse the GPU machine's run here, without a GPU (`make gpu-rehearsal`): catches what would fail there
# before a device is lent (an import that breaks under the image's torch 2.11 while .venv has 2.14, a
# module whose wheel is not carried, a skip that is not "no CUDA").
#
#   bash scripts/gpu_rehearsal.sh
#
# 1. An environment with the GPU image's versions (.rehearsal/venv; /work/.library/device/KINDS.md):
#    torch 2.11.0 (PyPI's build, which is the image's +cu130 one; its CUDA libraries come along, unused),
#    triton 3.6.0, numpy 2.5.2, numba, transformers 5.17.0 and the other image packages the suite's
#    imports reach (IMAGE below), NO SGLang. Python 3.12 like the image's (3.12.3) where this machine
#    has one (python3.12 on PATH, else pyenv's), else python3 with a note in the report. Reused while
#    its stamp (the Python, IMAGE) holds; lines added to IMAGE are installed into it, any other change
#    rebuilds it.
# 2. For each wheel set of scripts/gpu_wheels.sh (core, nvdec, nvcomp): the wheels, downloaded by that script for
#    this Python (.rehearsal/whl-<set>; reused while gpu_wheels.sh is unchanged), then scripts/gpu_check.sh
#    itself with GPU_CHECK_REHEARSAL=1: its install into a --target dir, import shim and sgl_kernel stub,
#    then `pytest -m gpu` over every GPU test file. Every test's gate (tests/gpu_gate.py) imports what the
#    test needs, then skips "no CUDA".
# 3. docs/results/gpu_rehearsal.json (GPU_REHEARSAL_JSON overrides): per set, tests collected, import
#    errors, outcomes and skip reasons; the versions; the time each step took. It passes when, for each
#    set, nothing errored or failed, and the set's own test files skip only for "no CUDA" (no module
#    missing); other files may also skip naming a package that set does not carry. Exit 1 otherwise.
#
# Env: GPU_REHEARSAL_PYTHON (the interpreter), GPU_REHEARSAL_DIR (.rehearsal), GPU_REHEARSAL_JSON,
#      GPU_REHEARSAL_ENV_ONLY=1 (step 1 alone: scripts/gpu_server_rehearsal.sh uses the environment).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
DIR=${GPU_REHEARSAL_DIR:-$ROOT/.rehearsal}
JSON=${GPU_REHEARSAL_JSON:-$ROOT/docs/results/gpu_rehearsal.json}
mkdir -p "$DIR"
log() { echo "[gpu_rehearsal] $*"; }
now() { date +%s; }
T0=$(now)

# The GPU image's packages that the suite's imports reach (versions where KINDS.md records them). Only
# packages the image has belong here: a module outside it must be carried (scripts/gpu_wheels.sh).
IMAGE="
torch==2.11.0
torchvision==0.26.0
triton==3.6.0
numpy==2.5.2
numba
transformers==5.17.0
tokenizers==0.23.2
safetensors==0.8.0
huggingface-hub==1.33.0
sentencepiece==0.2.2
tiktoken==0.14.0
accelerate==1.15.0
protobuf
pytest
pytest-timeout
psutil
requests
packaging
pillow
pyyaml
aiohttp
uvloop
prometheus-client
einops
tqdm
msgpack
"
# which test files each wheel set is for (its own tests must skip for "no CUDA" alone): nvdec's file,
# nvcomp's, and every other file with GPU tests (gpu_check.sh's own choice of targets) for core
NVDEC_FILES=tests/test_gpu_nvdec.py
NVCOMP_FILES=tests/test_gpu_nvcomp.py
CORE_FILES=$(grep -lE 'mark\.gpu\b' tests/test_*.py | grep -vxF -e "$NVDEC_FILES" -e "$NVCOMP_FILES" | paste -sd, -)
SETS="core:$CORE_FILES nvdec:$NVDEC_FILES nvcomp:$NVCOMP_FILES"

# -- the interpreter -----------------------------------------------------------------------------------
BASE=${GPU_REHEARSAL_PYTHON:-}
if [ -z "$BASE" ]; then  # the first 3.12 that runs (a pyenv shim may exist and refuse), else python3
  for c in "$(command -v python3.12)" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
      2>/dev/null | sort -rV); do
    if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      BASE=$c
      break
    fi
  done
  [ -n "$BASE" ] || BASE=$(command -v python3)
fi
PYVER=$("$BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
NOTE=""
[ "$PYVER" = 3.12 ] || NOTE="Python $PYVER, not the image's 3.12: no 3.12 on this machine (PyPI and Debian bookworm offer none)"
log "python: $BASE ($("$BASE" -V 2>&1))${NOTE:+; $NOTE}"

# -- 1. the image's environment ------------------------------------------------------------------------
VENV=$DIR/venv
STAMP=$VENV/.rehearsal_stamp
want=$(printf '%s %s\n' "$BASE" "$("$BASE" -V 2>&1)"; echo "$IMAGE" | awk 'NF {print $1}')
pip_install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
T1=$(now)
env_built=false
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  log "environment: $VENV up to date"
elif [ -f "$STAMP" ] && [ "$(head -1 "$STAMP")" = "$(echo "$want" | head -1)" ] \
    && [ -z "$(comm -23 <(tail -n +2 "$STAMP" | sort) <(echo "$want" | tail -n +2 | sort))" ]; then
  log "environment: installing IMAGE's new lines into $VENV"
  # shellcheck disable=SC2046
  pip_install $(comm -13 <(tail -n +2 "$STAMP" | sort) <(echo "$want" | tail -n +2 | sort)) \
    || { log "environment: pip install failed"; exit 2; }
  echo "$want" > "$STAMP"
else
  env_built=true
  log "environment: building $VENV"
  rm -rf "$VENV"
  "$BASE" -m venv "$VENV" || exit 2
  # shellcheck disable=SC2046
  pip_install $(echo "$want" | tail -n +2) || { log "environment: pip install failed"; exit 2; }
  echo "$want" > "$STAMP"
fi
T2=$(now)
[ "${GPU_REHEARSAL_ENV_ONLY:-0}" = 1 ] && { log "environment only: done in $((T2 - T0)) s"; exit 0; }

# -- 2. each wheel set, through gpu_wheels.sh and gpu_check.sh ------------------------------------------
rc_all=0
reports=()
times=()
for entry in $SETS; do
  set_name=${entry%%:*}
  WHL=$DIR/whl-$set_name
  wstamp=$WHL/.rehearsal_stamp
  wwant=$( (cat scripts/gpu_wheels.sh; echo "$PYVER") | sha256sum | cut -d' ' -f1)
  t_a=$(now)
  if [ ! -f "$wstamp" ] || [ "$(cat "$wstamp")" != "$wwant" ]; then
    rm -rf "$WHL"
    GPU_WHEELS_DIR=$WHL GPU_WHEELS_PYTHON=$PYVER bash scripts/gpu_wheels.sh "$set_name" || exit 2
    echo "$wwant" > "$wstamp"
  else
    log "wheels $set_name: $WHL up to date"
  fi
  t_b=$(now)
  rm -rf "$DIR/site-$set_name"
  GPU_CHECK_REHEARSAL=1 PYTHON=$VENV/bin/python GPU_CHECK_WHEELS=$WHL GPU_CHECK_SITE=$DIR/site-$set_name \
    GPU_CHECK_WORK=$DIR/work-$set_name GPU_CHECK_JSON=$DIR/report-$set_name.json \
    bash scripts/gpu_check.sh
  rc=$?
  t_c=$(now)
  log "set $set_name: gpu_check.sh exit status $rc"
  [ "$rc" -eq 0 ] || rc_all=1
  reports+=("$set_name=$DIR/report-$set_name.json")
  times+=("$set_name=$((t_b - t_a)),$((t_c - t_b))")
done

# -- 3. the summary ---------------------------------------------------------------------------------------
"$VENV/bin/python" scripts/gpu_rehearsal_report.py --out "$JSON" --sets "$SETS" --python-note "$NOTE" \
  --env-built "$env_built" --env-s $((T2 - T1)) --total-s $(($(now) - T0)) --times "${times[*]}" "${reports[@]}"
rc=$?
[ "$rc" -eq 0 ] || rc_all=1
log "done in $(($(now) - T0)) s (exit $rc_all)"
exit "$rc_all"
