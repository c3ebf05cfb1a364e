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

from sgl_remote_kv.fetch.base import (
    FetchHandle,
    LayerDecodeError,
    Scratch,
    ThreadedFetchBackend,
    decode_layer,
)
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
        self._decode(handle, keys, blobs, headers)

    def _decode(self, handle: FetchHandle, keys: list[bytes], blobs: list, headers: list) -> None:
        """Layer-major through ``decode_layer``: into ``handle.k``/``handle.v`` (``layers_ready`` advancing per
        layer), or with ``keep_codes`` the lossless stage only into ``handle.codes[layer][chunk]`` (views into
        per-chunk buffers, published whole). A chunk that fails cuts the hit there."""
        lay = self.fingerprint.layout
        t0 = time.perf_counter()
        codes: list[list] = []
        if self.keep_codes:
            scratch = _fresh  # each chunk's codes outlive the loop
        else:
            shape = (lay.num_layers, handle.offsets[handle.ok_chunks], lay.num_kv_heads, lay.head_dim)
            dt = numpy_storage_dtype(lay.dtype)
            handle.k, handle.v = np.empty(shape, dt), np.empty(shape, dt)
            scratch = Scratch()
        for layer in range(lay.num_layers):
            n, row = handle.ok_chunks, []
            into = None if self.keep_codes else _spans_of(handle, layer)
            try:
                for item in decode_layer(self.codec, blobs[:n], headers[:n], layer, scratch, into):
                    if self.keep_codes:
                        row.append(item[1])
            except LayerDecodeError as e:
                self._chunk_error(handle, e.index, keys[e.index], e.cause)
            if handle.cancelled:
                handle._fail_from(0, "cancelled")
                return
            if handle.ok_chunks == 0:
                return
            if self.keep_codes:
                codes.append(row)
            else:
                handle.layers_ready = layer + 1
        if self.keep_codes:
            handle.codes = [row[: handle.ok_chunks] for row in codes]
            handle.layers_ready = lay.num_layers
        handle.decode_s = time.perf_counter() - t0
        handle.decoded_bytes = handle.ok_tokens * lay.bytes_per_token()


def _fresh(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


def _spans_of(handle: FetchHandle, layer: int):
    return lambda i: (handle.k[layer, handle.span(i)], handle.v[layer, handle.span(i)])
