"""``FetchBackend`` over the decoder pool: how the SGLang glue uses the NVDEC path.

A *direct* backend, like the DPU one: the waiting_for_KV queue reserves the KV slots before submitting
(``submit(request_id, keys, start_token, kv_slots)``) and frames go into the pool as they decode. Per
request, one fetch thread gets the chunk blobs from the store, verifies them, and submits every chunk to
the shared :class:`DecoderPool`; each chunk's frames are restored by a :class:`SlotWriter` into a
one-chunk host staging buffer, and as soon as a layer group (K and V videos) of a chunk is restored, the
pool worker writes those layers into the chunk's slots through the pool's ``KVWriter`` (frame-wise
restoration: per chunk in flight, one chunk of host staging, no whole-request staging).
``handle.layers_ready`` advances group by group once every intact chunk has it in the pool, so
layer-wise loading can start before the whole prefix is decoded. A write that fails fails its chunk
(kind ``write``): the hit ends before it.

Threads: ``submit``/``close`` on the scheduler thread; store I/O on this backend's fetch threads; decoding,
restoration and the writes on the pool's workers (the handle's progress under one lock). After
``cancel()`` no new write starts; the queue keeps the slots until the handle is done.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from sgl_remote_kv.nvdec.hevc_codec import GROUP, FrameCodes
from sgl_remote_kv.nvdec.pool import DecoderPool, PoolClosed, SlotWriter

from sgl_remote_kv.codec.errors import CORRUPTION, ChunkError
from sgl_remote_kv.kvpool import KVWriteError, KVWriter
from sgl_remote_kv.sglang_glue.fetch import FetchHandle, ThreadedFetchBackend
from sgl_remote_kv.types import FailureKind, ModelFingerprint, numpy_storage_dtype

logger = logging.getLogger(__name__)


class _Progress:
    """Per (chunk, group): restored K and V frames; writes a group into the pool once both videos are
    restored, then publishes ``handle.layers_ready``. Called on pool threads."""

    def __init__(self, handle: FetchHandle, writer: KVWriter, n_layers: int, frames_per_video: int) -> None:
        self.handle, self.writer, self.n_layers, self.frames = handle, writer, n_layers, frames_per_video
        self.groups = -(-n_layers // GROUP)
        self.counts = np.zeros((handle.n_chunks, self.groups), np.int64)  # V+K frames restored
        self.written = np.zeros((handle.n_chunks, self.groups), bool)
        self.lock = threading.Lock()

    def sink(self, chunk: int, restore: SlotWriter, k: np.ndarray, v: np.ndarray):
        h, c = self.handle, self.handle.chunk_size

        def on_frame(fc: FrameCodes) -> None:
            restore(fc)
            g = fc.layers[0] // GROUP
            with self.lock:
                self.counts[chunk, g] += 1
                complete = self.counts[chunk, g] >= 2 * self.frames
            if not complete or h.cancelled or chunk >= h.ok_chunks:
                return
            lo, hi = g * GROUP, min((g + 1) * GROUP, self.n_layers)
            try:
                self.writer.write(k[lo:hi], v[lo:hi], h.kv_slots[chunk * c : (chunk + 1) * c], lo)
            except KVWriteError as e:
                logger.warning(
                    "NVDEC write of %s chunk %d failed; a miss from there: %s", h.request_id, chunk, e
                )
                with self.lock:
                    h._fail_from(chunk, FailureKind.WRITE.value)
                return
            with self.lock:
                self.written[chunk, g] = True
                done = self.written[: h.ok_chunks].all(axis=0)
                h.layers_ready = min(self.n_layers, int(np.argmin(np.append(done, False))) * GROUP)

        return on_frame


class NvdecFetchBackend(ThreadedFetchBackend):
    """Fetch chunks from ``client``, decode them on a shared :class:`DecoderPool` and write them into the
    pool through ``kv_writer`` (see module docstring)."""

    label = "nvdec-fetch"
    direct = True  # the caller reserves the slots; frames land there as they decode
    tails = False  # full chunks only: an hevc chunk's frame layout is fixed by the chunk size

    def __init__(
        self,
        client,
        pool: DecoderPool,
        codec,
        fingerprint: ModelFingerprint,
        chunk_size: int,
        kv_writer: KVWriter,
        fetch_threads: int = 1,
        on_done=None,
    ) -> None:
        super().__init__(client, codec, fingerprint, chunk_size, workers=fetch_threads, on_done=on_done)
        self.pool, self.kv_writer = pool, kv_writer

    def _on_success(self, handle: FetchHandle) -> None:
        handle.layers_ready = self.fingerprint.layout.num_layers

    def _fetch_and_decode(self, handle: FetchHandle, keys: list[bytes]) -> None:
        if handle.cancelled:
            handle._fail_from(0, "cancelled")
            return
        if len(handle.kv_slots) < len(keys) * self.chunk_size:
            raise ValueError("the NVDEC backend is direct: submit with one reserved slot per token")
        blobs = self.client.get_many(keys)
        for i, blob in enumerate(blobs):
            if blob is None:
                handle._fail_from(i, "store_miss")
                break
            handle.fetched_bytes += len(blob)
        if handle.ok_chunks == 0:
            return
        self._verify(handle, keys, blobs)
        if handle.ok_chunks == 0:
            return
        lay, c = self.fingerprint.layout, self.chunk_size
        frames = self.codec.frame_layout(c, lay.num_kv_heads, lay.head_dim).frames
        progress = _Progress(handle, self.kv_writer, lay.num_layers, frames)
        shape = (lay.num_layers, c, lay.num_kv_heads, lay.head_dim)
        futs = []
        for i in range(handle.ok_chunks):
            k, v = (
                np.empty(shape, numpy_storage_dtype(lay.dtype)),
                np.empty(shape, numpy_storage_dtype(lay.dtype)),
            )
            restore = SlotWriter(k, v, np.arange(c), lay.dtype)  # the chunk's host staging rows
            futs.append(
                self.pool.submit(blobs[i], self.fingerprint, progress.sink(i, restore, k, v), chunk_id=i)
            )
        for i, fut in enumerate(futs):  # every future is awaited: no worker writes after we return
            try:
                res = fut.result()
                fail = "decode:chunk_size" if res.tokens != c else None
                handle.decode_s += res.decode_s
            except ChunkError as e:
                fail = f"decode:{type(e).__name__}"
                if isinstance(e, CORRUPTION):  # counted and logged as a corrupt store value
                    self.client.report_corrupt(keys[i], "nvdec codec", str(e))
            except PoolClosed:
                fail = "cancelled"
            except Exception as e:  # a crashed decoder instance or a sink bug: this chunk is a miss
                logger.warning("NVDEC chunk %d of %s failed: %r", i, handle.request_id, e)
                fail = "internal"
            if fail is not None:
                with progress.lock:  # pool workers cut the hit too (failed writes)
                    handle._fail_from(i, fail)
        if handle.cancelled:  # writes were skipped after the cancel: nothing of it is a hit
            with progress.lock:
                handle._fail_from(0, "cancelled")
        handle.decoded_bytes = handle.ok_chunks * c * lay.bytes_per_token()
