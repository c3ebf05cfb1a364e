"""What a device quantized for the write-back (``kernels/quantize.py``), once copied to host memory.

``layer_parts`` gives each chunk's decoded-layer buffer (``codec.quant``'s layout) in the three parts the
entropy stages take, so ``QuantCodec.encode_quantized`` makes the same bytes a host encode makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
