"""Quantization on the device for the write-back: one layer of whole chunks -> codes, scales, flags.

The device half of ``sgl_remote_kv.codec.quant.quantize_layer`` (vector-wise max-abs, the scalar
quantizer of the ``quant_*`` codecs), in plain torch ops that run on whatever device the pool is on (CUDA in
production, the strict CPU double in CI). Every step is the same IEEE float32 operation in the same order
as the numpy encoder, so the codes and scales are bit-identical to a host encode of the same KV:

- per chunk, ``big`` = the largest |x| over its K and V: scales are stored as fp16 when ``big <= 32752``,
  else fp32 (``f16``); every scale below is rounded to that type before it is used;
- ``channel_scale``: keys divided by their per-(chunk, channel) max-abs (``x * (1 / c)``, 0 where ``c`` is 0);
- per vector (a token, or a token's head with ``groups`` = heads) ``a`` = max-abs,
  ``code = clip(rint(x * (m / a)), -m, m) + m`` (0 where ``a`` is 0), round-half-to-even.

``quantize_layer_device`` returns device tensors; the caller copies them to pinned host memory and the
host assembles each chunk's decoded-layer buffer from them (``codec.quant.device_layer_parts``). Outlier
channels (``k_outliers``) are not done here: those codecs keep the host encode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP16_SCALE_MAX = 65504.0 / 2  # codec.quant: fp16 scales when the chunk's largest |x| is at most this


@dataclass(frozen=True)
class LayerCodes:
    """One layer of ``n`` chunks of ``chunk`` tokens (``T = n * chunk``, ``C = H * D``), on the device."""

    codes: torch.Tensor  # [2, T, C] uint8: K then V
    amax: torch.Tensor  # [2, T, G] float32, each already rounded to its chunk's scale dtype
    f16: torch.Tensor  # [n] bool: the chunk's scales are stored as fp16
    finite: torch.Tensor  # [n] bool: every K and V value of the chunk is finite
    cs: torch.Tensor | None  # [n, C] float32 key channel scales (rounded likewise), or None


def quantize_layer_device(
    k: torch.Tensor, v: torch.Tensor, m_k: int, m_v: int, groups: int, chunk: int, channel_scale: bool
) -> LayerCodes:
    """``k``, ``v``: ``[T, H, D]`` in the KV dtype (T a multiple of ``chunk``). See module docstring."""
    t = k.shape[0]
    n = t // chunk
    if n * chunk != t or t == 0:
        raise ValueError(f"{t} tokens are not whole chunks of {chunk}")
    kf = k.float().reshape(n, chunk, -1)
    vf = v.float().reshape(n, chunk, -1)
    finite = torch.isfinite(kf).flatten(1).all(1) & torch.isfinite(vf).flatten(1).all(1)
    big = torch.maximum(kf.abs().amax(dim=(1, 2)), vf.abs().amax(dim=(1, 2)))
    f16 = big <= FP16_SCALE_MAX

    def stored(a: torch.Tensor) -> torch.Tensor:  # a [n, ...] float32 as its chunk's scale dtype keeps it
        return torch.where(f16.view(n, *([1] * (a.dim() - 1))), a.half().float(), a)

    cs = None
    if channel_scale:
        cs = stored(kf.abs().amax(dim=1))  # [n, C]
        inv_c = torch.where(cs > 0, 1.0 / cs, torch.zeros_like(cs))
        kf = kf * inv_c[:, None, :]

    def quantize(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        xv = x.reshape(n, chunk, groups, -1)
        a = stored(xv.abs().amax(dim=3))  # [n, chunk, G]
        inv = torch.where(a > 0, torch.tensor(float(m), dtype=torch.float32, device=a.device) / a, 0.0)
        q = torch.round(xv * inv[..., None]).clamp(-m, m)
        return (q + m).to(torch.uint8).reshape(t, -1), a.reshape(t, groups)

    kc, ka = quantize(kf, m_k)
    vc, va = quantize(vf, m_v)
    return LayerCodes(torch.stack((kc, vc)), torch.stack((ka, va)), f16, finite, cs)
