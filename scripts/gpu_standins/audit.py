"""Import SGLang's launch path as CUDA would, with the stand-ins as ``sgl_kernel``, on a machine without CUDA.

    python scripts/gpu_standins/audit.py [--json PATH]

``torch.cuda`` is made to answer like an H200 (``is_available`` True, capability 9.0) before SGLang is
imported, so every ``if _is_cuda:`` import of ``sgl_kernel`` runs against the stand-ins: a name SGLang imports
that they lack fails here, not on the GPU machine. Then SGLang's RMSNorm (with and without a residual) is run
through its CUDA dispatch, which calls the stand-ins, and compared with its ``forward_native``; the MLP's dual
GEMM selection resolves to the CUTLASS-free stand-in. Prints one JSON object (``ok``, the modules imported,
the stand-in names SGLang bound, each check); exit 1 when anything failed. Used by
``tests/test_gpu_standins.py`` (make test) and by ``scripts/gpu_server_check.sh`` in its rehearsal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# what `python -m sglang.launch_server` imports for a dense Llama with the triton attention backend
MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.distributed.parallel_state",
)
ENV = {
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
    "SGLANG_CRASH_ON_JIT_COMPILE": "1",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
}


def fake_cuda() -> None:
    import torch

    class Props:
        name = "NVIDIA H200 (audit)"
        major, minor = 9, 0
        total_memory = 140 * 2**30
        multi_processor_count = 132
        L2_cache_size = 50 * 2**20
        gcnArchName = ""
        uuid = "audit"

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: Props.name
    torch.cuda.get_device_properties = lambda *a, **k: Props()


def norm_checks() -> dict[str, str]:
    """SGLang's RMSNorm through its CUDA dispatch (the stand-ins) against its forward_native, bf16 CPU."""
    import torch
    from sglang.srt.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    out = {}
    norm = RMSNorm(256, eps=1e-5).to(torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    r = torch.randn(5, 256, dtype=torch.bfloat16)
    want = norm.forward_native(x.clone())
    got = norm.forward_cuda(x.clone())
    out["RMSNorm.forward_cuda"] = "equal" if torch.equal(got, want) else "DIFFERS"
    wx, wr = norm.forward_native(x.clone(), r.clone())
    gx, gr = norm.forward_cuda(x.clone(), r.clone())
    same = torch.equal(gx, wx) and torch.equal(gr, wr)
    out["RMSNorm.forward_cuda(residual)"] = "equal" if same else "DIFFERS"
    from sglang.kernels.ops.gemm.cutedsl_dual_gemm import can_use_dual_gemm

    out["cutedsl_dual_gemm"] = "stand-in" if can_use_dual_gemm() is False else "REAL"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, HERE)
    t0 = time.monotonic()
    fake_cuda()
    report: dict = {"ok": False, "modules": {}, "checks": {}}
    for name in MODULES:
        try:
            importlib.import_module(name)
            report["modules"][name] = "ok"
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)[-1]
            report["modules"][name] = f"{type(e).__name__}: {e} ({os.path.basename(tb.filename)}:{tb.lineno})"
    import sgl_kernel

    report["sgl_kernel"] = getattr(sgl_kernel, "__file__", "?")
    report["standin"] = bool(getattr(sgl_kernel, "STANDIN", False))
    bound = sorted(
        f"{m.__name__}.{k}"
        for m in list(sys.modules.values())
        if getattr(m, "__name__", "").startswith("sglang.")
        for k, v in list(vars(m).items())
        if callable(v) and (getattr(v, "__module__", None) or "").startswith("sgl_kernel")
    )
    report["bound"] = bound
    try:
        report["checks"] = norm_checks()
    except Exception as e:
        report["checks"] = {"error": f"{type(e).__name__}: {e}"}
    report["ok"] = (
        report["standin"]
        and all(v == "ok" for v in report["modules"].values())
        and bool(report["checks"])
        and all(v in ("equal", "stand-in") for v in report["checks"].values())
    )
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
