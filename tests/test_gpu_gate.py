"""The GPU suite's gate (``tests/gpu_gate.py``), on the CPU: its reasons, and which import failures it
turns into a skip naming the module (not carried to the GPU machine) and which it lets fail the test."""

from __future__ import annotations

import pytest
from gpu_gate import NO_CUDA, NOT_INSTALLED, missing_module, reason


def test_reasons():
    assert reason(None, None) is None
    on_gpu = reason("sglang", None)  # the GPU machine given only the nvdec wheel set
    assert on_gpu.startswith("needs 'sglang'") and NOT_INSTALLED in on_gpu and "gpu_wheels.sh" in on_gpu
    no_cuda = f"{NO_CUDA}: torch 2.11.0 sees no CUDA device"
    assert reason(None, no_cuda) == no_cuda
    both = reason("zmq", no_cuda)  # the rehearsal refuses this one: a wheel of its set is missing
    assert both.startswith(NO_CUDA) and "'zmq'" in both and NOT_INSTALLED in both


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_missing_third_party_module_is_named(tmp_path, monkeypatch):
    assert missing_module(["json", "srkv_gate_absent_pkg"]) == "srkv_gate_absent_pkg"
    # like sgl_remote_kv.fetch.dpu_client.client without pyzmq: the module imports, its dependency is absent
    mod = _module(tmp_path, monkeypatch, "srkv_gate_needs_dep", "import srkv_gate_absent_dep.sub\n")
    assert missing_module([mod]) == "srkv_gate_absent_dep"
    assert missing_module(["json"]) is None


def test_other_import_failures_fail_the_test(tmp_path, monkeypatch):
    with pytest.raises(ModuleNotFoundError):  # ours missing: a bug, not a wheel left behind
        missing_module(["sgl_remote_kv.srkv_gate_no_such_module"])
    mod = _module(tmp_path, monkeypatch, "srkv_gate_drift", "from json import no_such_name\n")
    with pytest.raises(ImportError, match="no_such_name"):  # API drift (torch 2.11 vs 2.14, say)
        missing_module([mod])
