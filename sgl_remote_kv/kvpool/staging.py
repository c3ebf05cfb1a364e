"""The device writer's staging buffers: one grow-only pinned host buffer and one device buffer.

A write stages what it uploads at an offset of both buffers. Outside a batch every write starts at
offset 0: the writer waits for each write before the next, so reuse is safe. In a batch
(``DeviceKVWriter.write_quantized_layers``: the layers of one install, waited for once) each write starts
after the bytes of the previous one (64-byte aligned), so work already enqueued on the stream never
sees its staging overwritten; once a batch has used ``batch_bytes`` the writer waits for what it
enqueued and the offsets restart (``restart``). A buffer that must grow is replaced: work enqueued on the
old one keeps it alive (torch frees device memory in stream order and pinned host memory after the
copies recorded on it), unless a timed-out write may still use it (``late_pending``): then growing is
refused and the write fails.

Threads: the writer's lock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .arena import align
from .writer import KVWriteError

BATCH_BYTES = 256 << 20  # staging one batch may use before the writer waits for it


class Staging:
    """See module docstring."""

    def __init__(self, ops, late_pending: Callable[[], bool], batch_bytes: int = BATCH_BYTES) -> None:
        self.ops, self.late_pending, self.batch_bytes = ops, late_pending, batch_bytes
        self._host = ops.pinned_empty(0)
        self._dev = ops.device_empty(0)
        self.base = 0  # where the current write's bytes start (0 outside a batch)
        self._used = 0  # bytes the current write took at ``base``

    def host(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host staging for the current write (its first bytes, at ``base``)."""
        if self._host.numel() < self.base + nbytes:
            self._host = self.ops.pinned_empty(_grow(self.base + nbytes))
        self._used = max(self._used, nbytes)
        return self._host[self.base : self.base + nbytes]

    def device(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device staging for the current write (at ``base``)."""
        if self._dev.numel() < self.base + nbytes:
            if self.late_pending():  # a timed-out copy may still land in the old buffer: never free it
                raise KVWriteError("device writes still pending after a timeout; not growing staging")
            self._dev = self.ops.device_empty(_grow(self.base + nbytes))
        self._used = max(self._used, nbytes)
        return self._dev[self.base : self.base + nbytes]

    def next_write(self, batch: bool) -> bool:
        """The current write is enqueued: in a batch the next one starts after it. True when the batch
        has used ``batch_bytes`` (the caller waits for it, then ``restart``)."""
        if batch:
            self.base = align(self.base + self._used)
        self._used = 0
        return self.base >= self.batch_bytes

    def restart(self) -> None:
        self.base, self._used = 0, 0


def _grow(nbytes: int) -> int:
    return max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
