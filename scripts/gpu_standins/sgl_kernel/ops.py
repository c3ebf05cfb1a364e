"""Torch implementations of the ``sgl_kernel`` ops SGLang 0.5.23's dense-Llama CUDA forward calls.

Signatures follow SGLang's call sites (``srt/layers/layernorm.py``, ``srt/layers/activation.py``); the
arithmetic follows each layer's ``forward_native`` so the result equals SGLang's own torch path
(``tests/test_gpu_standins.py``). No side effects at import: tests load this file alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _norm(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """``RMSNorm.forward_native`` without residual: fp32 math, ``(x * w)`` cast back to the input dtype."""
    y = (_norm(input.float(), eps) * weight).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place: ``residual <- input + residual`` (summed in fp32, stored in its dtype), ``input <-
    rmsnorm`` of the fp32 sum, as ``RMSNorm.forward_native`` with a residual."""
    s = input.float() + residual.float()
    residual.copy_(s.to(residual.dtype))
    input.copy_((_norm(s, eps) * weight).to(input.dtype))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """``GemmaRMSNorm.forward_native``: the weight is stored as ``w - 1``."""
    y = (_norm(input.float(), eps) * (1.0 + weight.float())).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place, as ``GemmaRMSNorm.forward_native`` with a residual (the sum in the input dtype)."""
    s = input + residual
    residual.copy_(s)
    input.copy_((_norm(s.float(), eps) * (1.0 + weight.float())).to(input.dtype))


def _act_and_mul(act, input, out):
    d = input.shape[-1] // 2
    y = act(input[..., :d]) * input[..., d:]
    if out is None:
        return y
    out.copy_(y)
    return out


def silu_and_mul(input, out=None, enable_pdl=None):
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input, out=None, enable_pdl=None):
    return _act_and_mul(lambda t: F.gelu(t, approximate="none"), input, out)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    return _act_and_mul(lambda t: F.gelu(t, approximate="tanh"), input, out)


def is_arch_support_pdl() -> bool:
    """No programmatic dependent launch: SGLang's Triton decode then launches without it."""
    return False


IMPLEMENTED = (
    "rmsnorm",
    "fused_add_rmsnorm",
    "gemma_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
)
