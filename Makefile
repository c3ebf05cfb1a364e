# sgl-remote-kv: the two README commands are `make demo` and `make test`.
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup model calibration demo test test-slow lint bench-codec bench-codec-rd bench-codec-speed bench-read-path bench-dpu-rounds bench-write-path bench-store bench-dpu bench-dpu-service bench-dpu-floor bench-nvdec bench-adaptive-resolution \
	bench-cpu-attention bench-e2e bench-e2e-quick bench-burst bench-tail projection soak test-faults \
	test-conformance dashboard bench-exactness bench-task-accuracy gpu-rehearsal gpu-server-rehearsal bench-calibration bench-quality-proxy clean

setup:
	bash scripts/setup_env.sh

model: setup
	$(PY) -m sgl_remote_kv.model --dtype float32

# The transform codec's calibration of the model (minutes on 2 cores, once per machine: --if-missing).
# A calibration belongs to one weights build: the e2e benchmarks serve the bfloat16 build (MODEL_DTYPE).
MODEL_DTYPE ?= float32
calibration: model
	$(PY) -m sgl_remote_kv.codec.calibration --if-missing --model-path "$$($(PY) -m sgl_remote_kv.model --dtype $(MODEL_DTYPE) | tail -1)"

demo: calibration
	$(PY) scripts/demo.py --remote-kv dpu --turns 3 --restart

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Default suite: everything not marked slow (e2e server tests included). CI runs exactly this.
test: calibration lint
	$(PY) -m pytest -q

# Slower tests (soak-like, long benchmarks-as-tests); separate target.
test-slow: model
	$(PY) -m pytest -q -m slow

# The whole fault-injection suite (default + slow fault tests) against real servers.
test-faults: model
	$(PY) -m pytest -q -m "not gpu" tests/test_faults_server.py tests/test_faults_store_server.py \
		tests/test_faults_cluster_server.py tests/test_faults_decoder_pool.py tests/test_security_auth.py \
		tests/test_security_config.py

# SGLang's own test kits against the tier (plain SGLang, tier on, after a restart), slow kits included;
# writes docs/results/conformance.json and renders docs/CONFORMANCE.md. Its cheap kits on the tier servers
# (not the plain-SGLang baseline) are in `make test`.
test-conformance: model
	$(PY) -m pytest -q -m "not gpu" tests/test_conformance_unit.py tests/test_conformance_server.py \
		--conformance-report docs/results/conformance.json; rc=$$?; \
		$(PY) scripts/conformance_table.py > /dev/null; exit $$rc

# The GPU machine's run rehearsed here, without CUDA: an environment of the GPU image's versions (torch 2.11,
# Python 3.12; .rehearsal/, reused), each carried wheel set, scripts/gpu_check.sh's own steps, pytest -m gpu.
# Writes docs/results/gpu_rehearsal.json; fails on an import error or a skip other than "no CUDA".
# Not in `make test`: 5-7 min the first time (5.1 GB: PyPI's torch 2.11 brings its CUDA libraries), 1.5 min after.
gpu-rehearsal:
	bash scripts/gpu_rehearsal.sh

# The GPU machine's whole-server check (scripts/gpu_server_check.sh) rehearsed here: SGLang 0.5.23 from the
# "server" wheel set on torch 2.11 (the environment above), the sgl_kernel stand-ins (scripts/gpu_standins),
# the CPU platform plugin, the small model's shape; to the end (server up, fetches, JSON). Writes
# docs/results/gpu_server_rehearsal.json. Not in `make test`: ~4 min with the environment in place.
gpu-server-rehearsal:
	bash scripts/gpu_server_rehearsal.sh

# Benchmarks print tables and write docs/results/*.json (+ PNG plots). None of them is a test.
# The calibration `make calibration` made: its id and the held-out ratios per kind of text, level and entropy
# coder (docs/results/calibration.json, what tests/test_calibration_reproducible.py holds a fresh fit to).
bench-calibration: calibration
	$(PY) -m benchmarks.bench_calibration

# Can an encoder predict a text's KL from its KV (a per-chunk quality controller's premise)? The KV-energy
# proxy against measured KL per text (docs/results/quality_proxy.json).
bench-quality-proxy: calibration
	$(PY) -m benchmarks.bench_quality_proxy

bench-codec-rd: calibration
	$(PY) -m benchmarks.bench_codec_rd

bench-codec: calibration
	$(PY) -m benchmarks.bench_codec

bench-codec-speed: calibration
	$(PY) -m benchmarks.bench_codec_speed

# Host CPU per GB of the read path into a device pool (strict CPU double), host decode vs device decode
# side by side, and staging bytes per token (docs/results/read_path.json).
bench-read-path: calibration
	$(PY) -m benchmarks.bench_read_path

# The DPU path's rounds at a Llama-3-8B-shaped chunk size: tokens/s with the default 64 MiB slots (2 chunks a
# round) and 16-chunk slots, inflate real (quant_deflate) or free (raw) -> docs/results/dpu_rounds.json
bench-dpu-rounds:
	$(PY) -m benchmarks.bench_dpu_rounds

# Host CPU per GB of the write-back from a device pool (strict CPU double), host encode vs device encode side
# by side, and TPOT of a CPU server with the tier's write-back against --remote-kv off (docs/results/write_path.json).
bench-write-path: calibration
	$(PY) -m benchmarks.bench_write_path

# Greedy divergence of remote vs local hits per codec, and of exact-KV requests (real servers)
bench-exactness: model
	$(PY) -m benchmarks.bench_exactness

# Task accuracy (passkey / multi-key / key-value retrieval) of recompute, local hits and remote hits per codec
# and quality level, with confidence intervals (real servers, float32: the build the calibration belongs to;
# ~40 min on an idle 2-core machine; --items/--levels/--codecs shorten it)
bench-task-accuracy: calibration
	$(PY) -m benchmarks.bench_task_accuracy

bench-store: setup
	$(PY) -m benchmarks.bench_store

bench-dpu: model
	$(PY) -m benchmarks.bench_dpu

# One data-plane service feeding two clients vs two private data planes on the same core (issue 17)
bench-dpu-service: model
	$(PY) -m benchmarks.bench_dpu_service

# DPU fetch time vs the wire floor over a shaped link, per ordering / write policy (issue 17 item 3; root)
bench-dpu-floor: model calibration
	$(PY) -m benchmarks.bench_dpu_floor

bench-nvdec: model
	$(PY) -m benchmarks.bench_nvdec

bench-adaptive-resolution: model
	$(PY) -m benchmarks.bench_adaptive_resolution

bench-cpu-attention: model
	$(PY) -m benchmarks.bench_cpu_attention

bench-e2e: model
	$(MAKE) calibration MODEL_DTYPE=bfloat16
	$(PY) -m benchmarks.bench_e2e

bench-e2e-quick: model
	$(MAKE) calibration MODEL_DTYPE=bfloat16
	$(PY) -m benchmarks.bench_e2e --quick

bench-burst: model
	$(PY) -m benchmarks.bench_burst

bench-tail: model
	$(PY) -m benchmarks.bench_tail

projection: setup
	$(PY) -m benchmarks.projection

soak: model
	$(PY) -m benchmarks.soak

# examples/monitoring against a real server + Debian's prometheus: dashboard JSON, PNG, per-panel data
dashboard: model
	$(PY) -m benchmarks.dashboard

clean:
	rm -rf .venv .pytest_cache .ruff_cache
