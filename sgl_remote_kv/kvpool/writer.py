"""The one KV writer: how fetched KV gets into SGLang's paged KV pool, on every path.

Every path that puts fetched KV into the pool (the DPU client's receiver thread, the in-process and
NVDEC installs, layer-wise installs) calls ``KVWriter.write``; the write-back reads through
``KVWriter.read``. Nothing else touches the pool's per-layer tensors (a test greps for it).

Contract of ``write(k, v, slots, layer_lo)``:
- ``k``/``v`` are host numpy arrays ``[n_layers, T, H, D]`` in the layout's storage dtype (bf16 as
  ``uint16`` bits), owned by the caller; ``slots`` (int64, ``T``) are the pool rows of the ``T`` tokens.
  Layers ``layer_lo .. layer_lo + n_layers`` are written. Device slots are copied to the host on the
  calling thread.
- It returns only when the write is *complete*: the caller may reuse the source, and a layer may be
  marked written. Any failure (bad shapes, a device error, a write not finished within ``timeout_s``)
  raises ``KVWriteError`` and the caller must treat the chunks carried as failed (kind ``write``): their
  slots hold garbage.
- Consumers that read the pool from another stream call ``wait_layer(layer)`` (the forward, per layer)
  or ``fence()`` (the scheduler, ``FencedCounter.finish``: before SGLang frees the slots of a load that
  failed, which a timed-out write may still touch): on a device pool these make the reading stream wait on
  the write's completion event (a timed-out write's too); on host pools they are no-ops.

``write_quantized(views, slots, layer)`` is the same contract for one layer given as the codec's
lossless-stage output (``Codec.codes_stage``, one view per chunk, all of one kind: ``quant.LayerView``,
codes + scales, or ``transform.TransformView``, symbols + scales + escapes): a host pool runs the codec's
CPU stage (``view.dequant_into``), a device pool uploads the codes and dequantizes on the device (the
Triton kernels of ``kernels/dequant.py`` and ``kernels/transform.py``), so the in-process path on a GPU
ships ~1 byte per value over PCIe, not 2-4, and the transform codec's inverse transform runs there.

Implementations: ``HostKVWriter`` (CPU pools: single-threaded numpy copies) here, ``DeviceKVWriter``
(device pools: pinned host source, H2D copy on a side stream, one scatter launch per write, an event per
layer) in ``device_writer.py``. ``kvpool.writer_for`` picks one from the pool's device.

Threads: ``write`` may be called from any thread (one lock per writer serialises writes); ``read`` from
the scheduler thread only.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgl_remote_kv.types import KVLayout, numpy_storage_dtype

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_RAW = {torch.bfloat16: torch.int16}  # numpy has no bf16: move raw bits


# A round's scatter takes micro- to milliseconds on a GPU; a write not done after this is a wedged device.
# Below the DPU client's 5 s heartbeat timeout: the receiver thread writes, so a longer stall there would
# also read as a hung data plane.
DEFAULT_TIMEOUT_S = 2.0


class KVWriteError(Exception):
    """A write into the KV pool failed or did not complete in time; its chunks are failed."""


class PendingRead:
    """A read of ``[L, T, H, D]`` K and V: complete (host pools) or waiting on a device event."""

    def __init__(self, k: np.ndarray, v: np.ndarray, wait: Callable[[], bool] | None = None) -> None:
        self._k, self._v, self._wait = k, v, wait

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Raises ``KVWriteError`` when the device copy did not complete within the writer's timeout."""
        if self._wait is not None:
            if not self._wait():
                raise KVWriteError("device read of the write-back's KV not done in time")
            self._wait = None
        return self._k, self._v


@dataclass(frozen=True)
class PoolTensors:
    """The pool's per-layer tensors ``[pool_slots, H, D]`` (SGLang's ``k_buffer``/``v_buffer``)."""

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]


class KVWriter(ABC):
    """See module docstring."""

    device_dequant = False  # write_quantized dequantizes on the device (worth keeping codes staged)

    def __init__(self, pool: PoolTensors, layout: KVLayout, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if len(pool.k) != layout.num_layers or len(pool.v) != layout.num_layers:
            raise ValueError(f"pool has {len(pool.k)}/{len(pool.v)} layers, layout {layout.num_layers}")
        self.pool, self.layout, self.timeout_s = pool, layout, timeout_s
        self.storage = numpy_storage_dtype(layout.dtype)
        self._lock = threading.Lock()
        self.host_dequant_tokens = 0  # tokens x layers this writer dequantized on the host (CPU stage)

    def write(self, k: np.ndarray, v: np.ndarray, slots: torch.Tensor, layer_lo: int = 0) -> None:
        """See module docstring. Raises ``KVWriteError``."""
        slots = slots.to("cpu", torch.int64)  # no copy for host int64 slots
        self._check(k, v, slots, layer_lo)
        try:
            with self._lock:
                self._write(k, v, slots, layer_lo)
        except KVWriteError:
            raise
        except Exception as e:  # any failure of the copy is a failed write, never a hit
            raise KVWriteError(f"KV write of layers {layer_lo}..{layer_lo + k.shape[0]} failed: {e!r}") from e

    def write_quantized(
        self, views: Sequence, slots: torch.Tensor, layer: int, window: tuple[int, int] | None = None
    ) -> None:
        """Layer ``layer`` of consecutive chunks (``views``: their lossless stage's output, tokens in order)
        into ``slots``, dequantized on the pool's side; ``window`` ``(a, b)``: only the views' tokens
        ``a..b`` (all by default) go into the ``b - a`` slots. Same contract as ``write``; raises
        ``KVWriteError``."""
        slots = slots.to("cpu", torch.int64)
        window = self._check_quantized(views, slots, layer, window)
        try:
            with self._lock:
                self._write_quantized(views, slots, layer, window)
        except KVWriteError:
            raise
        except Exception as e:  # any failure of the dequantizing copy is a failed write
            raise KVWriteError(f"quantized KV write of layer {layer} failed: {e!r}") from e

    def write_quantized_layers(self, views_by_layer: Sequence[Sequence], slots: torch.Tensor) -> None:
        """Layers ``0..n-1`` of an install (``views_by_layer[layer]`` as ``write_quantized``'s ``views``)
        into ``slots``: the same contract for all of them (device pools wait once, not per layer)."""
        for layer, views in enumerate(views_by_layer):
            self.write_quantized(views, slots, layer)

    def _check_quantized(
        self, views: Sequence, slots: torch.Tensor, layer: int, window: tuple[int, int] | None = None
    ) -> tuple[int, int]:
        t = sum(vw.tokens for vw in views)
        a, b = (0, t) if window is None else window
        if not 0 <= a < b <= t or slots.ndim != 1 or len(slots) != b - a:
            raise KVWriteError(f"{len(slots)} slots for tokens {a}..{b} of {t} quantized tokens")
        if not 0 <= layer < self.layout.num_layers:
            raise KVWriteError(f"layer {layer} outside the pool")
        self._check_slots(slots)
        return a, b

    def _write_quantized(
        self, views: Sequence, slots: torch.Tensor, layer: int, window: tuple[int, int] | None = None
    ) -> None:
        """The codec's CPU stage, then the plain write of the window (lock held)."""
        lay = self.layout
        t = sum(vw.tokens for vw in views)
        a, b = (0, t) if window is None else window
        k = np.empty((1, t, lay.num_kv_heads, lay.head_dim), self.storage)
        v = np.empty_like(k)
        dequant_views(views, lay.dtype, k[0], v[0])
        self.host_dequant_tokens += t
        self._write(k[:, a:b], v[:, a:b], slots, layer)

    def wait_layer(self, layer: int) -> None:
        """The reading stream waits for the last write of ``layer`` (no-op on host pools)."""
        return None

    def fence(self) -> None:
        """The reading stream waits for every write issued so far (no-op on host pools)."""
        return None

    def register_host(self, array: np.ndarray) -> None:
        """A long-lived host source (the DPU destination region): pin it once (no-op on host pools)."""
        return None

    def unregister_host(self, array: np.ndarray) -> None:
        """Undo ``register_host`` (before the memory is unmapped)."""
        return None

    @abstractmethod
    def read(self, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Copies ``([L, T, H, D], [L, T, H, D])`` of the KV at ``slots``, owned by the caller."""

    def read_later(self, slots: torch.Tensor) -> PendingRead:
        """``read`` that may complete later (``PendingRead.result()`` may wait and raise ``KVWriteError``):
        device pools copy on their side stream (``readback.py``); host pools copy now."""
        return PendingRead(*self.read(slots))

    def read_quantized_later(
        self, slots: torch.Tensor, spec, chunk: int, start: int = 0
    ) -> PendingRead | None:
        """``read_later`` coded on the device for the write-back, per ``spec`` (the codec's ``device_encode_spec``:
        ``readback.device_read_quantized_later``, whose ``result()`` is a ``codec.quantized.QuantizedChunks`` of
        ``chunk``-token chunks, or ``device_read_transformed_later``: ``TransformCodes`` of chunks at positions
        ``start..``); None where the pool is in host memory (the host encodes what ``read_later`` gives)."""
        return None

    @abstractmethod
    def _write(self, k: np.ndarray, v: np.ndarray, slots: torch.Tensor, layer_lo: int) -> None: ...

    def _check(self, k: np.ndarray, v: np.ndarray, slots: torch.Tensor, layer_lo: int) -> None:
        lay = self.layout
        row = (lay.num_kv_heads, lay.head_dim)
        if k.ndim != 4 or k.shape != v.shape or k.shape[2:] != row:
            raise KVWriteError(f"KV source shapes {k.shape}/{v.shape}, expected [n, T, {row[0]}, {row[1]}]")
        if k.dtype != self.storage or v.dtype != self.storage:
            raise KVWriteError(f"KV source dtype {k.dtype}/{v.dtype}, expected {self.storage}")
        if layer_lo < 0 or layer_lo + k.shape[0] > lay.num_layers:
            raise KVWriteError(f"layers {layer_lo}..{layer_lo + k.shape[0]} outside the pool")
        if slots.ndim != 1 or len(slots) != k.shape[1]:
            raise KVWriteError(f"{len(slots)} slots for {k.shape[1]} tokens")
        self._check_slots(slots)

    def _check_slots(self, slots: torch.Tensor) -> None:
        """Every slot is a row of the pool: a device scatter does not bounds-check its indices."""
        rows = self.pool.k[0].shape[0]
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= rows):
            raise KVWriteError(f"slots {int(slots.min())}..{int(slots.max())} outside the pool's {rows} rows")


def dequant_views(views: Sequence, dtype: str, k: np.ndarray, v: np.ndarray) -> None:
    """The codec's CPU stage of consecutive chunks' views into ``k``/``v`` ``[T, H, D]`` (tokens in order)."""
    lo = 0
    for vw in views:
        vw.dequant_into(dtype, k[lo : lo + vw.tokens], v[lo : lo + vw.tokens])
        lo += vw.tokens


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    raw = _RAW.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


class HostKVWriter(KVWriter):
    """CPU pools: numpy fancy-index copies, single-threaded. A torch op here would open a second OpenMP
    team next to the forward pass's on the same cores when called from the DPU receiver thread
    (docs/INTEGRATION.md: layer-wise TTFT 9.7-40 s); numpy copies stay on the calling thread."""

    def _write(self, k: np.ndarray, v: np.ndarray, slots: torch.Tensor, layer_lo: int) -> None:
        idx = slots.numpy()
        for i in range(k.shape[0]):
            for src, layers in ((k, self.pool.k), (v, self.pool.v)):
                dst = layers[layer_lo + i]
                _numpy_view(dst)[idx] = src[i].view(_numpy_view(dst).dtype)

    def read(self, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        idx = slots.to(torch.int64).numpy()
        k = np.stack([_numpy_view(t)[idx] for t in self.pool.k]).view(self.storage)
        v = np.stack([_numpy_view(t)[idx] for t in self.pool.v]).view(self.storage)
        return k, v
