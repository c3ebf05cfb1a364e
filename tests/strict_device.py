"""A strict CPU double of a CUDA device, for running the device KV writer's code in CI without a GPU.

It enforces the rules CUDA enforces and that a CPU pool silently forgives:

- **Device memory is not host memory.** Pool planes and device buffers are ``DeviceTensor`` s
  (``is_cuda`` is True, ``device`` is ``cuda:0``). Writing a non-scalar host tensor into one (``t[i] = h``,
  ``index_put_``, ``index_copy_``, ...) raises like CUDA's "Expected all tensors to be on the same
  device"; so does any other op mixing the two, except the explicit transfers ``copy_``/``to``/``cpu``.
  ``numpy()`` on a device tensor raises as on CUDA.
- **Only the side stream writes the pool.** A pool plane written by anything but ``StrictDevice``'s
  stream (e.g. a direct write from a receiver thread) raises ``UnorderedWrite``.
- **No read before the completion event.** Work enqueued on the stream runs later, on the stream's own
  thread (after ``delay_s``), in order. A write to a plane is *pending* until the reader has either
  waited on an event recorded after it (``stream_wait``, per reading thread) or the host saw such an
  event complete (``query``). Reading a plane (any torch op on it, ``get_key_buffer``) while a write to
  it is pending raises ``UnfencedRead``.
- **Async copies read their source late.** An H2D copy reads the host source when the stream runs it,
  so a writer that reuses its source before the copy completed writes wrong KV (tests catch it).

- **Errors are sticky per thread.** Host memory is pinned through the product's ``HostPinner`` over
  ``FakeCudart``, which keeps a per-thread *last error* like the CUDA runtime: a failed registration
  sets it, and the next launch from that thread raises it (torch's launch check), unless the product
  cleared it. Registering a range that is already registered fails as CUDA does.

``hang()`` stops the stream (events never complete) to model a wedged device; ``resume()`` restarts it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import numpy as np
import torch

from sgl_remote_kv.kvpool.host_pin import HostPinner

FAKE_CUDA = torch.device("cuda", 0)
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class FakeCudart:
    """The runtime calls ``HostPinner`` makes, with CUDA's per-thread sticky last error."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.fail_next: int = 0  # the error code the next registration fails with (0: none)
        self._last: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        err, self.fail_next = self.fail_next, 0
        if not err and any(p < ptr + nbytes and ptr < p + n for p, n in self.registered.items()):
            err = ALREADY_REGISTERED
        if err:
            self._last[threading.get_ident()] = err
            return err
        self.registered[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> int:
        return 0 if self.registered.pop(ptr, None) is not None else 1

    def clear_error(self) -> int:
        return self._last.pop(threading.get_ident(), 0)

    def launch_check(self) -> None:
        """What torch does after a launch: ``cudaGetLastError``, raised if set."""
        err = self.clear_error()
        if err:
            raise RuntimeError(f"CUDA error {err} (a launch found an earlier call's uncleared error)")


class UnfencedRead(RuntimeError):
    """A pool plane was read while a write to it had not been fenced for the reader."""


class UnorderedWrite(RuntimeError):
    """A pool plane was written outside the device stream (no completion event covers it)."""


_WRITES = {
    "__setitem__",
    "index_put_",
    "index_put",
    "index_copy_",
    "index_copy",
    "scatter_",
    "masked_scatter_",
    "copy_",
    "fill_",
    "zero_",
    "index_fill_",
    "put_",
    "add_",
    "mul_",
}
_TRANSFERS = {"copy_", "to", "cpu"}
_META = {
    "__get__",
    "size",
    "dim",
    "numel",
    "stride",
    "is_contiguous",
    "data_ptr",
    "element_size",
    "untyped_storage",
    "__len__",
    "storage_offset",
    "view",
    "reshape",
    "as_subclass",
    "__repr__",
    "__format__",
    "__hash__",
}  # (metadata: not reads of the data)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class DeviceTensor(torch.Tensor):
    """A tensor that lives "on the device" of a ``StrictDevice`` (data in CPU memory, rules enforced)."""

    _dev: StrictDevice | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func == torch.Tensor.is_cuda.__get__:
            return True
        if func == torch.Tensor.device.__get__:
            return FAKE_CUDA
        if name == "numpy":
            raise TypeError("can't convert cuda:0 device type tensor to numpy (strict device)")
        dev = next((t._dev for t in _tensors(args) if isinstance(t, DeviceTensor) and t._dev), None)
        if dev is not None and not dev.on_stream():
            dev.check(name, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in ("cpu", "numpy", "tolist", "item") or (name == "to" and _to_host(args, kwargs)):
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return _wrap(out, dev)


def _to_host(args, kwargs) -> bool:
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _wrap(out, dev):
    if isinstance(out, torch.Tensor) and not isinstance(out, DeviceTensor):
        out = out.as_subclass(DeviceTensor)
    if isinstance(out, DeviceTensor):
        out._dev = dev
    elif isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, dev) for o in out)
    return out


class _Event:
    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.done = threading.Event()


class StrictDevice:
    """``DeviceOps`` (see ``sgl_remote_kv.kvpool.device_ops``) on CPU, with CUDA's rules enforced."""

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s = delay_s
        self._seq = itertools.count(1)
        self._q: queue.Queue = queue.Queue()
        self._running = threading.Event()
        self._running.set()
        self._planes: dict[int, int] = {}  # storage ptr -> seq of the last write enqueued
        self._host_fence = 0  # writes up to this seq are complete and seen by the host
        self._thread_fence: dict[int, int] = {}  # reader thread -> seq it waited for
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="strict-device-stream", daemon=True)
        self._stream_thread = self._worker
        self._worker.start()
        self.pinned: list[np.ndarray] = []
        self.cudart = FakeCudart()
        self.pinner = HostPinner(self.cudart)
        self.error: BaseException | None = None
        self._dropping = False

    # ---- allocation ------------------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor) -> DeviceTensor:
        """A device copy of host tensor ``t``."""
        d = t.clone().as_subclass(DeviceTensor)
        d._dev = self
        return d

    def plane(self, shape, dtype) -> DeviceTensor:
        """A pool plane: writes to it must come from the stream and be fenced before reads."""
        p = self.tensor(torch.zeros(shape, dtype=dtype))
        self._planes[_storage(p)] = 0
        return p

    # ---- DeviceOps ---------------------------------------------------------------------------------------
    def pin(self, array: np.ndarray) -> bool:
        if not self.pinner.pin(array.__array_interface__["data"][0], array.nbytes):
            return False
        self.pinned.append(array)
        return True

    def unpin(self, array: np.ndarray) -> None:
        self.pinner.unpin(array.__array_interface__["data"][0], array.nbytes)
        self.pinned = [a for a in self.pinned if a is not array]

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def device_empty(self, nbytes: int) -> DeviceTensor:
        return self.tensor(torch.empty(nbytes, dtype=torch.uint8))

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not isinstance(dst, DeviceTensor) or isinstance(src, DeviceTensor):
            raise RuntimeError("upload is host -> device")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                dst.copy_(src)  # reads the host source now, as an async DMA would

        self._enqueue(run, [])

    def scatter(self, src: torch.Tensor, planes: list[torch.Tensor], slots: torch.Tensor) -> None:
        for t in (src, slots, *planes):
            if not isinstance(t, DeviceTensor):
                raise RuntimeError("scatter operands must all be on the device (strict device)")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                for i, p in enumerate(planes):
                    p[slots] = src[i].to(p.dtype)

        self._enqueue(run, planes)

    def dequant(self, codes, scales, m: int, cs, out: torch.Tensor) -> None:
        from sgl_remote_kv.kernels.dequant import dequant_reference

        for t in (codes, scales, out, *(() if cs is None else (cs,))):
            if not isinstance(t, DeviceTensor):
                raise RuntimeError("dequant operands must all be on the device (strict device)")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                out.copy_(dequant_reference(codes, scales, m, cs, out.dtype))

        self._enqueue(run, [])

    def quantize_into(
        self, k_plane, v_plane, slots, m_k: int, m_v: int, groups: int, chunk: int, channel_scale: bool, out
    ) -> None:
        from sgl_remote_kv.kernels.quantize import quantize_layer_device

        from sgl_remote_kv.kvpool.readback import copy_layer_codes

        for t in (k_plane, v_plane, slots):
            if not isinstance(t, DeviceTensor):
                raise RuntimeError("quantize operands must be on the device (strict device)")
        outs = (out.codes, out.amax, out.f16, out.finite, *(() if out.cs is None else (out.cs,)))
        if any(isinstance(t, DeviceTensor) for t in outs):
            raise RuntimeError("quantize_into copies device -> host (strict device)")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                r = quantize_layer_device(
                    k_plane[slots], v_plane[slots], m_k, m_v, groups, chunk, channel_scale
                )
                copy_layer_codes(r, out)  # written when the stream runs: read only after the event

        self._enqueue(run, [])

    def transform_encode_into(
        self, k_plane, v_plane, slots, consts, cos, sin, style: int, params, out
    ) -> None:
        from sgl_remote_kv.kernels.transform_encode import encode_layer_device

        from sgl_remote_kv.kvpool.readback import copy_coded_layer

        ins = (
            k_plane,
            v_plane,
            slots,
            cos,
            sin,
            consts.mean,
            consts.basis,
            consts.inv_steps,
            consts.steps,
            consts.log8,
        )
        if not all(isinstance(t, DeviceTensor) for t in ins):
            raise RuntimeError("transform encode operands must be on the device (strict device)")
        outs = (out.sym, out.esc, out.nesc, out.rms, out.e, out.base, out.fmt, out.bad)
        if any(isinstance(t, DeviceTensor) for t in outs):
            raise RuntimeError("transform_encode_into copies device -> host (strict device)")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                r = encode_layer_device(k_plane[slots], v_plane[slots], consts, cos, sin, style, *params)
                copy_coded_layer(r, out)  # written when the stream runs: read only after the event

        self._enqueue(run, [])

    def constant(self, array: np.ndarray) -> DeviceTensor:
        return self.tensor(torch.from_numpy(np.array(array)))  # a writable copy

    def inverse_transform(
        self,
        syms,
        escs,
        scales,
        coss,
        sins,
        consts,
        head_dim: int,
        style: int,
        sinks,
        out,
        trellis: bool = False,
    ) -> None:
        from sgl_remote_kv.kernels.transform import inverse_chunks, inverse_reference

        from sgl_remote_kv.kvpool.sinks import put_sinks

        lists = (syms, escs, scales, sinks)
        if len({len(a) for a in lists}) != 1 or not syms or len(coss) not in (1, len(syms)):
            raise ValueError(
                "inverse_transform: one sym, esc, scales and sinks per chunk, RoPE tables of them"
            )
        if len({sym.shape for sym in syms}) != 1:
            raise ValueError("inverse_transform: chunks of one call have the same shape")
        for t in (
            *syms,
            *escs,
            *scales,
            *coss,
            *sins,
            *sinks,
            out,
            consts.steps,
            consts.bt,
            consts.btr,
            consts.mean,
            consts.meanr,
        ):
            if not isinstance(t, DeviceTensor):
                raise RuntimeError("inverse_transform operands must all be on the device (strict device)")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                inverse_chunks(
                    syms, escs, scales, coss, sins, consts, head_dim, style, out, trellis, inverse_reference
                )
                put_sinks(sinks, out)

        self._enqueue(run, [])

    def record(self) -> _Event:
        ev = _Event(next(self._seq))
        self._q.put(("event", ev))
        return ev

    def query(self, ev: _Event) -> bool:
        if self.error is not None:  # like CUDA's sticky errors: every later query reports it
            raise RuntimeError(f"device error: {self.error!r}")
        if ev.done.is_set():
            with self._lock:
                self._host_fence = max(self._host_fence, ev.seq)
            return True
        return False

    def wait(self, ev: _Event, timeout_s: float) -> bool:
        """The host blocks until the stream reached ``ev`` (no polling: the double's device work takes far
        longer than a GPU's, so a poll loop's CPU here would say nothing about the host's on a GPU)."""
        ev.done.wait(timeout_s)
        return self.query(ev)

    def stream_wait(self, ev: _Event) -> None:
        ev.done.wait()  # a CPU "stream" is the calling thread: it proceeds once the event completed
        with self._lock:
            tid = threading.get_ident()
            self._thread_fence[tid] = max(self._thread_fence.get(tid, 0), ev.seq)

    def record_current(self) -> _Event:
        ev = _Event(next(self._seq))  # a CPU "stream" is the calling thread: what it did is done
        ev.done.set()
        return ev

    def side_wait(self, ev: _Event) -> None:
        self._enqueue(ev.done.wait, [])

    def gather_into(self, planes: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
        for t in (slots, *planes):
            if not isinstance(t, DeviceTensor):
                raise RuntimeError("gather operands must be on the device (strict device)")
        if isinstance(out, DeviceTensor):
            raise RuntimeError("gather_into copies device -> host (strict device)")

        def run():
            with torch._C.DisableTorchFunctionSubclass():
                for i, p in enumerate(planes):
                    out[i].copy_(p[slots])  # written when the stream runs: read only after the event

        self._enqueue(run, [])

    # ---- faults ----------------------------------------------------------------------------------------
    def hang(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def reset(self) -> None:
        """Drop the queued work without running it (a device reset after a hang: a late copy out of
        host memory that was unmapped meanwhile must not run)."""
        self._dropping = True
        self._running.set()

    def synchronize(self) -> None:
        ev = self.record()
        while not self.query(ev):
            time.sleep(1e-3)

    def close(self) -> None:
        self.resume()
        self._q.put(None)
        self._worker.join(5)

    # ---- rules --------------------------------------------------------------------------------------------
    def on_stream(self) -> bool:
        return threading.current_thread() is self._stream_thread

    def check(self, name: str, args, kwargs) -> None:
        ts = list(_tensors((args, kwargs)))
        if name in _WRITES:
            target = args[0] if args else None
            vals = list(_tensors((args[1:], kwargs)))
            value = vals[-1] if vals else None
            if (
                name not in _TRANSFERS
                and value is not None
                and value.dim() > 0
                and not (isinstance(value, DeviceTensor))
            ):
                raise RuntimeError(
                    f"{name}: Expected all tensors to be on the same device, but found at least two "
                    "devices, cuda:0 and cpu! (strict device: a host tensor written into device memory)"
                )
            if isinstance(target, DeviceTensor) and _storage(target) in self._planes:
                raise UnorderedWrite(f"{name} into a KV pool plane outside the device stream")
            return
        if name in _META:
            return
        host = [t for t in ts if not isinstance(t, DeviceTensor) and t.dim() > 0]
        if host and name not in _TRANSFERS and name != "__getitem__":  # CPU index tensors are allowed
            raise RuntimeError(f"{name}: tensors on cuda:0 and cpu (strict device)")
        for t in ts:
            if isinstance(t, DeviceTensor):
                self._check_read(t, name)

    def check_read(self, plane: torch.Tensor) -> None:
        """What a reader of ``plane`` (e.g. ``get_key_buffer``) must satisfy."""
        self._check_read(plane, "read")

    def _check_read(self, t: torch.Tensor, name: str) -> None:
        last = self._planes.get(_storage(t))
        if not last:
            return
        with self._lock:
            fence = max(self._host_fence, self._thread_fence.get(threading.get_ident(), 0))
        if last > fence:
            raise UnfencedRead(f"{name} of a KV pool plane before its write's completion event")

    # ---- the stream -------------------------------------------------------------------------------------
    def _enqueue(self, fn, planes) -> None:
        self.cudart.launch_check()
        seq = next(self._seq)
        with self._lock:
            for p in planes:
                self._planes[_storage(p)] = seq
        self._q.put(("op", fn))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._running.wait()
            kind, x = item
            if kind == "op" and self._dropping:
                continue
            if kind == "op":
                time.sleep(self.delay_s)
                try:
                    x()
                except Exception as e:  # a faulting kernel: the device reports it from now on
                    self.error = e
            else:
                x.done.set()


def _storage(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


class StrictKVPool:
    """SGLang's ``MHATokenToKVPool`` surface (``k_buffer``/``v_buffer``, ``get_key_buffer``/
    ``get_value_buffer`` through the layer-transfer counter) over ``StrictDevice`` planes; reads check the
    completion-event rule."""

    def __init__(self, device: StrictDevice, layout, slots: int, dtype: torch.dtype) -> None:
        shape = (slots, layout.num_kv_heads, layout.head_dim)
        self.device = device
        self.dtype = self.store_dtype = dtype
        self.k_buffer = [device.plane(shape, dtype) for _ in range(layout.num_layers)]
        self.v_buffer = [device.plane(shape, dtype) for _ in range(layout.num_layers)]
        self.layer_transfer_counter = None

    def register_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counter = counter

    def _get(self, bufs, layer_id: int):
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)
        self.device.check_read(bufs[layer_id])
        return bufs[layer_id]

    def get_key_buffer(self, layer_id: int):
        return self._get(self.k_buffer, layer_id)

    def get_value_buffer(self, layer_id: int):
        return self._get(self.v_buffer, layer_id)
