"""The transform codec's device half (``TransformCodec`` inherits it): the constants its GPU kernels use to
decode (``device_consts``: ``kernels/transform.py``) and to encode for the write-back (``encode_consts``:
``kernels/transform_encode.py``), and the host's share of a device encode (``encode_quantized``: the lossless
stage of what the device coded, ``quantized.TransformCodes``). Host arrays only: the device writer uploads them.
"""

from __future__ import annotations

import struct

import numpy as np

from sgl_remote_kv.codec import calibration as calib_mod
from sgl_remote_kv.codec import lz
from sgl_remote_kv.codec import transform_ops as ops
from sgl_remote_kv.codec.format import pack
from sgl_remote_kv.types import ModelFingerprint

PRE = struct.Struct("<IIHBBHHII")  # a layer section's prelude (``transform.py``'s decoded-layer buffer)


class TransformOnDevice:
    """Mixed into ``TransformCodec`` (its ``cal``, ``quality``, ``entropy``, ``level``, ``_packed``)."""

    @property
    def device_encode(self) -> bool:
        """A device pool's write-back codes on the device (``kernels/transform_encode.py``), Deflate or zstd
        here (not rANS)."""
        return self.entropy in lz.PACKED

    def device_encode_spec(self, fingerprint: ModelFingerprint):
        from sgl_remote_kv.codec.quantized import TransformEncodeSpec

        group = calib_mod.group_of(fingerprint, self.cal.groups, self.cal.group_dim)
        lay = fingerprint.layout
        return TransformEncodeSpec(self, group, lay.num_kv_heads * lay.head_dim // self.cal.group_dim)

    def encode_quantized(self, q, j: int, fingerprint: ModelFingerprint) -> bytes:
        """Chunk ``j`` of a device-coded read (``quantized.TransformCodes``) as a blob, Deflate- or zstd-coded here."""
        group = calib_mod.group_of(fingerprint, self.cal.groups, self.cal.group_dim)
        n_sink = ops.sink_count(self.cal, q.start + j * q.chunk, q.chunk)
        sections = []
        for layer in range(fingerprint.layout.num_layers):
            prefix, sk, sv = q.layer_parts(PRE, layer, j, n_sink, group)
            sections.append(self._packed(lz.PACKED[self.entropy], prefix, (sk, sv), q.chunk))
        return pack(
            self.codec_id, self.params_bytes(), fingerprint, q.chunk, sections, aux_id=self.cal.calib_id
        )

    @property
    def rope_style(self) -> int:
        """``kernels.transform.NEOX`` or ``GPTJ``."""
        return ops.rope_style(self.cal.rope)

    def encode_consts(self, layer: int, group: int, n_g: int):
        """``kernels.transform_encode.EncodeConsts`` (host arrays) of ``layer``'s groups ``group..+n_g``."""
        from sgl_remote_kv.kernels.transform_encode import EncodeConsts

        gs, cal = slice(group, group + n_g), self.cal
        steps = np.ascontiguousarray(cal.steps[self.quality][layer, :, gs], np.float32)
        arrays = (cal.mean[layer, :, gs], cal.basis[layer, :, gs], np.float32(1.0) / steps, steps, ops.LOG8)
        return EncodeConsts(*(np.array(a, np.float32, order="C") for a in arrays))

    def device_consts(self, layer: int, group: int, n_g: int):
        """``kernels.transform.TransformConsts`` (host arrays) of ``layer``'s groups ``group..+n_g``."""
        from sgl_remote_kv.kernels.transform import TransformConsts

        gs = slice(group, group + n_g)
        weff = self.cal.inverse_tables(self.quality, layer).weff[:, gs]  # the decode matrix, steps folded in
        return TransformConsts.build(
            np.ones(weff.shape[:-1], np.float32),
            weff.swapaxes(-1, -2),
            self.cal.mean[layer, :, gs],
            self.cal.head_dim,
            ops.rope_style(self.cal.rope),
        )
