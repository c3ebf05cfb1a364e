"""The CPU dev platform turns on flush-to-zero for its process, including threads created later."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import threading, torch
from sgl_remote_kv.sglang_glue import cpu_platform
tiny = torch.tensor([1e-323], dtype=torch.float64)  # a float64 denormal
before = float(tiny * 1.0) > 0  # compared now: after DAZ even Python sees 1e-323 as 0
name = cpu_platform.activate()
main = float(torch.tensor([1e-323], dtype=torch.float64) * 1.0)
box = {}
t = threading.Thread(target=lambda: box.update(v=float(torch.tensor([1e-323], dtype=torch.float64) * 1.0)))
t.start(); t.join()
print(name, before, main == 0.0, box["v"] == 0.0)
"""


def _run(enabled: bool) -> list[str]:
    env = {**os.environ, "SRKV_CPU_PLATFORM": "1" if enabled else "0"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_active_platform_flushes_denormals_in_new_threads_too():
    name, denormal_before, main, thread = _run(True)
    assert name.endswith("CpuDevPlatform")
    assert denormal_before == "True"  # the platform, not the interpreter, flushes
    assert (main, thread) == ("True", "True")


def test_inactive_platform_leaves_floating_point_alone():
    name, denormal_before, main, thread = _run(False)
    assert name == "None"
    assert (denormal_before, main, thread) == ("True", "False", "False")
