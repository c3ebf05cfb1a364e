"""When a GPU-suite test (``tests/test_gpu_*.py``) runs, and the one wording of why it does not.

A test module takes the gate with ``from gpu_gate import gpu_gate  # noqa: F401`` (an autouse fixture)
and names the third-party modules its tests import when they run with ``pytest.mark.gpu_needs(...)`` (on
the module, a class or a test). Before each test the gate

1. imports those modules. A missing third-party module (``ModuleNotFoundError`` for a name outside this
   repository) is noted; any other import error is raised, so the test errors: torch/SGLang API drift
   (the GPU machine has torch 2.11, development 2.14) shows as an error even where there is no CUDA
   (``make gpu-rehearsal``), and only in the tests that import the module;
2. skips when torch sees no CUDA device: the reason starts with :data:`NO_CUDA` (a missing module is
   added to it, with :data:`NOT_INSTALLED`);
3. skips, naming the module, when one is missing (``needs 'sglang' ...``, :data:`NOT_INSTALLED`): on the
   GPU machine that means its wheel was not carried (``scripts/gpu_wheels.sh`` has one set per call).

``scripts/gpu_rehearsal.sh`` accepts, on its machine without CUDA, only skips whose reason starts with
:data:`NO_CUDA` and does not contain :data:`NOT_INSTALLED`.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Iterable
from pathlib import Path

import pytest

NO_CUDA = "no CUDA"
NOT_INSTALLED = "not installed here"
NVCUVID = "libnvcuvid.so.1"  # NVDEC's user-space library, part of the NVIDIA driver
_TESTS = Path(__file__).resolve().parent
_OURS = {"sgl_remote_kv", "tests", "benchmarks"}


def _ours(name: str) -> bool:
    top = name.split(".")[0]
    return top in _OURS or (_TESTS / f"{top}.py").exists() or (_TESTS / top).is_dir()


def missing_module(modules: Iterable[str]) -> str | None:
    """Import ``modules`` in order; the top-level name of the first third-party module that is not
    installed, else ``None``. Any other import error (ours missing, a broken import) is raised."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or _ours(e.name):
                raise
            return e.name.split(".")[0]
    return None


def cuda_reason() -> str | None:
    """``None`` when torch sees a CUDA device, else the reason (starts with :data:`NO_CUDA`)."""
    try:
        import torch
    except ModuleNotFoundError:
        return f"{NO_CUDA}: torch is {NOT_INSTALLED}"
    if not torch.cuda.is_available():
        return f"{NO_CUDA}: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device"
    return None


def reason(missing: str | None, no_cuda: str | None) -> str | None:
    """The skip reason for a missing module (or ``None``) and a :func:`cuda_reason` (or ``None``)."""
    need = f"needs {missing!r}, {NOT_INSTALLED} (carry its wheel: scripts/gpu_wheels.sh)" if missing else None
    if no_cuda:
        return f"{no_cuda}; it also {need}" if need else no_cuda
    return need


def skip_reason(modules: Iterable[str] = ()) -> str | None:
    """Why a test needing ``modules`` cannot run here, or ``None`` (imports them first)."""
    missing = missing_module(modules)
    return reason(missing, cuda_reason())


def nvcuvid_reason() -> str | None:
    """``None`` when the NVIDIA driver's NVDEC library loads, else why not (one line)."""
    try:
        ctypes.CDLL(NVCUVID)
    except OSError as e:
        return (
            f"the NVIDIA driver here has no NVDEC library ({NVCUVID} does not load: {e}); in a container "
            "NVIDIA_DRIVER_CAPABILITIES must include 'video'"
        )
    return None


@pytest.fixture(autouse=True)
def gpu_gate(request):
    """Skip (or error) before the test body, per the module docstring."""
    modules = [m for mark in request.node.iter_markers("gpu_needs") for m in mark.args]
    why = skip_reason(modules)
    if why is not None:
        pytest.skip(why)
