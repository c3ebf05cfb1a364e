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

``device_read_quantized_later`` is the same read for a codec that quantizes on the device (the ``quant_*``
codecs, ``codec.device_encode``): in step 2 each layer's slice is quantized on the side stream
(``kernels/quantize.py``) and only its codes, scales and per-chunk flags come back (about half the bytes of
bf16 KV); ``PendingCodes.result()`` returns them as a ``codec.quantized.QuantizedChunks``, and the host is left
with the lossless stage.

``device_read_transformed_later`` is that read for the transform codec (``kernels/transform_encode.py``: RoPE
undone, the forward transform, token scales and the quantizer, ``scalar`` or ``trellis``, on the side stream);
it returns symbols, escapes and scales as a ``codec.quantized.TransformCodes`` (plus the raw rows of the
exact sink positions), about half the bytes of bf16 KV.

Buffers: the ``PendingRead`` owns the pinned buffer; its views stay valid while the caller holds them.
"""

from __future__ import annotations

import math

import torch

from sgl_remote_kv.codec import transform_ops
from sgl_remote_kv.codec.quant import QuantSpec
from sgl_remote_kv.codec.quantized import QuantizedChunks, TransformCodes
from sgl_remote_kv.kernels.quantize import LayerCodes
from sgl_remote_kv.kernels.transform_encode import CodedLayer

from .writer import TORCH_DTYPES, PendingRead


class PendingCodes(PendingRead):
    """A device-quantized read (``QuantizedChunks``), complete once its device event is."""

    def __init__(self, codes: QuantizedChunks, wait) -> None:
        super().__init__(None, None, wait)
        self.codes = codes

    def result(self) -> QuantizedChunks:  # type: ignore[override]
        super().result()
        return self.codes


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


def copy_layer_codes(src: LayerCodes, dst: LayerCodes) -> None:
    """``src``'s tensors into ``dst``'s (same shapes; device -> pinned host: asynchronous on the current
    stream, read only after an event recorded behind it)."""
    pairs = [(src.codes, dst.codes), (src.amax, dst.amax), (src.f16, dst.f16), (src.finite, dst.finite)]
    if src.cs is not None:
        pairs.append((src.cs, dst.cs))
    for a, b in pairs:
        b.copy_(a, non_blocking=True)


def copy_coded_layer(src: CodedLayer, dst: CodedLayer) -> None:
    """``copy_layer_codes`` for the transform codec's ``CodedLayer``."""
    for name in ("sym", "esc", "nesc", "rms", "e", "base", "fmt", "bad"):
        getattr(dst, name).copy_(getattr(src, name), non_blocking=True)


def _carve(ops, shapes: list[tuple[str, tuple, torch.dtype]]) -> dict[str, torch.Tensor]:
    """One pinned buffer holding a view per ``(name, shape, dtype)``, in the order given (widest dtypes first
    keeps every view aligned)."""
    sizes = [math.prod(shape) * torch.empty(0, dtype=dt).element_size() for _, shape, dt in shapes]
    buf = ops.pinned_empty(sum(sizes))
    views, o = {}, 0
    for (name, shape, dt), size in zip(shapes, sizes, strict=True):
        views[name] = buf[o : o + size].view(dt).view(shape)
        o += size
    return views


def device_read_quantized_later(writer, slots: torch.Tensor, spec: QuantSpec, chunk: int) -> PendingCodes:
    """See module docstring: ``slots`` (a multiple of ``chunk`` tokens) quantized per ``spec`` on the device."""
    lay, ops = writer.layout, writer.ops
    idx = slots.to("cpu", torch.int64).contiguous()
    t, n_layers = idx.numel(), lay.num_layers
    c, g, n = lay.num_kv_heads * lay.head_dim, spec.groups(lay.num_kv_heads), idx.numel() // chunk
    # one pinned buffer: the float32 arrays first (aligned), then the bytes
    shapes = [("amax", (n_layers, 2, t, g), torch.float32)]
    if spec.k_channel_scale:
        shapes.append(("cs", (n_layers, n, c), torch.float32))
    shapes += [("codes", (n_layers, 2, t, c), torch.uint8), ("f16", (n_layers, n), torch.bool)]
    shapes.append(("finite", (n_layers, n), torch.bool))
    sizes = [math.prod(shape) * (4 if dt == torch.float32 else 1) for _, shape, dt in shapes]
    with writer._lock:
        buf = ops.pinned_empty(sum(sizes))
        views, o = {}, 0
        for (name, shape, dt), size in zip(shapes, sizes, strict=True):
            views[name] = buf[o : o + size].view(dt).view(shape)
            o += size
        host_idx = ops.pinned_empty(t * 8)
        host_idx.view(torch.int64).copy_(idx)
        d_idx = ops.device_empty(t * 8)
        ops.side_wait(ops.record_current())  # after the forward pass that computed the KV
        ops.upload(d_idx, host_idx)
        for i in range(n_layers):
            m_k, m_v = spec.levels(i)
            cs = views["cs"][i] if "cs" in views else None
            out = LayerCodes(views["codes"][i], views["amax"][i], views["f16"][i], views["finite"][i], cs)
            ops.quantize_into(
                writer.pool.k[i],
                writer.pool.v[i],
                d_idx.view(torch.int64),
                m_k,
                m_v,
                g,
                chunk,
                spec.k_channel_scale,
                out,
            )
        done = ops.record()
        ops.stream_wait(done)  # the caller's stream: no slot is rewritten before the read
    arrays = {name: v.numpy() for name, v in views.items()}
    codes = QuantizedChunks(
        chunk,
        arrays["codes"],
        arrays["amax"],
        arrays["f16"].view("u1"),
        arrays["finite"].view("u1"),
        arrays.get("cs"),
    )
    return PendingCodes(codes, lambda: writer._wait_host(done))


ESCAPES_PER = (
    16  # device escape capacity per chunk and K/V: a value per this many symbols (real KV: up to 1 in 45)
)


def device_read_transformed_later(writer, slots: torch.Tensor, spec, chunk: int, start: int) -> PendingCodes:
    """See module docstring: ``slots`` (a multiple of ``chunk`` tokens, at positions ``start..``) coded on the
    device per ``spec`` (a ``codec.quantized.TransformEncodeSpec``)."""
    lay, ops, codec = writer.layout, writer.ops, spec.codec
    cal = codec.cal
    idx = slots.to("cpu", torch.int64).contiguous()
    t, n_layers = idx.numel(), lay.num_layers
    n, c, h, d = t // chunk, lay.num_kv_heads * lay.head_dim, lay.num_kv_heads, lay.head_dim
    cap = max(1, chunk * c // ESCAPES_PER)
    n_sink = max(0, min(cal.sinks - start, t))
    shapes = [
        ("rms", (n_layers, 2, n, chunk), torch.float32),
        ("base", (n_layers, 2, n), torch.float32),
        ("nesc", (n_layers, 2, n), torch.int32),
        ("sinks", (2 * n_layers, n_sink, h, d), TORCH_DTYPES[lay.dtype]),
        ("esc", (n_layers, 2, n, cap), torch.int16),
        ("sym", (n_layers, 2, n, c, chunk), torch.uint8),
        ("e", (n_layers, 2, n, chunk), torch.uint8),
        ("fmt", (n_layers, n), torch.uint8),
        ("bad", (n_layers, n), torch.bool),
    ]
    with writer._lock:
        views = _carve(ops, shapes)
        host_idx = ops.pinned_empty(t * 8)
        host_idx.view(torch.int64).copy_(idx)
        d_idx = ops.device_empty(t * 8)
        cos, sin = writer._rope(cal.rope, start, t)
        consts = [
            writer._transform_consts(codec, i, spec.group, spec.groups, encode=True) for i in range(n_layers)
        ]
        ops.side_wait(ops.record_current())  # after the forward pass that computed the KV
        ops.upload(d_idx, host_idx)
        if n_sink:  # the exact sink positions' raw rows
            ops.gather_into(
                [*writer.pool.k, *writer.pool.v], d_idx.view(torch.int64)[:n_sink], views["sinks"]
            )
        for i in range(n_layers):
            out = CodedLayer(
                *(views[name][i] for name in ("sym", "esc", "nesc", "rms", "e", "base", "fmt", "bad"))
            )
            ops.transform_encode_into(
                writer.pool.k[i],
                writer.pool.v[i],
                d_idx.view(torch.int64),
                consts[i],
                cos,
                sin,
                transform_ops.rope_style(cal.rope),
                (start, cal.sinks, chunk, codec.quantizer == "trellis", cap),
                out,
            )
        done = ops.record()
        ops.stream_wait(done)  # the caller's stream: no slot is rewritten before the read
    a = {name: v.numpy() for name, v in views.items() if name != "sinks"}
    sinks = views["sinks"].view(torch.uint8).numpy().view(writer.storage)
    sinks = sinks.reshape(2, n_layers, n_sink, h, d).swapaxes(0, 1)
    codes = TransformCodes(
        chunk,
        start,
        a["sym"],
        a["esc"],
        a["nesc"],
        a["rms"],
        a["e"],
        a["base"],
        a["fmt"],
        a["bad"].view("u1"),
        sinks,
    )
    return PendingCodes(codes, lambda: writer._wait_host(done))
