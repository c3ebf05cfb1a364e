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
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_PLATFORM = "SRKV_CPU_PLATFORM"
CACHE_DIR = "SRKV_CACHE_DIR"
CONFIG_JSON = "SRKV_CONFIG"
ALLOW_SGLANG_VERSION = "SRKV_ALLOW_SGLANG_VERSION"
STORE_PASSWORD = "SRKV_STORE_PASSWORD"


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


def publish_config_json(payload: str) -> None:
    """Export the parsed config to child processes (scheduler, detokenizer) started after this call."""
    os.environ[CONFIG_JSON] = payload
