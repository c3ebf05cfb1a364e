# sgl-remote-kv: the two README commands are `make demo` and `make test`.
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup model demo test test-slow lint bench-codec bench-codec-rd bench-store bench-dpu bench-cpu-attention clean

setup:
	bash scripts/setup_env.sh

model: setup
	$(PY) -m sgl_remote_kv.model --dtype float32

demo: model
	$(PY) scripts/demo.py --remote-kv dpu --turns 3

lint: setup
	$(PY) -m ruff check .

# Default suite: everything not marked slow (e2e server tests included). CI runs exactly this.
test: model lint
	$(PY) -m pytest -q

# Slower tests (soak-like, long benchmarks-as-tests); separate target.
test-slow: model
	$(PY) -m pytest -q -m slow

bench-store: setup
	$(PY) -m benchmarks.bench_store

clean:
	rm -rf .venv .pytest_cache .ruff_cache
