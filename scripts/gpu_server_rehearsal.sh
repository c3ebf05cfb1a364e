#!/usr/bin/env bash
# Rehearse the GPU machine's server check here, without a GPU (`make gpu-server-rehearsal`): SGLang 0.5.23
# on the GPU image's torch 2.11, installed from the "server" wheel set exactly as scripts/gpu_server_check.sh
# installs it there, with the sgl_kernel stand-ins, run to the end (audit, server up, fetches, JSON written).
#
#   bash scripts/gpu_server_rehearsal.sh
#
# 1. The environment of `make gpu-rehearsal` (.rehearsal/venv: torch 2.11, triton 3.6, the image's other
#    packages, no SGLang), built or reused by scripts/gpu_rehearsal.sh (GPU_REHEARSAL_ENV_ONLY=1).
# 2. The "server" wheel set for that Python (scripts/gpu_wheels.sh server: this project's wheel is built
#    from the tree each time) into .rehearsal/whl-server.
# 3. scripts/gpu_server_check.sh with GPU_SERVER_REHEARSAL=1: the CPU platform plugin, the small model's
#    shape, short prompts. Writes docs/results/gpu_server_rehearsal.json (GPU_SERVER_JSON overrides):
#    `ok`, the stand-in ops (`sglang.standin_ops`), the audit, the rows, `seconds`; plus `steps_s` here.
#    Exit status: the check's.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
DIR=${GPU_REHEARSAL_DIR:-$ROOT/.rehearsal}
JSON=${GPU_SERVER_JSON:-$ROOT/docs/results/gpu_server_rehearsal.json}
log() { echo "[gpu_server_rehearsal] $*"; }
T0=$(date +%s)
GPU_REHEARSAL_ENV_ONLY=1 GPU_REHEARSAL_DIR=$DIR bash scripts/gpu_rehearsal.sh || exit 2
T1=$(date +%s)
PYVER=$("$DIR/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
rm -rf "$DIR/whl-server"
GPU_WHEELS_DIR=$DIR/whl-server GPU_WHEELS_PYTHON=$PYVER bash scripts/gpu_wheels.sh server | tail -1 || exit 2
T2=$(date +%s)
PYTHON=$DIR/venv/bin/python GPU_SERVER_WHEELS=$DIR/whl-server GPU_SERVER_SITE=$DIR/site-server \
  GPU_SERVER_WORK=$DIR/work-server GPU_SERVER_JSON=$JSON GPU_SERVER_REHEARSAL=1 \
  GPU_SERVER_DEADLINE_S=${GPU_SERVER_DEADLINE_S:-900} bash scripts/gpu_server_check.sh
rc=$?
T3=$(date +%s)
"$DIR/venv/bin/python" - "$JSON" "$((T1 - T0))" "$((T2 - T1))" "$((T3 - T2))" <<'PY'
import json, sys
path, env_s, wheels_s, check_s = sys.argv[1], *map(int, sys.argv[2:])
d = json.load(open(path))
d["steps_s"] = {"environment": env_s, "wheels": wheels_s, "check": check_s}
open(path, "w").write(json.dumps(d, indent=1) + "\n")
PY
log "done in $((T3 - T0)) s (exit $rc): $JSON"
exit "$rc"
