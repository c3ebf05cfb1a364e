"""The write side of adaptive resolution: every chunk's extra versions (``--remote-kv-nvdec-resolutions``).

The write-back encodes each new full chunk with the deployment's ``hevc`` codec (the *anchor* version,
under the chunk's ordinary key) and hands it here for the other resolutions: the same KV through the
same quantization and tiling at another ``tokens_per_frame``, each stored under
``adapter.version_key(anchor key, resolution)``. Lossless video over identical codes: every version
decodes to bit-identical KV (tested). Each version's bytes are reported (``on_written``:
``nvdec_written_bytes{resolution}``), the store cost of adaptive resolution.

Called on the write-back worker thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from sgl_remote_kv.nvdec.adapter import label, version_key
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec

from sgl_remote_kv.types import ModelFingerprint


def version_codec(anchor: HevcCodec, res: int) -> HevcCodec:
    """The ``hevc`` codec of ``anchor``'s quantization and tiling at ``res`` tokens per frame."""
    return HevcCodec(**{**anchor.params(), "tokens_per_frame": int(res)})


class ChunkVersions:
    """Encode a chunk's non-anchor versions (see module docstring)."""

    def __init__(
        self,
        anchor: HevcCodec,
        resolutions: Sequence[int],
        fingerprint: ModelFingerprint,
        chunk_size: int,
        on_written: Callable[[int, str], None] | None = None,
    ) -> None:
        self.anchor, self.fingerprint, self.chunk_size = anchor, fingerprint, chunk_size
        self.anchor_res = anchor.tokens_per_frame
        self.codecs = {r: version_codec(anchor, r) for r in resolutions if r != self.anchor_res}
        self.on_written = on_written

    @property
    def extra(self) -> tuple[int, ...]:
        return tuple(self.codecs)

    def encode(
        self, anchor_key: bytes, k: np.ndarray, v: np.ndarray, start: int = 0
    ) -> list[tuple[bytes, bytes, str]]:
        """``[(version key, blob, resolution label)]`` of the chunk ``anchor_key`` (``k``/``v``
        ``[L, T, H, D]``); only full chunks have versions (an hevc frame layout is per chunk size)."""
        if k.shape[1] != self.chunk_size:
            return []
        return [
            (version_key(anchor_key, r, self.anchor_res), c.encode(k, v, self.fingerprint, start), label(r))
            for r, c in self.codecs.items()
        ]

    def written(self, versions: list[tuple[bytes, bytes, str]], anchor_blobs: list[bytes]) -> None:
        """Count stored versions: ``versions`` from :meth:`encode` and the anchors' blobs."""
        if self.on_written is None:
            return
        for b in anchor_blobs:
            self.on_written(len(b), label(self.anchor_res))
        for _, b, lab in versions:
            self.on_written(len(b), lab)
