"""``DeviceOps`` on CUDA (torch.cuda + the Triton scatter of ``sgl_remote_kv.kernels.scatter``).

One side stream per writer; every copy and scatter is enqueued on it, so the forward pass's stream is
never blocked by a fetch. Host regions are pinned in place with ``cudaHostRegister`` (through torch's
cudart bindings, through ``host_pin``: registrations are counted per range and a failure's error is cleared),
so H2D copies out of the DPU destination region are real async DMA; anything else is staged through
pinned memory by the writer.

``tests/test_gpu_kv_writer.py`` and ``tests/test_gpu_faults.py`` (``pytest -m gpu``, ``scripts/gpu_check.sh``;
passed on an H200, docs/HARDWARE.md) exercise it against a real SGLang ``MHATokenToKVPool`` on CUDA.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sgl_remote_kv.kernels.dequant import dequant_triton
from sgl_remote_kv.kernels.quantize import quantize_layer_device
from sgl_remote_kv.kernels.scatter import scatter_triton
from sgl_remote_kv.kernels.transform import inverse_chunks, inverse_triton
from sgl_remote_kv.kernels.transform_encode import encode_layer_device, trellis_search_triton

from .host_pin import cuda_pinner
from .readback import copy_coded_layer, copy_layer_codes
from .sinks import put_sinks


class CudaOps:
    """See module docstring. Threads: callers serialise (the writer's lock)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._bases: dict[tuple[int, ...], torch.Tensor] = {}  # plane pointers, cached on the device

    def _here(self) -> None:
        """Make the pool's GPU the calling thread's device (receiver and decoder threads start on device
        0: a stream context switching back to it would create a context there on every other rank)."""
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def pin(self, array: np.ndarray) -> bool:
        self._here()
        return cuda_pinner().pin(array.__array_interface__["data"][0], array.nbytes)

    def unpin(self, array: np.ndarray) -> None:
        self._here()
        cuda_pinner().unpin(array.__array_interface__["data"][0], array.nbytes)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, nbytes: int) -> torch.Tensor:
        self._here()
        with torch.cuda.stream(self.stream):  # allocated on the stream that uses it
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._here()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def scatter(self, src: torch.Tensor, planes: list[torch.Tensor], slots: torch.Tensor) -> None:
        key = tuple(p.data_ptr() for p in planes)
        self._here()
        with torch.cuda.stream(self.stream):
            bases = self._bases.get(key)
            if bases is None:
                bases = torch.tensor(key, dtype=torch.int64).to(self.device, non_blocking=False)
                self._bases[key] = bases
            scatter_triton(src, planes, slots, bases=bases)

    def dequant(self, codes, scales, m: int, cs, out: torch.Tensor) -> None:
        self._here()
        with torch.cuda.stream(self.stream):
            dequant_triton(codes, scales, m, cs, out.dtype, out=out)

    def quantize_into(
        self, k_plane, v_plane, slots, m_k: int, m_v: int, groups: int, chunk: int, channel_scale: bool, out
    ) -> None:
        self._here()
        with torch.cuda.stream(self.stream):  # temporaries allocated here: freed in this stream's order
            r = quantize_layer_device(
                k_plane.index_select(0, slots),
                v_plane.index_select(0, slots),
                m_k,
                m_v,
                groups,
                chunk,
                channel_scale,
            )
            copy_layer_codes(r, out)

    def transform_encode_into(
        self, k_plane, v_plane, slots, consts, cos, sin, style: int, params: tuple, out
    ) -> None:
        self._here()
        with torch.cuda.stream(self.stream):  # temporaries allocated here: freed in this stream's order
            r = encode_layer_device(
                k_plane.index_select(0, slots),
                v_plane.index_select(0, slots),
                consts,
                cos,
                sin,
                style,
                *params,
                search=trellis_search_triton,  # one launch, not a few hundred per token
            )
            copy_coded_layer(r, out)

    def constant(self, array: np.ndarray) -> torch.Tensor:
        self._here()
        with torch.cuda.stream(self.stream):  # allocated and copied on the stream that reads it
            return torch.from_numpy(np.array(array)).to(self.device, non_blocking=False)  # a writable copy

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
    ) -> None:
        self._here()
        with torch.cuda.stream(self.stream):  # work arrays are allocated on this stream: freed in its order
            inverse_chunks(
                syms, escs, scales, coss, sins, consts, head_dim, style, out, trellis, inverse_triton
            )
            put_sinks(sinks, out)

    def record(self) -> torch.cuda.Event:
        self._here()
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def wait(self, event: torch.cuda.Event, timeout_s: float) -> bool:
        """Polls with a backoff (20 us doubling to 1 ms): a device write takes microseconds to a few
        milliseconds, and a blocking ``synchronize`` could not give up on a wedged device."""
        deadline, pause = time.monotonic() + timeout_s, 2e-5
        while not event.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def stream_wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def record_current(self) -> torch.cuda.Event:
        self._here()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def side_wait(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def gather_into(self, planes: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
        self._here()
        with torch.cuda.stream(self.stream):  # one plane's slice at a time on the device
            for i, p in enumerate(planes):
                out[i].copy_(p.index_select(0, slots), non_blocking=True)
