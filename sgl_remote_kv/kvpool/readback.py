"""Reading KV out of the pool for the write-back without blocking the caller (``KVWriter.read_later``).

The write-back copies a request's new chunks out of the pool on the scheduler thread, right after SGLang
inserted them (the slots may be reused once the scheduler moves on). On a device pool a synchronous
gather would hold the slice twice in device memory outside SGLang's budget (gather + stack) and block
the scheduler thread on a D2H copy into pageable memory. ``device_read_later`` instead enqueues, on the
writer's side stream:

1. a wait for the caller's current stream (the forward pass that computed the KV) and, being the side
   stream, after every fetched write already enqueued there;
2. per layer plane, an index-select of the slots and an async D2H copy into one pinned host buffer (the
   device holds one plane's slice at a time, freed in stream order);
3. an event; the caller's current stream then waits on it, so no later kernel there (a forward pass
   writing slots the tree freed meanwhile) runs before the copy read them.

It returns at once. ``PendingRead.result()`` (the write-back worker thread) waits for the event, bounded
by the writer's timeout, and returns ``[L, T, H, D]`` views of the pinned buffer in the storage dtype.

Buffers: the ``PendingRead`` owns the pinned buffer; its views stay valid while the caller holds them.
"""

from __future__ import annotations

import torch

from .writer import TORCH_DTYPES, PendingRead


def device_read_later(writer, slots: torch.Tensor) -> PendingRead:
    """See module docstring. ``writer``: a ``DeviceKVWriter`` (its lock is taken here)."""
    lay, ops = writer.layout, writer.ops
    idx = slots.to("cpu", torch.int64).contiguous()
    t, n = idx.numel(), lay.num_layers
    row = lay.num_kv_heads * lay.head_dim
    dtype = TORCH_DTYPES[lay.dtype]
    with writer._lock:
        out = ops.pinned_empty(2 * n * t * row * writer.storage.itemsize)
        planes_out = out.view(dtype).view(2 * n, t, lay.num_kv_heads, lay.head_dim)
        host_idx = ops.pinned_empty(t * 8)
        host_idx.view(torch.int64).copy_(idx)
        d_idx = ops.device_empty(t * 8)
        ops.side_wait(ops.record_current())  # after the forward pass that computed the KV
        ops.upload(d_idx, host_idx)
        ops.gather_into([*writer.pool.k, *writer.pool.v], d_idx.view(torch.int64), planes_out)
        done = ops.record()
        ops.stream_wait(done)  # the caller's stream: no slot is rewritten before the copy read it
    host = out.numpy().view(writer.storage).reshape(2 * n, t, lay.num_kv_heads, lay.head_dim)
    return PendingRead(host[:n], host[n:], lambda: writer._wait_host(done))
