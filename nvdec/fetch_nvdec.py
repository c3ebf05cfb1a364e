"""``FetchBackend`` over the decoder pool: how the SGLang glue uses the NVDEC path.

Same interface as ``sgl_remote_kv.sglang_glue.fetch.InProcessFetchBackend`` (``submit(request_id, keys,
start_token) -> FetchHandle``, ``queue_depth()``, ``close()``), so the remote_kv radix cache / waiting
queue can switch to it by configuration. Per request, one fetch thread gets the chunk blobs from the
store and submits every chunk to the shared :class:`DecoderPool`; each chunk's frames are restored by a
:class:`SlotWriter` straight into the handle's staging arrays (``handle.k/v[:, i*c:(i+1)*c]``), and
``handle.layers_ready`` advances group by group (three layers at a time, once K and V of that group are
restored for every chunk) so layer-wise loading can start before the whole prefix is decoded.

Threads: ``submit``/``close`` on the scheduler thread; store I/O on this backend's fetch threads; decoding
and restoration on the pool's workers. The staging arrays are allocated here and owned by the handle.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from sgl_remote_kv.nvdec.hevc_codec import GROUP, FrameCodes
from sgl_remote_kv.nvdec.pool import DecoderPool, PoolClosed, SlotWriter

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.sglang_glue.fetch import FetchHandle, ThreadedFetchBackend
from sgl_remote_kv.types import ModelFingerprint, numpy_storage_dtype

logger = logging.getLogger(__name__)


class _Progress:
    """Counts restored V frames per (chunk, group); publishes ``handle.layers_ready``. Pool threads."""

    def __init__(self, handle: FetchHandle, n_layers: int, frames_per_video: int) -> None:
        self.handle, self.n_layers, self.frames = handle, n_layers, frames_per_video
        self.groups = -(-n_layers // GROUP)
        self.counts = np.zeros((handle.n_chunks, self.groups), np.int64)
        self.lock = threading.Lock()

    def sink(self, chunk: int, writer: SlotWriter):
        def on_frame(fc: FrameCodes) -> None:
            writer(fc)
            if fc.kind == "v":
                with self.lock:
                    self.counts[chunk, fc.layers[0] // GROUP] += 1
                    ok = self.counts[: self.handle.ok_chunks] >= self.frames
                    done_groups = int(np.argmin(np.append(ok.all(axis=0), False)))
                    self.handle.layers_ready = min(self.n_layers, done_groups * GROUP)

        return on_frame


class NvdecFetchBackend(ThreadedFetchBackend):
    """Fetch chunks from ``client`` and decode them on a shared :class:`DecoderPool` (see module doc)."""

    label = "nvdec-fetch"

    def __init__(self, client, pool: DecoderPool, codec, fingerprint: ModelFingerprint, chunk_size: int,
                 fetch_threads: int = 1, on_done=None) -> None:  # fmt: skip
        super().__init__(client, codec, fingerprint, chunk_size, workers=fetch_threads, on_done=on_done)
        self.pool = pool

    def _on_success(self, handle: FetchHandle) -> None:
        handle.layers_ready = self.fingerprint.layout.num_layers

    def _fetch_and_decode(self, handle: FetchHandle, keys: list[bytes]) -> None:
        if handle.cancelled:
            handle._fail_from(0, "cancelled")
            return
        blobs = self.client.get_many(keys)
        for i, blob in enumerate(blobs):
            if blob is None:
                handle._fail_from(i, "store_miss")
                break
            handle.fetched_bytes += len(blob)
        if handle.ok_chunks == 0:
            return
        self._verify(handle, blobs)
        if handle.ok_chunks == 0:
            return
        lay, c = self.fingerprint.layout, self.chunk_size
        shape = (lay.num_layers, handle.ok_chunks * c, lay.num_kv_heads, lay.head_dim)
        handle.k = np.empty(shape, numpy_storage_dtype(lay.dtype))
        handle.v = np.empty_like(handle.k)
        frames = self.codec.frame_layout(c, lay.num_kv_heads, lay.head_dim).frames
        progress = _Progress(handle, lay.num_layers, frames)
        futs = []
        for i in range(handle.ok_chunks):
            writer = SlotWriter(handle.k, handle.v, np.arange(i * c, (i + 1) * c), lay.dtype)
            futs.append(self.pool.submit(blobs[i], self.fingerprint, progress.sink(i, writer), chunk_id=i))
        for i, fut in enumerate(futs):
            try:
                res = fut.result()
                if res.tokens != c:
                    handle._fail_from(i, "decode:chunk_size")
                handle.decode_s += res.decode_s
            except ChunkError as e:
                handle._fail_from(i, f"decode:{type(e).__name__}")
            except PoolClosed:
                handle._fail_from(i, "cancelled")
