"""KV writer for device (GPU) pools, written against a narrow ``DeviceOps`` interface.

``cuda_ops.CudaOps`` implements ``DeviceOps`` with torch.cuda + the Triton scatter; the test suite's
strict CPU double implements the same interface and *enforces* what CUDA enforces (no host tensor written
into device memory without an explicit copy, no read of a layer before its completion event), so this
file's logic runs in CI exactly as it runs on a GPU.

One ``write`` of ``n`` layers:
1. host source: zero-copy when ``k`` and ``v`` lie in a registered (pinned) region (the DPU destination
   region, ``register_host``), whole or as contiguous layer planes (one upload per layer then); otherwise
   copied into a grow-only pinned staging buffer;
2. H2D copies of K, V and the slots into a grow-only device staging buffer, on the side stream;
3. ONE scatter launch for all ``2n`` layer planes (K then V) into the paged pool, on the side stream;
4. one event recorded after it, which becomes the completion event of each of the ``n`` layers;
5. the calling thread waits (polling, bounded by ``timeout_s``) until the event completed: only then is
   the source reusable and may the caller mark the layers written. Errors and timeouts raise.
Readers on other streams still wait on the event (``wait_layer``/``fence``): the ordering does not rely on
the host having observed completion, and after a timed-out write a fence keeps later users of the slots
ordered behind the late scatter.

Buffers: the staging buffers are owned by the writer and reused under its lock; registered host regions
stay owned by their creator, which must ``unregister_host`` before unmapping.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from sgl_remote_kv.codec import quant
from sgl_remote_kv.codec.transform_ops import rope_tables
from sgl_remote_kv.types import KVLayout

from .arena import align
from .device_ops import DeviceOps
from .readback import (
    PendingCodes,
    PendingRead,
    device_read_later,
    device_read_quantized_later,
    device_read_transformed_later,
)
from .staging import Staging
from .upload import upload_parts
from .writer import DEFAULT_TIMEOUT_S, TORCH_DTYPES, KVWriteError, KVWriter, PoolTensors

MAX_TOKENS = 16384  # tokens per scatter launch (the kernel's grid axis y is capped at 65535)
MAX_PIECE_BYTES = 64 << 20  # K+V bytes per piece: bounds the pinned and device staging buffers
# chunk positions whose device RoPE tables are kept (a 256K-token context of 256-token chunks)
ROPE_TABLES = 1024

logger = logging.getLogger(__name__)
# transform-codec constant sets kept per layer (decode and encode, a calibration and quality or two)
CONSTS_PER_LAYER = 8


class DeviceKVWriter(KVWriter):
    """See module docstring."""

    device_dequant = True

    def __init__(
        self, pool: PoolTensors, layout: KVLayout, ops: DeviceOps, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        super().__init__(pool, layout, timeout_s)
        self.ops = ops
        self.torch_dtype = TORCH_DTYPES[layout.dtype]
        self._regions: list[tuple[int, int, np.ndarray]] = []  # (start, end, array) pinned in place
        self.staging = Staging(ops, self._late_pending)
        self._batch: list | None = None  # events of a write_quantized_layers batch not waited for yet
        self._layer_events: dict[int, object] = {}  # layer -> event of its last write
        self._late: list[object] = []  # events of timed-out writes (fenced until they complete)
        self._late_lock = threading.Lock()  # not the write lock: fence() must not wait for a write
        self._consts: dict[tuple, object] = {}  # (calibration, quality, layer, group) -> TransformConsts
        self._rope_tables: dict[tuple, tuple] = {}  # (rope, start, tokens) -> device (cos, sin), oldest first
        self.stats = {
            "writes": 0,
            "zero_copy": 0,
            "staged": 0,
            "timeouts": 0,
            "device_dequant": 0,
            "device_encode": 0,
        }
        self.stats["zero_copy_parts"] = 0  # codes uploaded from the pinned region where they lie

    # ---- host regions ------------------------------------------------------------------------------
    def register_host(self, array: np.ndarray) -> None:
        if self.ops.pin(array):
            start = array.__array_interface__["data"][0]
            self._regions.append((start, start + array.nbytes, array))
        else:
            logger.debug("a %d-byte host region is not pinned; KV writes from it are staged", array.nbytes)

    def unregister_host(self, array: np.ndarray) -> None:
        with self._lock:
            self.fence_host()
            for reg in list(self._regions):
                if reg[2] is array:
                    self.ops.unpin(array)
                    self._regions.remove(reg)

    def region_of(self, a: np.ndarray) -> tuple[int, int, np.ndarray] | None:
        """The registered (pinned) region ``(start, end, array)`` that holds all of ``a``, if any."""
        lo = a.__array_interface__["data"][0]
        if a.flags.c_contiguous:
            for reg in self._regions:
                if reg[0] <= lo and lo + a.nbytes <= reg[1]:
                    return reg
        return None

    def _pinned(self, a: np.ndarray) -> bool:
        return self.region_of(a) is not None

    def _pinned_planes(self, a: np.ndarray) -> bool:
        """``a`` [n, t, H, D] is pinned in place, whole or as n contiguous layer planes (a token range of
        a round: ``round_io`` writes chunks of a round as they arrive)."""
        return self._pinned(a) or (len(a) > 0 and all(self._pinned(p) for p in a))

    # ---- write ---------------------------------------------------------------------------------------
    def _write(self, k: np.ndarray, v: np.ndarray, slots: torch.Tensor, layer_lo: int) -> None:
        """In bounded pieces: at most ``MAX_TOKENS`` tokens (the scatter's grid) and about
        ``MAX_PIECE_BYTES`` per piece (the staging buffers stay small), each waited for in turn."""
        n, t = k.shape[:2]
        layer_bytes = 2 * (k[0].nbytes // max(t, 1)) * min(t, MAX_TOKENS)
        layers = max(1, min(n, MAX_PIECE_BYTES // max(layer_bytes, 1)))
        for t0 in range(0, t, MAX_TOKENS):
            for l0 in range(0, n, layers):
                kp, vp = k[l0 : l0 + layers, t0 : t0 + MAX_TOKENS], v[l0 : l0 + layers, t0 : t0 + MAX_TOKENS]
                self._write_piece(kp, vp, slots[t0 : t0 + MAX_TOKENS], layer_lo + l0)

    def _write_piece(self, k: np.ndarray, v: np.ndarray, slots: torch.Tensor, layer_lo: int) -> None:
        n, t = k.shape[:2]
        plane = k[0].nbytes if n else 0
        idx = slots.to("cpu", torch.int64).contiguous()
        kv_bytes, slot_bytes = 2 * n * plane, idx.numel() * 8
        so = align(kv_bytes)  # the slots' offset (an int64 view needs an aligned offset)
        dev = self.staging.device(so + slot_bytes)
        if self._pinned_planes(k) and self._pinned_planes(v):
            self.stats["zero_copy"] += 1
            for src, at in ((k, 0), (v, kv_bytes // 2)):  # one upload, or one per layer of a strided source
                parts = [src] if src.flags.c_contiguous else list(src)
                for i, part in enumerate(parts):
                    o = at + i * part.nbytes
                    self.ops.upload(dev[o : o + part.nbytes], _bytes(torch.from_numpy(part)))
            host_slots = self.staging.host(slot_bytes)
            host_slots.view(torch.int64).copy_(idx)
            self.ops.upload(dev[so : so + slot_bytes], host_slots)
        else:
            self.stats["staged"] += 1
            host = self.staging.host(so + slot_bytes)
            hn = host.numpy()
            hn[: kv_bytes // 2].view(self.storage).reshape(k.shape)[...] = k
            hn[kv_bytes // 2 : kv_bytes].view(self.storage).reshape(v.shape)[...] = v
            hn[so:].view(np.int64)[...] = idx.numpy()
            self.ops.upload(dev[: so + slot_bytes], host)
        src = dev[:kv_bytes].view(self.torch_dtype).view(2 * n, t, self.layout.num_kv_heads, -1)
        planes = [*self.pool.k[layer_lo : layer_lo + n], *self.pool.v[layer_lo : layer_lo + n]]
        self.ops.scatter(src, planes, dev[so : so + slot_bytes].view(torch.int64))
        self._complete(list(range(layer_lo, layer_lo + n)), f"KV write of layers {layer_lo}..{layer_lo + n}")

    def write_quantized_layers(self, views_by_layer, slots: torch.Tensor) -> None:
        """One batch (``staging.py``): every layer enqueued behind the previous one, one host wait at the
        end (or whenever the batch's staging is used up) instead of one per layer."""
        slots = slots.to("cpu", torch.int64)
        for layer, views in enumerate(views_by_layer):
            self._check_quantized(views, slots, layer)
        with self._lock:
            self._batch = []
            try:
                for layer, views in enumerate(views_by_layer):
                    self._write_quantized(views, slots, layer)
                if self._batch and not self._wait_host(self._batch[-1]):
                    self.stats["timeouts"] += 1
                    raise KVWriteError(f"quantized KV write of {len(views_by_layer)} layers not done in time")
                self._batch = []
            except KVWriteError:
                raise
            except Exception as e:  # any failure of the dequantizing copies is a failed write
                raise KVWriteError(f"quantized KV write of {len(views_by_layer)} layers failed: {e!r}") from e
            finally:
                with self._late_lock:  # a failed batch's work may still run: fenced like a timed-out write
                    self._late.extend(self._batch)
                self._batch = None
                self.staging.restart()

    def _write_quantized(self, views, slots: torch.Tensor, layer: int, window=None) -> None:
        """Codes + scales H2D, dequantized on the device (one launch for V, one for K, or one per chunk
        when keys carry per-chunk channel scales; the transform codec: one call per run of equal chunks),
        one scatter of the layer's K and V (the ``window``'s tokens), one event."""
        t = sum(vw.tokens for vw in views)
        window = (0, t) if window is None else window
        if not isinstance(views[0], quant.LayerView):
            return self._write_transformed(views, slots, layer, window)
        if any(vw.k_out_idx.size for vw in views):  # exact outlier channels: not in the kernel
            return super()._write_quantized(views, slots, layer, window)
        if t > MAX_TOKENS:  # bounded pieces, chunk by chunk
            return self._by_chunk(views, slots, layer, window)
        lay = self.layout
        c = lay.num_kv_heads * lay.head_dim
        cs = [[vw.k_cs] for vw in views] if views[0].k_cs.size else []
        parts = [
            [slots.numpy()],
            *([getattr(vw, f) for vw in views] for f in ("k_codes", "v_codes", "k_scales", "v_scales")),
        ]
        dtypes = [np.int64, np.uint8, np.uint8, np.float32, np.float32, *(np.float32 for _ in cs)]
        out_bytes = 2 * t * c * self.storage.itemsize
        dev, regions, n_in = upload_parts(self, [*parts, *cs], out_bytes, dtypes)
        d_slots, kc, vc, ks, vs = regions[:5]
        out = dev[n_in : n_in + out_bytes].view(self.torch_dtype).view(2, t, c)
        mk, mv = views[0].mk, views[0].mv
        self.ops.dequant(vc, vs, mv, None, out[1])
        if cs:
            lo = 0
            for vw, cs_dev in zip(views, regions[5:], strict=True):
                n = vw.tokens
                self.ops.dequant(kc[lo : lo + n], ks[lo : lo + n], mk, cs_dev, out[0, lo : lo + n])
                lo += n
        else:
            self.ops.dequant(kc, ks, mk, None, out[0])
        self._scatter_layer(out, d_slots, layer, window)
        self._complete([layer], f"quantized KV write of layer {layer}")

    def _write_transformed(self, views, slots: torch.Tensor, layer: int, window: tuple[int, int]) -> None:
        """The transform codec's views: symbols, escapes, scales, RoPE tables and sink tokens H2D, one
        ``inverse_transform`` per run of chunks of one length (a layer's chunks but a shorter tail: one set of
        launches, ``kernels.transform.inverse_chunks``) into the layer's output (a trellis view's k replayed
        there, on the device), one scatter (the ``window``), one event."""
        if sum(vw.tokens for vw in views) > MAX_TOKENS:
            return self._by_chunk(views, slots, layer, window)
        for vw in views:
            if not vw.escapes_consistent():
                raise KVWriteError(f"layer {layer}: a chunk's escape count does not match its symbols")
        codec, lay = views[0].codec, self.layout
        t, c = sum(vw.tokens for vw in views), lay.num_kv_heads * lay.head_dim
        consts = self._transform_consts(codec, layer, views[0].group, views[0].groups)  # may refuse: first
        parts = [[slots.numpy()]]
        for vw in views:  # in the order a staged record holds them (one upload from the arena)
            parts += [[a] for a in (vw.scales, vw.esc, vw.sinks, vw.sym)]
        out_bytes = 2 * t * c * self.storage.itemsize
        dev, regions, n_in = upload_parts(self, parts, out_bytes)
        out = dev[n_in : n_in + out_bytes].view(self.torch_dtype).view(2, t, c)
        lo = 0
        for a, b in _equal_runs(views):  # one call per run of chunks of one length (usually the whole layer)
            run, arrays = views[a:b], [regions[1 + 4 * i : 5 + 4 * i] for i in range(a, b)]
            n = sum(vw.tokens for vw in run)
            tables = [self._rope(codec.cal.rope, vw.start, vw.tokens) for vw in run]  # cached per position
            scales, esc, sinks, sym = (list(f) for f in zip(*arrays, strict=True))  # the upload's order
            cos, sin = ([tb[i] for tb in tables] for i in (0, 1))
            self.ops.inverse_transform(
                sym, esc, scales, cos, sin, consts, lay.head_dim, codec.rope_style, sinks, out[:, lo : lo + n],
                trellis=run[0].trellis,
            )  # fmt: skip
            lo += n
        self._scatter_layer(out, regions[0], layer, window)
        self._complete([layer], f"transform-coded KV write of layer {layer}")

    def _by_chunk(self, views, slots: torch.Tensor, layer: int, window: tuple[int, int]) -> None:
        """One write per chunk that meets ``window`` (its part of the window)."""
        if any(vw.tokens > MAX_TOKENS for vw in views):  # one chunk per launch is the smallest piece
            raise KVWriteError(f"layer {layer}: a chunk of over {MAX_TOKENS} tokens exceeds one scatter")
        a, b = window
        lo = 0
        for vw in views:
            ca, cb = max(a, lo), min(b, lo + vw.tokens)
            if ca < cb:
                self._write_quantized([vw], slots[ca - a : cb - a], layer, (ca - lo, cb - lo))
            lo += vw.tokens

    def _scatter_layer(self, out: torch.Tensor, d_slots: torch.Tensor, layer: int, window) -> None:
        a, b = window
        out = out[:, a:b] if (a, b) != (0, out.shape[1]) else out
        src = out.reshape(2, b - a, self.layout.num_kv_heads, self.layout.head_dim)
        self.ops.scatter(src, [self.pool.k[layer], self.pool.v[layer]], d_slots)
        self.stats["device_dequant"] += 1

    def _rope(self, rope, start: int, tokens: int):
        """Device cos / sin tables of positions ``start..`` (uploaded once per chunk position, then reused by
        every layer and load; at most ``ROPE_TABLES`` kept, the oldest dropped)."""
        key = (rope, start, tokens)
        got = self._rope_tables.pop(key, None)
        if got is None:
            if len(self._rope_tables) >= ROPE_TABLES:
                if self._late_pending():  # a timed-out inverse transform may still read the oldest
                    raise KVWriteError(
                        "device writes still pending after a timeout; not replacing RoPE tables"
                    )
                self._rope_tables.pop(next(iter(self._rope_tables)))
            got = tuple(self.ops.constant(a) for a in rope_tables(rope, start, tokens))
        self._rope_tables[key] = got  # most recent last
        return got

    def _transform_consts(self, codec, layer: int, group: int, n_g: int, encode: bool = False):
        """The transform codec's device constants of ``layer`` (the decode's, or with ``encode`` the write-back
        encode's), uploaded once per calibration and quality."""
        key = (codec.cal.calib_id, codec.quality, layer, group, n_g, encode)
        consts = self._consts.get(key)
        if consts is None:
            if (
                len(self._consts) >= CONSTS_PER_LAYER * self.layout.num_layers
            ):  # another calibration or quality took over
                if self._late_pending():  # a timed-out inverse transform may still read them
                    raise KVWriteError("device writes still pending after a timeout; not replacing constants")
                self._consts.clear()
            build = codec.encode_consts if encode else codec.device_consts
            consts = self._consts[key] = build(layer, group, n_g).to(self.ops.constant)
        return consts

    def _complete(self, layers: list[int], what: str) -> None:
        """Record the write's event for ``layers`` and wait for it (see module docstring, step 5); in a
        batch, wait only when its staging is used up (``staging.py``) or at its end."""
        event = self.ops.record()
        for layer in layers:
            self._layer_events[layer] = event
        self.stats["writes"] += 1
        if self._batch is not None:
            self._batch.append(event)
            if not self.staging.next_write(batch=True):
                return
            self.staging.restart()
            self._batch = []
        else:
            self.staging.next_write(batch=False)
        if not self._wait_host(event):
            self.stats["timeouts"] += 1
            with self._late_lock:
                self._late.append(event)
            raise KVWriteError(f"{what} not done in {self.timeout_s} s")

    def _wait_host(self, event: object) -> bool:
        return self.ops.wait(event, self.timeout_s)

    def _late_pending(self) -> bool:
        """A timed-out write's work may still run on the device (it could still read or write what it was
        given): nothing it uses may be freed."""
        with self._late_lock:
            return any(not self.ops.query(e) for e in self._late)

    # ---- readers ---------------------------------------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        ev = self._layer_events.get(layer)
        if ev is not None:
            self.ops.stream_wait(ev)

    def fence(self) -> None:
        with self._late_lock:
            late = list(self._late)
        events = [*list(self._layer_events.values()), *late]  # snapshot: writers run concurrently
        for ev in {id(e): e for e in events}.values():
            self.ops.stream_wait(ev)
        with self._late_lock:
            self._late = [e for e in self._late if not self.ops.query(e)]

    def fence_host(self) -> None:
        """The host waits until every write issued so far completed (before unpinning its source);
        ``KVWriteError`` if that takes longer than ``timeout_s`` (a wedged device)."""
        with self._late_lock:
            late = list(self._late)
        for ev in [*list(self._layer_events.values()), *late]:
            if not self._wait_host(ev):
                raise KVWriteError(f"device writes not done in {self.timeout_s} s")

    def read_later(self, slots: torch.Tensor) -> PendingRead:
        return device_read_later(self, slots)

    def read_quantized_later(self, slots: torch.Tensor, spec, chunk: int, start: int = 0) -> PendingCodes:
        self.stats["device_encode"] += 1
        if isinstance(spec, quant.QuantSpec):  # a quant_* codec's; else the transform codec's
            return device_read_quantized_later(self, slots, spec, chunk)
        return device_read_transformed_later(self, slots, spec, chunk, start)

    def read(self, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return self.read_later(slots).result()


def _equal_runs(views) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of consecutive views with the same token count."""
    out, a = [], 0
    for i in range(1, len(views) + 1):
        if i == len(views) or views[i].tokens != views[a].tokens:
            out.append((a, i))
            a = i
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
