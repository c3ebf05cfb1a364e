"""Scatter a contiguous decoded chunk into a paged KV pool (SGLang's per-layer buffers).

``src`` is ``[planes, tokens, heads, dim]``; the pool is a list of per-plane tensors
``[pool_size, heads, dim]`` (SGLang ``MHATokenToKVPool.k_buffer`` / ``v_buffer``, K and V planes of a
round together); ``slots`` [tokens] are the pool rows to write. ``scatter_triton`` does all planes in ONE
launch on the current stream: the per-plane base addresses travel as an int64 tensor and are cast to
pointers in the kernel. The product calls it only through ``sgl_remote_kv.kvpool.cuda_ops`` (the KV
writer); ``scatter_reference`` is the torch definition the GPU suite compares it with.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def scatter_reference(src: torch.Tensor, pool: list[torch.Tensor], slots: torch.Tensor) -> None:
    """pool[layer][slots[t]] = src[layer, t] for every layer."""
    for layer, dst in enumerate(pool):
        dst[slots] = src[layer].to(dst.dtype)


_TL_TYPES = {}
if triton is not None:
    _TL_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

    @triton.jit
    def _scatter_kernel(src_ptr, base_ptrs, slots_ptr, T, ROW, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        layer = tl.program_id(0)
        t = tl.program_id(1)
        rb = tl.program_id(2)
        offs = rb * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ROW
        slot = tl.load(slots_ptr + t).to(tl.int64)
        x = tl.load(src_ptr + (layer * T + t).to(tl.int64) * ROW + offs, mask=mask)
        base = tl.load(base_ptrs + layer).to(tl.pointer_type(ELEM))
        tl.store(base + slot * ROW + offs, x.to(ELEM), mask=mask)


def scatter_triton(
    src: torch.Tensor,
    pool: list[torch.Tensor],
    slots: torch.Tensor,
    block: int = 256,
    bases: torch.Tensor | None = None,
) -> None:
    """One Triton launch over (plane, token, row block). ``bases``: the planes' ``data_ptr()`` as an
    int64 tensor on ``src``'s device (built here when None: a small blocking H2D copy)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    layers, t = src.shape[:2]
    row = src[0, 0].numel()
    if len(pool) != layers:
        raise ValueError(f"{len(pool)} pool layers for {layers} source layers")
    dtype = pool[0].dtype
    for p in pool:
        if p.dtype != dtype or not p.is_contiguous() or p[0].numel() != row:
            raise ValueError("pool tensors must share dtype, be contiguous and match [heads, dim]")
    if bases is None:
        bases = torch.tensor([p.data_ptr() for p in pool], dtype=torch.int64, device=src.device)
    grid = (layers, t, triton.cdiv(row, block))
    _scatter_kernel[grid](
        src.contiguous(), bases, slots.to(torch.int64), t, row, ELEM=_TL_TYPES[dtype], BLOCK=block
    )
