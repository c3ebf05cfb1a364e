"""Out-of-tree CPU platform for development and CI (entry point group ``sglang.srt.platforms``).

SGLang 0.5.23's in-tree CPU engine needs a source-built sgl-kernel. This platform instead makes every
fused/custom op dispatch to its native torch forward and defaults attention to ``torch_native``.
It activates only when ``SGL_REMOTE_KV_CPU_PLATFORM=1``, so GPU users are never affected.
"""

from __future__ import annotations

from sgl_remote_kv import env


def activate() -> str | None:
    """Return the platform class's qualified name when asked for by env var, else None (inactive)."""
    if not env.cpu_platform_enabled():
        return None
    return "sgl_remote_kv.sglang_glue.cpu_platform_impl.CpuDevPlatform"
