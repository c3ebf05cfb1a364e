"""The only module that reads environment variables. All are prefixed ``SRKV_``.

- ``SRKV_CPU_PLATFORM=1``: activate the CPU development platform plugin (CPU dev/CI only).
- ``SRKV_CACHE_DIR``: where the built model and the embedded store live
  (default ``~/.cache/sgl-remote-kv``).
- ``SRKV_ALLOW_SGLANG_VERSION=1``: run the tier on an SGLang version other than the one its seam was
  written for (``sglang_glue/seam.py``), at the operator's risk.
- ``SRKV_CONFIG``: JSON of the parsed ``RemoteKVConfig``; set by the launcher-side plugin so the
  scheduler subprocesses see the exact config the CLI produced (never set by hand).
- ``SRKV_STORE_PASSWORD``: the Redis store's password, for URLs that name neither a password nor a
  ``password_file`` (``store/credentials.py``); inherited by the scheduler and data-plane processes, and
  never on a command line.
- ``SRKV_PINNED_NUMERICS``: set by ``python -m sgl_remote_kv.codec.calibration`` when it re-executes itself with
  pinned numerics (``pinned_numerics_env``; never set by hand).
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_PLATFORM = "SRKV_CPU_PLATFORM"
CACHE_DIR = "SRKV_CACHE_DIR"
CONFIG_JSON = "SRKV_CONFIG"
ALLOW_SGLANG_VERSION = "SRKV_ALLOW_SGLANG_VERSION"
STORE_PASSWORD = "SRKV_STORE_PASSWORD"
PINNED_NUMERICS = "SRKV_PINNED_NUMERICS"

# Third-party knobs that make float results independent of the x86 CPU a fit runs on: every library
# takes its AVX2 code path (the oldest CPU the wheels' fast paths need), MKL in strict conditional-
# reproducibility mode, a fixed thread count. Read by the libraries at load, hence set before a re-exec.
_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
    "NUMBA_CPU_NAME": "haswell",
}
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cpu_platform_enabled() -> bool:
    return _flag(CPU_PLATFORM)


def allow_other_sglang() -> bool:
    return _flag(ALLOW_SGLANG_VERSION)


def cache_dir() -> Path:
    raw = os.environ.get(CACHE_DIR)
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "sgl-remote-kv"


def store_password() -> str | None:
    return os.environ.get(STORE_PASSWORD) or None


def config_json() -> str | None:
    return os.environ.get(CONFIG_JSON) or None


def numerics_pinned() -> bool:
    return _flag(PINNED_NUMERICS)


def pinned_numerics_env(threads: int) -> dict[str, str]:
    """This process's environment plus the pinned-numerics knobs and ``threads`` threads everywhere."""
    return {
        **os.environ,
        **_NUMERICS,
        **dict.fromkeys(_THREAD_VARS, str(threads)),
        PINNED_NUMERICS: "1",
    }


def single_threaded_env() -> dict[str, str]:
    """This process's environment with one thread for every numeric library (a write-back encoder process:
    one core's worth each)."""
    return {**os.environ, **dict.fromkeys(_THREAD_VARS, "1")}


def publish_config_json(payload: str) -> None:
    """Export the parsed config to child processes (scheduler, detokenizer) started after this call."""
    os.environ[CONFIG_JSON] = payload
