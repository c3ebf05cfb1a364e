"""The GPU suite's logic on a CPU, in the default run: what ``pytest -m gpu`` checks on a device, minus the
device.

- SGLang's ``TritonAttnBackend`` (stand-in ``ModelRunner``, ``tests/sglang_triton_attn.py``) over KV
  fetched layer-wise by a real data plane into a CPU ``MHATokenToKVPool``, the kernels under
  ``TRITON_INTERPRET=1`` in a subprocess (float16: the interpreter's bf16 ``tl.dot`` is wrong): the same
  scenario and assertions as ``tests/test_gpu_attention.py``;
- the tiny random-weight Llama over KV fetched into a CPU pool (``lossless`` bit-exact and greedy-equal;
  ``transform`` within the KL bound): the same as ``tests/test_gpu_tiny_llama.py``;
- ``tests/gpu_measure.py``'s functions (writer bandwidth on a host pool; the kernels' throughput and
  compile timings under the interpreter): they run and say what they measured;
- the report plugin's ``metrics`` section (``tests/gpu_report.py``): a pytest run with the plugin
  serializes what its tests recorded through the ``gpu_metrics`` fixture.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.strict_device import StrictDevice, StrictKVPool

pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _run(args: list[str], tmp_path: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join(p for p in (str(TESTS), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=pythonpath, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _result(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-4000:]
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(line.removeprefix("RESULT "))


def test_triton_attention_over_kv_fetched_layerwise_on_a_cpu_pool(tmp_path):
    pytest.importorskip("sglang")
    from tier_scenarios import check_attention

    args = [str(TESTS / "tier_scenarios.py"), "attention", "--device", "cpu", "--dtype", "float16"]
    r = _result(_run([*args, "--workdir", str(tmp_path)], tmp_path, TRITON_INTERPRET="1"))
    assert r["device"] == "cpu"
    check_attention(r, require_early_admission=False)  # a loaded 2-core CI box may finish first


@pytest.mark.parametrize("codec,dtype", [("lossless", "float32"), ("transform", "bfloat16")])
def test_tiny_llama_over_kv_fetched_into_a_cpu_pool(tmp_path, monkeypatch, codec, dtype):
    pytest.importorskip("sglang")
    pytest.importorskip("transformers")
    from tier_scenarios import KL_BOUND, check_tiny_llama, tiny_llama_over_fetched_kv

    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "cache"))
    r = tiny_llama_over_fetched_kv("cpu", dtype, codec, tmp_path)
    check_tiny_llama(r)
    if codec == "transform":  # the CPU decode is the data plane's: the same bits as the in-process one
        assert r["kl_fetched_vs_cpu_decode"] == 0.0 and r["kv_max_abs_err_vs_cpu_decode"] == 0.0, r
        assert 0 < r["kl_mean"] < KL_BOUND / 2, r  # lossy, and with margin under the device's bound


def test_measurements_run_on_a_host_pool_and_under_the_interpreter(tmp_path):
    from gpu_measure import writer_h2d_gbps

    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from sgl_remote_kv.types import KVLayout

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    planes = [torch.zeros(128, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    w = writer_for(PoolTensors(planes[:2], planes[2:]), lay)
    r = writer_h2d_gbps(w, tokens=64, pinned=True, repeats=2)
    assert r["gbps"] > 0 and r["bytes"] == 2 * 2 * 64 * 2 * 16 * 2
    dev = StrictDevice()  # the device writer's code, over the strict CPU double: each path is the one named
    try:
        for pinned, path in ((True, "zero_copy"), (False, "staged")):
            pool = StrictKVPool(dev, lay, 128, torch.bfloat16)
            w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, 10.0, ops=dev)
            stats = writer_h2d_gbps(w, tokens=64, pinned=pinned, repeats=2)["writer_stats"]
            assert stats[path] == stats["writes"] == 3, stats
    finally:
        dev.close()
    code = textwrap.dedent(
        """
        import json, gpu_measure as gm
        out = {"compile": gm.compile_times("cpu"),
               "dequant": gm.dequant_gbps("cpu", 16, 256, "float16", iters=1),
               "inverse": gm.inverse_transform_gbps("cpu", 16, 2, 64, "float32", iters=1)}
        print("RESULT " + json.dumps(out))
        """
    )
    out = _result(_run(["-c", code], tmp_path, TRITON_INTERPRET="1"))
    comp = out["compile"]
    assert comp["triton_interpret"] is True and comp["device"] == "cpu"
    assert comp["kvpool_warm_up"]["writes"] == []  # a host writer compiles nothing
    for variant in (
        "scatter_float32",
        "dequant_float32",
        "dequant_channel_scales",
        "inverse_transform_float32",
    ):
        assert comp[variant]["first_s"] > 0 and comp[variant]["warm_s"] > 0, comp
    assert out["dequant"]["decoded_bytes"] == 16 * 256 * 2 and out["dequant"]["gbps"] > 0
    assert out["inverse"]["decoded_bytes"] == 2 * 16 * 128 * 4 and out["inverse"]["gbps"] > 0


_METRICS_TESTS = """
import math

import numpy as np
import torch


def test_records(gpu_metrics):
    gpu_metrics["writer_h2d_gbps_zero_copy"] = 12.5
    gpu_metrics["np_scalar"] = np.float32(2.5)
    gpu_metrics["torch_scalar"] = torch.tensor(3.0)
    gpu_metrics["array"] = np.arange(3)
    gpu_metrics["not_finite"] = math.nan
    gpu_metrics["nested"] = {"first_s": 1.25, "writes": ("kv", "codes:x"), 7: None}
    gpu_metrics["writer_h2d_gbps_zero_copy"] = 13.0  # the last value counts
    assert gpu_metrics["np_scalar"] == 2.5


def test_records_then_fails(gpu_metrics):
    gpu_metrics["before_failure"] = 1
    assert False


def test_records_nothing():
    pass
"""


def test_report_plugin_serializes_recorded_metrics(tmp_path):
    (tmp_path / "test_m.py").write_text(_METRICS_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "out" / "gpu_check.json"
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_report", "--gpu-report", str(report)]
    res = _run([*args, "test_m.py"], tmp_path)
    assert res.returncode == 1, res.stdout[-3000:]  # one test fails on purpose
    r = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    m = r["metrics"]
    assert m["writer_h2d_gbps_zero_copy"] == {"value": 13.0, "test": "test_m.py::test_records"}
    assert m["np_scalar"]["value"] == 2.5 and m["torch_scalar"]["value"] == 3.0
    assert m["array"]["value"] == [0, 1, 2]
    assert m["not_finite"]["value"] == "nan"
    assert m["nested"]["value"] == {"first_s": 1.25, "writes": ["kv", "codes:x"], "7": None}
    assert m["before_failure"] == {"value": 1, "test": "test_m.py::test_records_then_fails"}
    assert r["totals"]["passed"] == 2 and r["totals"]["failed"] == 1


def test_jsonable_turns_measurements_into_json_values():
    from gpu_report import jsonable

    assert jsonable(np.float64(0.5)) == 0.5 and type(jsonable(np.float64(0.5))) is float
    assert jsonable(np.int64(7)) == 7 and type(jsonable(np.int64(7))) is int
    assert jsonable(np.bool_(True)) is True
    assert jsonable(torch.tensor([1.5, 2.0])) == [1.5, 2.0]
    assert jsonable(math.inf) == "inf" and jsonable(-math.inf) == "-inf"
    assert jsonable(Path("/x")) == "/x"
    json.dumps(jsonable({"a": [np.float32(1), {"b": torch.tensor(2)}]}), allow_nan=False)
