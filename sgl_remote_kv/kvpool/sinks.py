"""The transform codec's exact sink tokens over a device write's output (``DeviceOps.inverse_transform``'s last
step, here in ``kvpool``: the package's only in-place writes of KV are the pool writer's)."""

from __future__ import annotations

import torch


def put_sinks(sinks: list, out: torch.Tensor) -> None:
    """Chunk i's sink rows ``sinks[i]`` [2, S, C * itemsize] (raw bytes; S may be 0) over the first S of its
    tokens in ``out`` [2, N*T, C] (chunks of T tokens, in order), on the caller's stream."""
    t = out.shape[1] // max(len(sinks), 1)
    for i, sk in enumerate(sinks):
        if sk.shape[1]:
            out[:, i * t : i * t + sk.shape[1]].view(torch.uint8).copy_(sk)
