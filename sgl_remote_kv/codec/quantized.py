"""What a device quantized for the write-back, once copied to host memory: ``QuantizedChunks``
(``kernels/quantize.py``, the ``quant_*`` codecs) and ``TransformCodes`` (``kernels/transform_encode.py``).

``QuantizedChunks.layer_parts`` gives each chunk's decoded-layer buffer (``codec.quant``'s layout) in the three
parts the entropy stages take, so ``QuantCodec.encode_quantized`` makes the same bytes a host encode makes;
``TransformCodes.layer_parts`` gives a transform-coded layer's prefix and symbols, which
``TransformCodec.encode_quantized`` entropy-codes as its host encode does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgl_remote_kv.codec import transform_ops as ops
from sgl_remote_kv.codec.quant import PRELUDE, QuantSpec


@dataclass(frozen=True)
class QuantizedChunks:
    """What a device quantized (``kernels/quantize.py``), copied to host memory: ``n`` chunks of ``chunk``
    tokens, every layer (``T = n * chunk``, ``C = H * D``). The arrays are views of the read's pinned
    buffer, owned by whoever holds this."""

    chunk: int
    codes: np.ndarray  # [L, 2, T, C] uint8
    amax: np.ndarray  # [L, 2, T, G] float32, rounded to each chunk's scale dtype
    f16: np.ndarray  # [L, n] uint8: the chunk's scales are fp16
    finite: np.ndarray  # [L, n] uint8
    cs: np.ndarray | None  # [L, n, C] float32, or None

    def layer_parts(self, spec: QuantSpec, layer: int, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``j``'s decoded-layer buffer of ``layer`` as (prelude + scales [+ channel scales], K codes,
        V codes): ``quantize_layer``'s bytes, split where its entropy stages split them. ``ValueError``
        for a chunk with non-finite values (as the host encode)."""
        if not self.finite[layer, j]:
            raise ValueError(f"layer {layer}: non-finite KV values")
        rows = slice(j * self.chunk, (j + 1) * self.chunk)
        sdt = np.float16 if self.f16[layer, j] else np.float32
        mk, mv = spec.levels(layer)
        head = [
            np.frombuffer(
                PRELUDE.pack(int(sdt == np.float32), int(spec.k_channel_scale), mk, mv, 0), np.uint8
            ),
            self.amax[layer, 0, rows].reshape(-1).astype(sdt).view(np.uint8),
            self.amax[layer, 1, rows].reshape(-1).astype(sdt).view(np.uint8),
        ]
        if self.cs is not None:
            head.append(self.cs[layer, j].astype(sdt).view(np.uint8))
        return (
            np.concatenate(head),
            self.codes[layer, 0, rows].reshape(-1),
            self.codes[layer, 1, rows].reshape(-1),
        )


@dataclass(frozen=True)
class TransformEncodeSpec:
    """What the device encode of the transform codec needs (``TransformCodec.device_encode_spec``): the codec and
    the head groups of this rank (``group``, ``groups``)."""

    codec: object
    group: int
    groups: int


@dataclass(frozen=True)
class TransformCodes:
    """What a device coded for the transform codec (``kernels/transform_encode.py``), copied to host memory:
    ``n`` chunks of ``chunk`` tokens at positions ``start..`` (``C = H * D``), every layer; the arrays are views
    of the read's pinned buffer. ``sinks``: the raw rows of the read's first ``sinks.shape[2]`` tokens (the
    positions the codec stores exactly), in the storage dtype."""

    chunk: int
    start: int
    sym: np.ndarray  # [L, 2, n, C, T] uint8
    esc: np.ndarray  # [L, 2, n, cap] int16
    nesc: np.ndarray  # [L, 2, n] int32
    rms: np.ndarray  # [L, 2, n, T] float32
    e: np.ndarray  # [L, 2, n, T] uint8
    base: np.ndarray  # [L, 2, n] float32
    fmt: np.ndarray  # [L, n] uint8
    bad: np.ndarray  # [L, n] uint8
    sinks: np.ndarray  # [L, 2, S, H, D] storage dtype

    def layer_parts(
        self, pre, layer: int, j: int, n_sink: int, group: int
    ) -> tuple[bytes, np.ndarray, np.ndarray]:
        """Chunk ``j``'s section of ``layer`` before its lossless stage: (prefix, K symbols [C, T], V symbols),
        ``pre`` the codec's section header. ``ValueError`` for a chunk the device could not code (as a host
        encode that fails)."""
        if self.bad[layer, j] or (self.nesc[layer, :, j] > self.esc.shape[-1]).any():
            raise ValueError(f"layer {layer}: KV too far from the calibration to encode")
        fmt, t_n = int(self.fmt[layer, j]), self.chunk
        if fmt == ops.SCALE_LOG8:
            scales = [self.base[layer, :, j].astype(np.float32), self.e[layer, 0, j], self.e[layer, 1, j]]
        else:
            dt = np.float16 if fmt == ops.SCALE_FP16 else np.float32
            scales = [self.rms[layer, kv, j].astype(dt) for kv in range(2)]
        esc = [self.esc[layer, kv, j, : self.nesc[layer, kv, j]] for kv in range(2)]
        rows = slice(j * t_n, j * t_n + n_sink)
        c_n = self.sym.shape[3]
        head = pre.pack(self.start + j * t_n, t_n, c_n, fmt, n_sink, layer, group, esc[0].size, esc[1].size)
        exact = [np.ascontiguousarray(self.sinks[layer, kv, rows]).tobytes() for kv in range(2)]
        prefix = b"".join([head, *(a.tobytes() for a in scales), *(a.tobytes() for a in esc), *exact])
        return prefix, self.sym[layer, 0, j], self.sym[layer, 1, j]
