"""Out-of-tree CPU platform for development and CI (entry point group ``sglang.srt.platforms``).

SGLang 0.5.23's in-tree CPU engine needs a source-built sgl-kernel. This platform instead makes every
fused/custom op dispatch to its native torch forward and defaults attention to ``torch_native``.
It activates only when ``SRKV_CPU_PLATFORM=1``, so GPU users are never affected.
"""

from __future__ import annotations

from sgl_remote_kv import env


def activate() -> str | None:
    """Return the platform class's qualified name when asked for by env var, else None (inactive).

    Active, it also turns on flush-to-zero / denormals-are-zero for this process (``flush_denormals``).
    """
    if not env.cpu_platform_enabled():
        return None
    flush_denormals()
    return "sgl_remote_kv.sglang_glue.cpu_platform_impl.CpuDevPlatform"


def flush_denormals() -> None:
    """FTZ/DAZ on the calling thread; threads it creates later (OpenMP's pool, SGLang's overlap
    thread) inherit the floating-point environment. Called when the platform is resolved, before
    any forward pass. Why: SGLang's ``torch_native`` extend attention pads queries with
    ``torch.empty`` and runs SDPA over the padding; when that memory holds bytes that read as
    denormal floats, attention is far slower on x86 (docs/results/INTEGRATION_NOTES.md). The padding rows are discarded; real values change
    only where they fall below float32's normal range (~1.2e-38), which the dev platform accepts."""
    import torch

    torch.set_flush_denormal(True)
