"""The GPU server check's ``sgl_kernel`` stand-ins (scripts/gpu_standins) against SGLang's own torch forwards.

The stand-ins replace the 373 MB sglang-kernel wheel on the lent GPU machine; a result from that machine
says "SGLang with stand-ins for these ops", so each op must compute what SGLang's ``forward_native``
computes. Here on CPU tensors: the ops are plain torch, the device does not change their arithmetic.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STANDINS = ROOT / "scripts" / "gpu_standins"


def _load(name: str):
    """A stand-in module loaded by path under a private name: `sgl_kernel` stays unregistered here."""
    spec = importlib.util.spec_from_file_location(f"_standin_{name}", STANDINS / "sgl_kernel" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ops = _load("ops")
DTYPES = (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_and_fused_add_equal_sglangs_forward_native(dtype) -> None:
    from sglang.srt.layers.layernorm import RMSNorm

    torch.manual_seed(1)
    norm = RMSNorm(192, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    x, r = torch.randn(7, 192, dtype=dtype) * 3, torch.randn(7, 192, dtype=dtype)
    assert torch.equal(ops.rmsnorm(x, norm.weight.data, 1e-5), norm.forward_native(x.clone()))
    out = torch.empty_like(x)
    assert ops.rmsnorm(x, norm.weight.data, 1e-5, out=out) is out
    assert torch.equal(out, norm.forward_native(x.clone()))
    want_x, want_r = norm.forward_native(x.clone(), r.clone())
    gx, gr = x.clone(), r.clone()
    assert ops.fused_add_rmsnorm(gx, gr, norm.weight.data, 1e-5) is None  # in place, like the kernel
    assert torch.equal(gx, want_x) and torch.equal(gr, want_r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rmsnorm_equals_sglangs_forward_native(dtype) -> None:
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    torch.manual_seed(2)
    norm = GemmaRMSNorm(128, eps=1e-6).to(dtype)
    norm.weight.data.normal_(std=0.1)
    x, r = torch.randn(5, 128, dtype=dtype), torch.randn(5, 128, dtype=dtype)
    assert torch.equal(ops.gemma_rmsnorm(x, norm.weight.data, 1e-6), norm.forward_native(x.clone()))
    want_x, want_r = norm.forward_native(x.clone(), r.clone())
    gx, gr = x.clone(), r.clone()
    ops.gemma_fused_add_rmsnorm(gx, gr, norm.weight.data, 1e-6)
    assert torch.equal(gx, want_x) and torch.equal(gr, want_r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("op", "layer"), [("silu_and_mul", "silu"), ("gelu_and_mul", "none"), ("gelu_tanh_and_mul", "tanh")]
)
def test_gated_activations_equal_sglangs_forward_native(op, layer, dtype) -> None:
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul

    torch.manual_seed(3)
    ref = SiluAndMul() if layer == "silu" else GeluAndMul(approximate=layer)
    x = torch.randn(6, 2 * 96, dtype=dtype)
    want = ref.forward_native(x)
    out = torch.empty(6, 96, dtype=dtype)
    getattr(ops, op)(x, out)  # SGLang's call: the kernel writes `out`
    assert torch.equal(out, want)
    assert torch.equal(getattr(ops, op)(x), want)


def test_no_programmatic_dependent_launch() -> None:
    assert ops.is_arch_support_pdl() is False


def test_every_implemented_op_is_tested_here() -> None:
    source = Path(__file__).read_text()
    untested = [
        name for name in ops.IMPLEMENTED if f'"{name}"' not in source and f"ops.{name}(" not in source
    ]
    assert not untested, f"stand-in ops without an equivalence test: {untested}"


def test_stubbed_names_raise_naming_themselves() -> None:
    ns: dict = {}
    _load("_stub").define(ns, "sgl_kernel.kvcacheio", ("transfer_kv_per_layer",))
    with pytest.raises(NotImplementedError, match="kvcacheio.transfer_kv_per_layer: not provided"):
        ns["transfer_kv_per_layer"](None)


def test_sglang_imports_its_cuda_launch_path_against_the_stand_ins() -> None:
    """scripts/gpu_standins/audit.py in a child: torch.cuda answers like an H200, SGLang's CUDA-only
    `sgl_kernel` imports resolve to the stand-ins (a name they lack fails here), its RMSNorm's CUDA dispatch
    reaches them and equals forward_native, and the dual GEMM selection takes the CUTLASS-free stand-in."""
    r = subprocess.run(
        [sys.executable, str(STANDINS / "audit.py")], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    report = json.loads(r.stdout[r.stdout.index("{") :])
    assert r.returncode == 0 and report["ok"], r.stdout[-3000:] + r.stderr[-3000:]
    assert report["standin"] and report["sgl_kernel"].endswith("scripts/gpu_standins/sgl_kernel/__init__.py")
    assert "sglang.srt.layers.layernorm.fused_add_rmsnorm" in report["bound"]
    assert "sglang.srt.mem_cache.pool_host.mha.transfer_kv_per_layer" in report["bound"]  # a raising stub
    assert report["checks"]["RMSNorm.forward_cuda(residual)"] == "equal"
