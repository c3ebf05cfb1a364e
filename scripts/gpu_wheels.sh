#!/usr/bin/env bash
# Download the wheels the GPU suite needs on the bare, offline GPU machine into .whl/ (run it HERE,
# where pip reaches an index). scripts/gpu_check.sh installs them there into /tmp/site.
#
#   bash scripts/gpu_wheels.sh            # profile "core" (default): sgl_remote_kv + SGLang's KV pool
#   bash scripts/gpu_wheels.sh nvdec      # profile "nvdec": PyNvVideoCodec (tests/test_gpu_nvdec.py)
#   bash scripts/gpu_wheels.sh server     # profile "server": a whole SGLang server (scripts/gpu_server_check.sh)
#   bash scripts/gpu_wheels.sh nvcomp     # profile "nvcomp": NVIDIA nvCOMP (tests/test_gpu_nvcomp.py)
#
# The GPU image already has torch, triton, numpy, numba, pytest, transformers, safetensors, psutil, ...
# (/work/.library/device/KINDS.md); each wheel below was found missing there by importing the suite's
# modules against exactly that package set. Versions are the ones .venv holds (make setup).
#
# "core": what `import sgl_remote_kv.{kernels,kvpool,codec,dpu,fetch.dpu_client}` and
# `python -m sgl_remote_kv.dpu` need, plus what `from sglang.srt.mem_cache.memory_pool import
# MHATokenToKVPool` needs on CUDA. SGLang's wheel is slimmed: its five Rust extension modules (*.so:
# HTTP/gRPC server, benchmark, multimodal, radix-tree core; 19 MB of its 39 MB) are dropped; importing
# the KV pool loads none of them. SGLang also imports sgl_kernel at module level on CUDA; that wheel
# (sglang-kernel) is 373 MB, so gpu_check.sh puts an import-only stub there instead (calls raise).
#
# "server": "core" plus what `python -m sglang.launch_server` imports beyond the KV pool (HTTP server,
# JSON schema, OpenTelemetry API, soundfile through transformers' processors; found by importing the launch
# path against the rehearsal's image-like environment), plus this project's own wheel built from the tree
# (the server finds `--remote-kv` through its entry points: what users install). SGLang slimmed as in core:
# none of its Rust modules is on the launch path (its radix-tree core is replaced by SGLang's Python one:
# built for torch 2.14.1, it misreads torch 2.11's tensors). No sgl_kernel: scripts/gpu_standins/.
#
# "nvdec": isal + pynvvideocodec (~27 MiB). No PyAV (34 MiB): the NVDEC tests decode committed chunks and
# compare with committed CPU-twin decodes (tests/fixtures/nvdec/, tests/nvdec_fixtures.py). Its own
# profile, for its own call (with the core set it would pass the 64 MiB one device call carries); each
# run replaces the other profile's wheels in .whl/ (wheels this script does not know stay, and travel
# too). The GPU tests of the other profile skip there, naming the package that was not carried.
# "nvcomp": isal + zstandard (the codec the test encodes with) + nvCOMP's Python API and its library
# (38 MiB): whether a GPU lossless stage would pay (issue 50 item 7). Its own call, like "nvdec".
# Budget checked at the end: tree + wheels, 60 MiB for "core" (64 is the limit), 40 MiB for "nvdec",
# 50 MiB for "nvcomp".
#
# Env: PYTHON (the pip to use; default .venv/bin/python, else python3), GPU_WHEELS_DIR (default .whl),
#      GPU_WHEELS_PYTHON (target Python, default 3.12: the GPU image's), GPU_WHEELS_SLIM_SGLANG (default 1;
#      0 keeps SGLang's .so files).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROFILE=${1:-core}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
DEST=${GPU_WHEELS_DIR:-$ROOT/.whl}
PYVER=${GPU_WHEELS_PYTHON:-3.12}
SLIM=${GPU_WHEELS_SLIM_SGLANG:-1}

# name==version             needed by
CORE_BASE="
pyzmq==27.3.0               fetch.dpu_client, dpu (ZeroMQ between the DPU client and the data plane)
msgspec==0.22.0             contract.messages, contract.protocol (wire messages); SGLang too
isal==1.9.1                 codec.format, codec.lz (deflate)
zstandard==0.25.0           codec.lz
"
CORE_SGLANG="
sglang==0.5.23              sglang.srt.mem_cache.memory_pool.MHATokenToKVPool (slimmed, see above)
apache-tvm-ffi==0.1.11      sglang.kernels (tvm_ffi at module level)
orjson==3.13.0              sglang.srt.utils
pybase64==1.5.1             sglang.srt.utils
pydantic==2.14.3            sglang (configs, entrypoint models)
pydantic-core==2.50.4       pydantic (exact pin)
annotated-types==0.8.0      pydantic
typing-inspection==0.4.5    pydantic
typing-extensions==4.16.0   pydantic needs >=4.16 (the image's version is unknown; newer is compatible)
starlette==1.10.0           sglang (imported through the server-args chain)
ipython==9.18.1             sglang.utils (IPython.display)
traitlets==5.16.1           ipython
httpx2==2.16.2              sglang.srt.utils
httpcore2==2.16.2           httpx2
truststore==0.10.5          httpx2, httpcore2
dill==0.4.1                 sglang.srt.utils
compressed-tensors==0.18.0  sglang.srt.layers.quantization
loguru==0.7.3               compressed-tensors
gguf==0.19.0                sglang.srt.layers.quantization.gguf
openai==2.8.0               sglang's Triton attention backend import chain (tests/test_gpu_attention.py)
distro==1.9.0               openai
sniffio==1.3.1              openai
partial-json-parser==0.2.1.1.post7  sglang's Triton attention backend import chain
"
SERVER="
fastapi==0.165.0            sglang.srt.entrypoints.http_server
uvicorn==0.54.0             sglang.srt.entrypoints.http_server
h11==0.16.0                 uvicorn
click==8.5.1                uvicorn
anyio==4.16.0               starlette, fastapi
idna==3.20                  anyio
python-multipart==0.0.34    fastapi (form bodies)
setproctitle==1.3.8         sglang.srt.utils (process titles)
opentelemetry-api==1.45.2   fastapi.telemetry
jsonschema==4.26.0          sglang.srt.entrypoints.openai.protocol
referencing==0.37.0         jsonschema
rpds-py==2026.9.1           referencing
jsonschema-specifications==2025.9.1  jsonschema
soundfile==0.13.1           transformers' AutoProcessor, imported by SGLang's tokenizer manager
cffi==2.1.1                 soundfile
xgrammar==0.2.7             sglang.srt.function_call (StructuralTag; imported by the OpenAI chat server)
"
NVDEC="
isal==1.9.1                 codec.format (the hevc codec's chunk framing)
pynvvideocodec==2.2.4       nvdec.nvcodec (NVDEC)
"
NVCOMP="
isal==1.9.1                 codec.format, codec.lz (deflate)
zstandard==0.25.0           codec.lz
nvidia-nvcomp-cu13==6.0.0.12     tests/test_gpu_nvcomp.py (nvidia.nvcomp, the Python API)
nvidia-libnvcomp-cu13==6.0.0.12  nvidia-nvcomp-cu13 (libnvcomp.so.6)
"
# what this script dropped from a profile: still removed from .whl/ on every run (one version each)
RETIRED="
av==18.1.0                  nvdec.video: the nvdec profile's CPU twin until the NVDEC fixtures
"
case "$PROFILE" in
  core) LIST="$CORE_BASE$CORE_SGLANG"; BUDGET_MIB=60 ;;
  nvdec) LIST="$NVDEC"; BUDGET_MIB=40 ;;
  nvcomp) LIST="$NVCOMP"; BUDGET_MIB=50 ;;
  server) LIST="$CORE_BASE$CORE_SGLANG$SERVER"; BUDGET_MIB=60 ;;
  *) echo "usage: $0 [core|nvdec|server|nvcomp]" >&2; exit 2 ;;
esac
SPECS=$(echo "$LIST" | awk 'NF {print $1}')
mkdir -p "$DEST"

# the wheel files in $DEST of distribution NAME (optionally VERSION): NAME normalised to underscores
wheels_of() {
  "$PY" -c '
import os, re, sys
dest, name = sys.argv[1], re.sub(r"[-_.]+", "_", sys.argv[2]).lower()
version = sys.argv[3] if len(sys.argv) > 3 else None
for f in sorted(os.listdir(dest)):
    parts = f.split("-")
    if f.endswith(".whl") and parts[0].lower() == name and (version is None or parts[1] == version):
        print(os.path.join(dest, f))
' "$DEST" "$@"
}

# one version of each distribution in $DEST (two stop the whole install there), and one profile (both
# do not fit in one call): drop the wheels of every distribution this script knows, any version
for spec in $(echo "$CORE_BASE$CORE_SGLANG$SERVER$NVDEC$NVCOMP$RETIRED sgl_remote_kv==x" | awk 'NF {print $1}'); do
  wheels_of "${spec%%==*}" | while read -r f; do rm -f "$f"; done
done
rm -f "$DEST"/MANIFEST-core.txt "$DEST"/MANIFEST-nvdec.txt "$DEST"/MANIFEST-server.txt "$DEST"/MANIFEST-nvcomp.txt

PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64"
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for spec in $SPECS; do
  extra=""
  # sglang publishes only manylinux_2_34 wheels (glibc >= 2.34; the image's Python 3.12.3 is Ubuntu 24.04's)
  if [ "${spec%%==*}" = sglang ]; then extra="--platform manylinux_2_34_x86_64"; fi
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp $PLAT $extra -d "$DEST" "$spec" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  if [ -z "$(wheels_of "${spec%%==*}" "${spec##*==}")" ]; then
    echo "gpu_wheels: could not download $spec" >&2
    exit 1
  fi
done

if [ "$PROFILE" = server ]; then  # this project's wheel (no build isolation: offline-safe), built from a copy
  # of what a clone holds: setuptools reuses the tree's build/, which keeps modules since deleted (the first
  # H200 server run carried a stale sgl_remote_kv/dpu/settings.py that way)
  src=$(mktemp -d)
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
     [ -e "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$src") \
    && "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$DEST" "$src" \
    || { rm -rf "$src"; echo "gpu_wheels: could not build this project's wheel" >&2; exit 1; }
  rm -rf "$src"
fi

if [ "$SLIM" = 1 ] && [ -n "$(wheels_of sglang)" ]; then  # the profiles that carry SGLang
  "$PY" -c '
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as zin:
    if any(n.endswith(".so") for n in zin.namelist()):
        dropped = 0
        with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename.endswith(".so"):
                    dropped += info.file_size
                    continue
                data = zin.read(info)
                if info.filename.endswith(".dist-info/RECORD"):  # keep RECORD true to the contents
                    keep = [ln for ln in data.decode().splitlines() if not ln.split(",")[0].endswith(".so")]
                    data = ("\n".join(keep) + "\n").encode()
                zout.writestr(info, data)
        os.replace(path + ".tmp", path)
        print(f"gpu_wheels: {os.path.basename(path)}: dropped its .so modules ({dropped / 1e6:.0f} MB unpacked)")
' "$(wheels_of sglang)"
fi

# the manifest travels with the wheels; gpu_check.sh copies it into gpu_check.json
{
  echo "# scripts/gpu_wheels.sh $PROFILE: python $PYVER, $(date -u +%Y-%m-%dT%H:%M:%SZ), sglang slim=$SLIM"
  echo "$LIST" | awk 'NF'
} > "$DEST/MANIFEST-$PROFILE.txt"

# the pins against .venv (a mismatch means make setup moved on: update the pins above)
if [ -x "$ROOT/.venv/bin/python" ]; then
  # shellcheck disable=SC2086
  "$ROOT/.venv/bin/python" -c '
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        continue
    if have != want:
        print(f"gpu_wheels: note: .venv has {name}=={have}; the GPU wheels pin {want}")
' $SPECS
fi

echo "gpu_wheels: profile $PROFILE -> $DEST"
"$PY" -c '
import os, subprocess, sys
dest, root, profile, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
MiB = 1 << 20
wheels = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
total = 0
for f in wheels:
    n = os.path.getsize(os.path.join(dest, f))
    total += n
    print(f"  {n / MiB:7.2f} MiB  {f}")
out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                     capture_output=True, check=True).stdout.decode()
tree = sum(os.path.getsize(os.path.join(root, f)) for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f)))
print(f"gpu_wheels: carried for {profile}: {len(wheels)} wheels, {total / MiB:.1f} MiB; + working tree"
      f" {tree / MiB:.1f} MiB = {(total + tree) / MiB:.1f} MiB (budget {budget} MiB; one device call carries"
      " at most 64 MiB)")
if total + tree > budget * MiB:
    print(f"gpu_wheels: WARNING: over the {budget} MiB budget (every wheel in {dest} travels, not only this"
          " profile)", file=sys.stderr)
' "$DEST" "$ROOT" "$PROFILE" "$BUDGET_MIB"
