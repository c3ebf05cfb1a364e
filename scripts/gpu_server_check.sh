#!/usr/bin/env bash
# A whole SGLang server with the remote tier on the GPU machine, measured (scripts/gpu_server_check.py).
#
#   bash scripts/gpu_wheels.sh server         # here, where pip works: the "server" wheel set into .whl/
#   timeout 540 bash scripts/gpu_server_check.sh   # on the GPU machine, in the repo root, .whl/ carried
#
# Steps:
#  1. installs .whl/*.whl (SGLang 0.5.23 slimmed, its server's imports, this project's wheel) into a --target
#     dir (GPU_SERVER_SITE) with no index and no dependencies;
#  2. sgl_kernel: the real one where it imports, else the stand-ins of scripts/gpu_standins/ first on
#     PYTHONPATH (every process SGLang spawns inherits it), with SGLANG_FORCE_FUSED_OP_BACKEND=torch (norms,
#     activation, rotary: SGLang's torch forwards; no runtime CUDA compile), SGLANG_CRASH_ON_JIT_COMPILE=1 (the
#     KV store takes SGLang's torch fallback), SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1; and SGLang's Python
#     radix-tree core (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python; the wheel's Rust core is dropped);
#  3. runs the driver from a work dir (GPU_SERVER_WORK), PYTHONSAFEPATH=1: the server imports the installed
#     wheel, never the tree. It writes the report as rows come, so a timeout still leaves them.
#
# Rehearsal (GPU_SERVER_REHEARSAL=1; `make gpu-server-rehearsal`): the same steps on this CPU in the
# GPU image's versions (torch 2.11), with the CPU platform plugin, the small model and short prompts;
# first scripts/gpu_standins/audit.py imports SGLang's CUDA launch path against the stand-ins.
#
# Report: $GPU_SERVER_JSON, else $OUT/gpu_server.json when OUT is set, else docs/results/gpu_server.json.
# Exit status: the driver's (0 when every row was served by the tier and lossless answers matched).
# Env: PYTHON (default python3), GPU_SERVER_WHEELS (.whl), GPU_SERVER_SITE (/tmp/gpu_server_site),
#      GPU_SERVER_WORK (/tmp/gpu_server), GPU_SERVER_DEADLINE_S (450: no new row after it),
#      GPU_SERVER_REHEARSAL (0|1), GPU_SERVER_INSTALL (1|0),
#      GPU_SERVER_PLAN (gpu: the full plan; gpu-paths: the 8B shape's read paths only, for a second call),
#      GPU_SERVER_BUDGET_S (530: the DPU-rounds benchmark after the driver runs only inside it).
set -uo pipefail
CALLER_PWD=$PWD
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
log() { echo "[gpu_server_check] $*"; }
T0=$(date +%s)

PY=${PYTHON:-python3}
REHEARSAL=${GPU_SERVER_REHEARSAL:-0}
if [ -n "${GPU_SERVER_JSON:-}" ]; then REPORT=$GPU_SERVER_JSON
elif [ -n "${OUT:-}" ]; then REPORT=$OUT/gpu_server.json
else REPORT=$ROOT/docs/results/gpu_server.json; fi
case "$REPORT" in /*) ;; *) REPORT=$CALLER_PWD/$REPORT ;; esac
WHEELS=${GPU_SERVER_WHEELS:-$ROOT/.whl}
SITE=${GPU_SERVER_SITE:-/tmp/gpu_server_site}
WORK=${GPU_SERVER_WORK:-/tmp/gpu_server}
mkdir -p "$(dirname "$REPORT")" "$WORK"

# -- 1. carried wheels ---------------------------------------------------------------------------------
shopt -s nullglob
whls=("$WHEELS"/*.whl)
shopt -u nullglob
if [ "${GPU_SERVER_INSTALL:-1}" = 1 ]; then
  [ ${#whls[@]} -gt 0 ] || { log "no wheels in $WHEELS (bash scripts/gpu_wheels.sh server)"; exit 2; }
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${whls[@]}" \
    || { log "pip install of ${#whls[@]} wheels into $SITE failed"; exit 2; }
  log "wheels: ${#whls[@]} into $SITE"
fi

# -- 2. sgl_kernel and SGLang's environment --------------------------------------------------------------
export PYTHONPATH=$SITE PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
if PYTHONPATH=$SITE "$PY" -c 'import sgl_kernel' 2>/dev/null; then
  log "sgl_kernel: the real one imports; no stand-ins"
else
  export PYTHONPATH=$ROOT/scripts/gpu_standins:$PYTHONPATH
  export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_CRASH_ON_JIT_COMPILE=1
  export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
  log "sgl_kernel: stand-ins (scripts/gpu_standins), SGLang's torch forwards for its fused ops"
fi
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# the driver imports benchmarks/ and tests/ from the tree; it appends ROOT after the installed wheel itself

"$PY" -c '
import platform, torch
cuda = torch.cuda.is_available()
dev = torch.cuda.get_device_name(0) if cuda else "no CUDA"
print(f"[gpu_server_check] python {platform.python_version()}, torch {torch.__version__}, {dev}")'

rc=0
if [ "$REHEARSAL" = 1 ]; then
  "$PY" "$ROOT/scripts/gpu_standins/audit.py" --json "$WORK/audit.json" > "$WORK/audit.log" 2>&1
  arc=$?
  log "stand-in audit (SGLang's CUDA launch path imported against the stand-ins): exit $arc"
  [ "$arc" -eq 0 ] || { tail -40 "$WORK/audit.log"; rc=1; }
fi

# -- 3. the driver -------------------------------------------------------------------------------------
cd "$WORK" || exit 2
args=(--out "$REPORT" --work "$WORK" --deadline-s "${GPU_SERVER_DEADLINE_S:-450}" --plan "${GPU_SERVER_PLAN:-gpu}")
[ "$REHEARSAL" = 1 ] && args+=(--rehearsal --audit "$WORK/audit.json")
"$PY" "$ROOT/scripts/gpu_server_check.py" "${args[@]}"
drc=$?
[ "$drc" -eq 0 ] || rc=$drc
log "report: $REPORT (driver exit $drc); $(($(date +%s) - T0)) s"

# -- 4. the DPU path's rounds on this host's CPU, pinned as a server pins its data plane, if time is left ----
# (benchmarks/bench_dpu_rounds.py; its own JSON next to the report, in the work dir when rehearsed; never
# changes the exit status)
if [ "$REHEARSAL" = 1 ]; then ROUNDS=$WORK/dpu_rounds.json; else ROUNDS=$(dirname "$REPORT")/dpu_rounds_gpu_host.json; fi
left=$((${GPU_SERVER_BUDGET_S:-530} - ($(date +%s) - T0)))
if [ "$REHEARSAL" = 1 ]; then rargs=(--chunks 8 --repeat 1); else rargs=(--chunks 48 --repeat 2); fi
if [ "$left" -gt 45 ]; then
  # the installed wheel first, the tree's benchmarks/ after it (as the driver does)
  (PYTHONPATH=$PYTHONPATH:$ROOT timeout $((left - 5)) "$PY" -m benchmarks.bench_dpu_rounds --dp-cpus auto \
     --out "$ROUNDS" "${rargs[@]}") \
    > "$WORK/dpu_rounds.log" 2>&1
  log "dpu rounds on this host: exit $? ($ROUNDS); $(tail -5 "$WORK/dpu_rounds.log" | tr '\n' ' ')"
else
  log "dpu rounds on this host: skipped ($left s left)"
fi
exit "$rc"
