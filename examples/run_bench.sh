#!/usr/bin/env bash
# Run SGLang's own bench harness (python -m sglang.benchmark.serving) the way our results were made.
#
#   examples/run_bench.sh quick            # the e2e benchmark, small (~30 min idle machine)
#   examples/run_bench.sh full             # the whole e2e benchmark (all configs, rates, curve)
#   examples/run_bench.sh harness URL      # just the harness runs, against a server you started
#
# quick/full: starts real CPU servers itself (quick: dpu_fetch, inproc_fetch, recompute, dpu, auto;
# full: also device, raw, nvdec, inproc; see benchmarks/e2e_server.py CONFIGS), puts
# redis-server in a network namespace behind a tc-tbf-shaped veth (needs root / CAP_NET_ADMIN; every
# namespace and veth it creates is deleted on exit), and writes docs/results/e2e.json + PNGs.
# Extra arguments are passed to benchmarks/bench_e2e.py (e.g. --configs dpu auto --rates 25 100).
#
# harness: the exact harness invocations (offline generated-shared-prefix data, no downloads),
# single-turn then multi-turn, each with --cache-report and a JSONL --output-file. For a remote-tier
# hit on the second run, start the server with --remote-kv ... --remote-kv-store URL --enable-cache-report,
# run this once, restart the server (empty device cache) and run it again; or keep the server and
# rely on --flush-cache (on by default here: it empties the device radix cache before each run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODE=${1:-quick}
shift || true

case "$MODE" in
  quick) exec "$PY" -m benchmarks.bench_e2e --quick "$@" ;;
  full) exec "$PY" -m benchmarks.bench_e2e "$@" ;;
  harness)
    URL=${1:?usage: run_bench.sh harness http://127.0.0.1:30000}
    shift || true
    MODEL=${MODEL:-$("$PY" -c 'from sgl_remote_kv.model import ensure_model; print(ensure_model("bfloat16"))')}
    OUT=${OUT:-/tmp/srkv-harness}
    mkdir -p "$OUT"
    GSP=(--dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 2
         --gsp-system-prompt-len 1024 --gsp-question-len 32 --gsp-output-len 16 --gsp-range-ratio 1.0)
    COMMON=(--base-url "$URL" --model "$MODEL" --tokenizer "$MODEL" --seed 1
            --cache-report --output-details --flush-cache --disable-tqdm)
    "$PY" -m sglang.benchmark.serving --backend sglang "${COMMON[@]}" "${GSP[@]}" --request-rate inf \
      --output-file "$OUT/single_turn.jsonl" "$@"
    # the harness's multi-turn mode only runs on chat backends
    "$PY" -m sglang.benchmark.serving --backend sglang-oai-chat "${COMMON[@]}" \
      "${GSP[@]}" --gsp-num-turns 2 --request-rate inf \
      --output-file "$OUT/multi_turn.jsonl" "$@"
    echo "JSONL results in $OUT" ;;
  *) echo "usage: $0 quick|full [bench_e2e args] | harness URL [harness args]" >&2; exit 2 ;;
esac
