"""Stand-in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` (it imports NVIDIA's CUTLASS DSL at module
level). SGLang's ``DualGemm._select_mode`` imports three names from it on CUDA; the dual GEMM is never
usable here (upstream returns False on sm90 too), so every MLP takes its plain GEMMs."""

from __future__ import annotations

import enum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(enum.IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self != DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(*args, **kwargs) -> bool:
    return False
