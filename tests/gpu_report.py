"""pytest plugin for ``scripts/gpu_check.sh``: writes the GPU suite's JSON report (not a test module).

Load with ``-p tests.gpu_report --gpu-report PATH``; inert without ``--gpu-report``. The report holds the
machine (GPU, driver, CUDA, torch, triton, Python), the versions of the packages the suite touches, the
setup ``gpu_check.sh`` made (``GPU_CHECK_SETUP_FILE``: carried wheels, stub, import paths), one entry per
test (``passed`` / ``failed`` / ``error`` / ``skipped`` / ``xfailed`` / ``xpassed``, the reason, seconds),
totals, and ``metrics``: the measurements tests recorded through the ``gpu_metrics`` fixture
(``gpu_metrics["writer_h2d_gbps"] = 11.2``; numbers, strings, booleans and lists / dicts of them), each as
``{"value": ..., "test": nodeid}``. The fixture records into the test's ``user_properties`` (pytest's
``record_property``), so it works with or without this plugin; ``tests/conftest.py`` re-exports it.

One policy beyond plain pytest, only with ``--gpu-report``: a test module whose import fails because a
THIRD-PARTY module is missing (``ModuleNotFoundError`` for a name that is neither in the repository nor
``sgl_remote_kv``) is reported as skipped, with the module's name, instead of failing the collection:
on the bare GPU machine that means "not carried" (see ``scripts/gpu_wheels.sh``), not a bug. Any other
import error stays an error.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = (
    "torch triton numpy numba pytest sglang sglang-kernel pyzmq msgspec isal zstandard av pynvvideocodec "
    "apache-tvm-ffi pydantic transformers cupy-cuda13x"
).split()
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
METRIC_PREFIX = "gpu_metric:"  # user_properties names the gpu_metrics fixture records under


class GpuMetrics(dict):
    """What ``gpu_metrics`` hands a test: a dict whose every assignment is also recorded for the report."""

    def __init__(self, record_property) -> None:
        super().__init__()
        self._record = record_property

    def __setitem__(self, name: str, value) -> None:
        value = jsonable(value)
        super().__setitem__(name, value)
        self._record(METRIC_PREFIX + name, value)


@pytest.fixture
def gpu_metrics(record_property) -> GpuMetrics:
    """Measurements for the GPU report's ``metrics`` section: ``gpu_metrics[name] = value``."""
    return GpuMetrics(record_property)


def jsonable(value):
    """``value`` as JSON can hold it: numbers (numpy / torch scalars and arrays too; NaN and infinities as
    strings), strings, booleans, None, and lists / dicts of them; anything else as its ``str``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy / torch scalars and arrays
    if callable(tolist) and not isinstance(value, float):
        try:
            return jsonable(tolist())
        except (TypeError, ValueError, RuntimeError):
            return str(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(float(value))
    return str(value)


def pytest_addoption(parser):
    parser.addoption("--gpu-report", default=None, help="write the GPU suite's JSON report to this path")


def pytest_configure(config):
    path = config.getoption("--gpu-report")
    if path:
        config.pluginmanager.register(_Report(config, Path(path)), "gpu_report_writer")


def _tail(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"error: {e}"
    return res.stdout if res.returncode == 0 else f"error (exit {res.returncode}): {_tail(res.stderr, 500)}"


def machine_info() -> dict:
    info: dict = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "libc": " ".join(platform.libc_ver()),
        "cpus": os.cpu_count(),
    }
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if smi is not None and not smi.startswith("error"):
        info["nvidia_smi"] = [
            dict(zip(("name", "driver", "memory"), (f.strip() for f in line.split(",")), strict=False))
            for line in smi.splitlines()
            if line.strip()
        ]
        m = re.search(r"CUDA Version:\s*([\d.]+)", _run(["nvidia-smi"]) or "")
        info["driver_cuda"] = m.group(1) if m else None
    else:
        info["nvidia_smi"] = smi or "not found"
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            gpus = []
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(
                    {
                        "name": p.name,
                        "capability": f"{p.major}.{p.minor}",
                        "memory_gib": round(p.total_memory / 2**30, 1),
                        "multiprocessors": p.multi_processor_count,
                    }
                )
            info["gpus"] = gpus
    except Exception as e:  # the report must still be written
        info["torch"] = f"error: {type(e).__name__}: {e}"
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = f"error: {type(e).__name__}: {e}"
    return info


def packages() -> dict:
    out = {name: _version(name) for name in PACKAGES}
    spec = importlib.util.find_spec("sgl_kernel")
    origin = str(spec.origin) if spec is not None else None
    try:
        stub = origin is not None and "STUB = True" in Path(origin).read_text()[:4000]
    except OSError:
        stub = False
    out["sgl_kernel (module)"] = "import-only stub (scripts/gpu_check.sh)" if stub else origin
    return out


class _Report:
    def __init__(self, config, path: Path) -> None:
        self.config = config
        self.path = path
        self.root = Path(str(config.rootpath))
        self.tests: dict[str, dict] = {}
        self.metrics: dict[str, dict] = {}
        self.deselected = 0
        self.started = datetime.datetime.now(datetime.timezone.utc)

    # -- collection ------------------------------------------------------------------------------
    def _ours(self, name: str) -> bool:
        top = name.split(".")[0]
        if top in ("sgl_remote_kv", "tests"):
            return True
        return any((d / top).exists() or (d / f"{top}.py").exists() for d in (self.root, self.root / "tests"))

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        rep = yield
        if rep.failed and isinstance(collector, pytest.Module):
            call = getattr(rep, "call", None)
            exc = call.excinfo.value if call is not None and call.excinfo is not None else None
            cause = getattr(exc, "__cause__", None)
            name = cause.name if isinstance(cause, ModuleNotFoundError) else None
            if name is None:
                m = _MISSING.search(str(rep.longrepr))
                name = m.group(1) if m else None
            if name and not self._ours(name):
                rep.outcome = "skipped"
                rep.longrepr = (
                    str(collector.path),
                    None,
                    f"Skipped: the test module needs {name.split('.')[0]!r}, which is not installed here "
                    "(carry its wheel: scripts/gpu_wheels.sh)",
                )
        return rep

    def pytest_collectreport(self, report):
        if report.failed:
            self.tests[report.nodeid or "<collection>"] = {
                "outcome": "error",
                "phase": "collect",
                "reason": _tail(str(report.longrepr)),
                "duration_s": 0.0,
            }
        elif report.skipped and isinstance(report.longrepr, tuple):
            self.tests[report.nodeid] = {
                "outcome": "skipped",
                "phase": "collect",
                "reason": str(report.longrepr[2]).removeprefix("Skipped: "),
                "duration_s": 0.0,
            }

    def pytest_deselected(self, items):
        self.deselected += len(items)

    # -- tests -----------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report):
        for name, value in report.user_properties:
            if isinstance(name, str) and name.startswith(METRIC_PREFIX):
                self.metrics[name.removeprefix(METRIC_PREFIX)] = {
                    "value": jsonable(value),
                    "test": report.nodeid,
                }
        t = self.tests.setdefault(report.nodeid, {"outcome": "passed", "reason": None, "duration_s": 0.0})
        t["duration_s"] = round(t["duration_s"] + report.duration, 4)
        wasxfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if wasxfail:
                t["outcome"] = "xfailed" if report.skipped else "xpassed"
                t["reason"] = report.wasxfail or None
            else:
                t["outcome"] = report.outcome
        elif report.failed:  # setup or teardown
            t["outcome"] = "error"
            t["phase"] = report.when
        elif report.skipped and report.when == "setup":
            t["outcome"] = "xfailed" if wasxfail else "skipped"
        if report.skipped and isinstance(report.longrepr, tuple):
            t["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            t["reason"] = crash.message if crash is not None else _tail(report.longreprtext, 500)
            t["details"] = _tail(report.longreprtext)

    # -- report ----------------------------------------------------------------------------------
    def pytest_sessionfinish(self, session, exitstatus):
        totals = {k: 0 for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
        for t in self.tests.values():
            totals[t["outcome"]] = totals.get(t["outcome"], 0) + 1
        totals["total"] = len(self.tests)
        totals["deselected"] = self.deselected
        setup = None
        setup_file = os.environ.get("GPU_CHECK_SETUP_FILE")
        if setup_file and os.path.exists(setup_file):
            try:
                setup = json.loads(Path(setup_file).read_text())
            except (OSError, ValueError) as e:
                setup = {"error": f"{setup_file}: {e}"}
        finished = datetime.datetime.now(datetime.timezone.utc)
        report = {
            "schema": 1,
            "started": self.started.isoformat(timespec="seconds"),
            "finished": finished.isoformat(timespec="seconds"),
            "wall_s": round((finished - self.started).total_seconds(), 1),
            "pytest_exit_status": int(exitstatus),
            "args": list(self.config.invocation_params.args),
            "machine": machine_info(),
            "packages": packages(),
            "setup": setup,
            "totals": totals,
            "tests": [{"nodeid": k, **v} for k, v in self.tests.items()],
            "metrics": self.metrics,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(self.path)
