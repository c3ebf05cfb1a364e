"""Stand-ins for ``sgl_kernel`` on the GPU server check (scripts/gpu_standins/README.md); never shipped.

Implemented in torch (``ops.py``, checked against SGLang's ``forward_native``): the norms and gated
activations. Present but raising when called: the rest of what SGLang imports on CUDA (``STUBBED``).
Importing this package also registers the CUTLASS-free ``cutedsl_dual_gemm`` stand-in (``dual_gemm.py``):
SGLang imports ``sgl_kernel`` early in every process it spawns, before any model is built.
"""

from __future__ import annotations

import sys

from . import _stub
from .ops import (  # noqa: F401
    IMPLEMENTED,
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    silu_and_mul,
)

__version__ = "0.0.0+standin"
STANDIN = True

STUBBED = (
    "int8_scaled_mm",
    "moe_sum",
    "moe_sum_reduce",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "weak_ref_tensor",
    "merge_state_v2",
)
_stub.define(globals(), __name__, STUBBED)

DUAL_GEMM_MODULE = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
if DUAL_GEMM_MODULE not in sys.modules:
    from . import dual_gemm as _dual_gemm

    sys.modules[DUAL_GEMM_MODULE] = _dual_gemm
