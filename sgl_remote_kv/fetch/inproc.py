"""``InProcessFetchBackend``, the in-process baseline ("CacheGen-Async-like"): worker threads of the
scheduler process run ``StoreClient.get_many`` and decode layer-major into numpy staging arrays. With a
device KV pool and a codec with a device dequant stage (``Codec.device_dequant``: the quantized and
transform codecs; ``keep_codes``) the workers run only the lossless stage and stage the codes
(``handle.codes``): the pool's ``KVWriter`` dequantizes them on the device at install (the CacheGen-like
"GPU decode" baseline; for the transform codec also its inverse transform and RoPE). Interface and
threads: ``base.py``.
"""

from __future__ import annotations

import time

import numpy as np

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.fetch.base import FetchHandle, ThreadedFetchBackend
from sgl_remote_kv.types import numpy_storage_dtype


class InProcessFetchBackend(ThreadedFetchBackend):
    """Fetch + decode in worker threads of this process (see module docstring). ``keep_codes``: stage
    the lossless stage's codes for device dequantization (codecs with ``device_dequant`` only)."""

    def __init__(self, *args, keep_codes: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep_codes = keep_codes and self.codec.device_dequant

    def _fetch_and_decode(self, handle: FetchHandle, keys: list[bytes]) -> None:
        if handle.cancelled:
            handle._fail_from(0, "cancelled")
            return
        t0 = time.perf_counter()
        blobs = self.client.get_many(keys)
        handle.fetch_s = time.perf_counter() - t0
        for i, blob in enumerate(blobs):
            if blob is None:
                handle._fail_from(i, "store_miss")
                break
            handle.fetched_bytes += len(blob)
        headers = self._verify(handle, keys, blobs)
        if handle.ok_chunks == 0 or handle.cancelled:
            if handle.cancelled:
                handle._fail_from(0, "cancelled")
            return
        if self.keep_codes:
            self._stage_codes(handle, keys, blobs, headers)
        else:
            self._decode_layer_major(handle, keys, blobs, headers)

    def _stage_codes(self, handle: FetchHandle, keys: list[bytes], blobs: list, headers: list) -> None:
        """Lossless stage only, layer-major: ``handle.codes[layer][chunk]`` (views into per-chunk buffers)."""
        lay = self.fingerprint.layout
        t0 = time.perf_counter()
        codes: list[list] = []
        for layer in range(lay.num_layers):
            row = []
            for i in range(handle.ok_chunks):
                buf = np.empty(self.codec.scratch_bytes(headers[i], layer), np.uint8)
                try:
                    row.append(self.codec.codes_stage(blobs[i], headers[i], layer, buf))
                except ChunkError as e:
                    self._chunk_error(handle, i, keys[i], e)
                    break
            codes.append(row)
            if handle.cancelled:
                handle._fail_from(0, "cancelled")
                return
            if handle.ok_chunks == 0:
                return
        handle.codes = [row[: handle.ok_chunks] for row in codes]
        handle.layers_ready = lay.num_layers
        handle.decode_s = time.perf_counter() - t0
        handle.decoded_bytes = handle.ok_tokens * lay.bytes_per_token()

    def _decode_layer_major(self, handle: FetchHandle, keys: list[bytes], blobs: list, headers: list) -> None:
        lay = self.fingerprint.layout
        shape = (lay.num_layers, handle.offsets[handle.ok_chunks], lay.num_kv_heads, lay.head_dim)
        dt = numpy_storage_dtype(lay.dtype)
        handle.k, handle.v = np.empty(shape, dt), np.empty(shape, dt)
        t0 = time.perf_counter()
        scratch = np.empty(1, np.uint8)
        for layer in range(lay.num_layers):
            for i in range(handle.ok_chunks):
                need = self.codec.scratch_bytes(headers[i], layer)
                if scratch.size < need:
                    scratch = np.empty(need, np.uint8)
                try:
                    self.codec.decode_layer_into(
                        blobs[i],
                        headers[i],
                        layer,
                        scratch,
                        handle.k[layer, handle.span(i)],
                        handle.v[layer, handle.span(i)],
                    )
                except ChunkError as e:
                    self._chunk_error(handle, i, keys[i], e)
                    break
            if handle.cancelled:
                handle._fail_from(0, "cancelled")
                return
            if handle.ok_chunks == 0:
                return
            handle.layers_ready = layer + 1
        handle.decode_s = time.perf_counter() - t0
        handle.decoded_bytes = handle.k[:, : handle.ok_tokens].nbytes * 2
