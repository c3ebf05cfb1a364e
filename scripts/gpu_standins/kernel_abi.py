"""Can the real sgl_kernel (sglang-kernel 0.4.10, built against torch 2.14.1) load on the GPU image's torch 2.11?

    python scripts/gpu_standins/kernel_abi.py --wheel sglang_kernel-0.4.10-*.whl \\
        --torch 2.11=.rehearsal/venv --torch 2.14=.venv [--json docs/results/sgl_kernel_abi.json]

Checked without a GPU: every symbol of PyTorch's own libraries (c10, at, torch) that the wheel's Hopper
module ``sgl_kernel/sm90/common_ops.abi3.so`` leaves undefined must be defined by the libraries of the torch
that loads it (``nm -D``), or the dynamic loader refuses the module at ``import sgl_kernel``. The wheel
(373 MB) comes from ``pip download --no-deps sglang-kernel==0.4.10``. Prints the missing symbols per torch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile

MODULE = "sgl_kernel/sm90/common_ops.abi3.so"
TORCH_LIBS = ("libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libc10.so", "libc10_cuda.so")


def symbols(path: str, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def demangle(names: list[str]) -> list[str]:
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return r.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--torch", action="append", required=True, help="LABEL=VENV (a venv holding torch)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(args.wheel) as whl:
        module = whl.extract(MODULE, tmp)
        needed = {s for s in symbols(module, defined=False) if "c10" in s or "torch" in s or "2at" in s}
    report = {"wheel": os.path.basename(args.wheel), "module": MODULE, "torch_symbols_needed": len(needed)}
    for spec in args.torch:
        label, venv = spec.split("=", 1)
        libdirs = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "torch", "lib"))
        if not libdirs:
            print(f"no torch in {venv}", file=sys.stderr)
            return 2
        have: set[str] = set()
        for lib in TORCH_LIBS:
            if os.path.exists(os.path.join(libdirs[0], lib)):
                have |= symbols(os.path.join(libdirs[0], lib), defined=True)
        missing = sorted(needed - have)
        report[f"torch_{label}"] = {"missing": len(missing), "symbols": demangle(missing)}
        print(f"torch {label}: {len(missing)} of {len(needed)} torch symbols missing")
        for name in report[f"torch_{label}"]["symbols"]:
            print(f"  {name}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
