"""What ``DeviceKVWriter`` needs from a device: ``cuda_ops.CudaOps`` on CUDA, ``tests/strict_device.py``'s
strict CPU double in CI (it enforces CUDA's rules on the same calls)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class DeviceOps(Protocol):
    """What ``DeviceKVWriter`` needs from a device. Every method but ``stream_wait`` and ``gather`` acts
    on the ops' own side stream; events are opaque."""

    def pin(self, array: np.ndarray) -> bool: ...  # register host memory; False if it cannot be pinned
    def unpin(self, array: np.ndarray) -> None: ...
    def pinned_empty(self, nbytes: int) -> torch.Tensor: ...  # uint8 host tensor in pinned memory
    def device_empty(self, nbytes: int) -> torch.Tensor: ...  # uint8 device tensor
    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # async H2D, same dtype/shape
    def scatter(self, src: torch.Tensor, planes: list[torch.Tensor], slots: torch.Tensor) -> None: ...
    def record(self) -> object: ...  # an event after everything enqueued so far
    def query(self, event: object) -> bool: ...  # completed?
    def wait(self, event: object, timeout_s: float) -> bool: ...  # the host waits; False: not done in time
    def stream_wait(self, event: object) -> None: ...  # the calling thread's current stream waits
    def record_current(self) -> object: ...  # an event on the calling thread's current stream
    def side_wait(self, event: object) -> None: ...  # the side stream waits for ``event``
    # per plane: the rows at ``slots`` (device int64) into ``out[i]`` (pinned host), async D2H
    def gather_into(self, planes: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None: ...
    def dequant(self, codes, scales, m: int, cs, out: torch.Tensor) -> None: ...  # kernels/dequant.py
    # the write-back's device encode: the rows at ``slots`` of one layer's planes, quantized
    # (kernels/quantize.py), results into ``out`` (a ``LayerCodes`` of pinned host tensors), async D2H
    def quantize_into(
        self, k_plane, v_plane, slots, m_k: int, m_v: int, groups: int, chunk: int, channel_scale: bool, out
    ) -> None: ...
    # the transform codec's (kernels/transform_encode.py): ``params`` = (first position, sinks, chunk, trellis,
    # escape capacity); results into ``out`` (a ``CodedLayer`` of pinned host tensors), async D2H
    def transform_encode_into(
        self, k_plane, v_plane, slots, consts, cos, sin, style: int, params: tuple, out
    ) -> None: ...
    def constant(self, array: np.ndarray) -> torch.Tensor: ...  # a device copy, complete on return
    # kernels/transform.py ``inverse_chunks``: N chunks of one layer and equal length (lists of their
    # ``sym``, ``esc``, ``scales``, ``sinks``; RoPE tables of their tokens), escapes resolved (with ``trellis``,
    # the k replayed into codes), one inverse transform into ``out`` [2, N*t, C], sinks put over it
    def inverse_transform(
        self,
        syms: list,
        escs: list,
        scales: list,
        coss: list,
        sins: list,
        consts,
        head_dim: int,
        style: int,
        sinks: list,
        out: torch.Tensor,
        trellis: bool = False,
    ) -> None: ...
