"""``FetchBackend`` over the decoder pool: how the SGLang glue uses the NVDEC path.

A *direct* backend, like the DPU one: the waiting_for_KV queue reserves the staging rows before submitting
(``submit(request_id, keys, start_token, rows)``) and frames go into the rows as they decode. Per
request, one fetch thread gets the chunk blobs from the store, verifies them, and submits every chunk to
the shared :class:`DecoderPool`; each chunk's frames are restored by a :class:`SlotWriter` into a
one-chunk host restore buffer, and as soon as a layer group (K and V videos) of a chunk is restored, the
decoder pool's worker writes those layers into the chunk's rows through the staging's ``KVWriter``
(frame-wise restoration: per chunk in flight, one chunk of restore buffer, no whole-request buffer).
``handle.layers_ready`` advances group by group once every intact chunk has it in the rows, so
layer-wise loading can start before the whole prefix is decoded. A write that fails fails its chunk
(kind ``write``): the hit ends before it.

Adaptive resolution (``adapter.py``): with a :class:`ResolutionAdapter` the fetch thread gets the chunks
one at a time, each at the resolution Alg. 1 ranks first for the pool's load at that moment (the
bandwidth of the previous transfer, the profiled decode table, the switch penalty), and submits it to
the pool as soon as it arrived, so transfers overlap decoding; the link waits while the pool holds
``BUFFER_PER_INSTANCE x instances`` chunks (a bounded bitstream buffer). A version the store lacks
falls back to the next resolution of the ranking (``nvdec_fallbacks``); a chunk with no version is a
miss from there. A corrupt or foreign version is a miss from there (counted as a corrupt store value),
never a fallback and never a wrong token. Per fetch: the link's time waiting for the decoder and the
decoders' time waiting for bytes (``nvdec_bubble_seconds``). Without an adapter, one ``get_many`` of
the anchor keys (one resolution, the old behaviour).

Threads: ``submit``/``close`` on the scheduler thread; store I/O on this backend's fetch threads; decoding,
restoration and the writes on the pool's workers (the handle's progress under one lock). After
``cancel()`` no new write starts; the queue keeps the rows until the handle is done.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from sgl_remote_kv.codec.errors import CORRUPTION, ChunkError
from sgl_remote_kv.fetch.base import FetchHandle, ThreadedFetchBackend
from sgl_remote_kv.kvpool import KVWriteError, KVWriter
from sgl_remote_kv.nvdec.adapter import ResolutionAdapter, label, version_key
from sgl_remote_kv.nvdec.hevc_codec import GROUP, FrameCodes, HevcCodec
from sgl_remote_kv.nvdec.pool import DecoderPool, PoolClosed, SlotWriter
from sgl_remote_kv.types import FailureKind, ModelFingerprint, numpy_storage_dtype

logger = logging.getLogger(__name__)


class _Progress:
    """Per (chunk, group): restored K and V frames; writes a group into the rows once both videos are
    restored, then publishes ``handle.layers_ready``. Called on pool threads."""

    def __init__(self, handle: FetchHandle, writer: KVWriter, n_layers: int) -> None:
        self.handle, self.writer, self.n_layers = handle, writer, n_layers
        self.frames = np.zeros(handle.n_chunks, np.int64)  # frames per video of each chunk (its resolution)
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
                complete = self.counts[chunk, g] >= 2 * self.frames[chunk]
            if not complete or h.cancelled or chunk >= h.ok_chunks:
                return
            lo, hi = g * GROUP, min((g + 1) * GROUP, self.n_layers)
            try:
                self.writer.write(k[lo:hi], v[lo:hi], h.rows[chunk * c : (chunk + 1) * c], lo)
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


BUFFER_PER_INSTANCE = 2  # bitstream buffer: chunks queued or decoding in the pool per decoder instance


def decoder_wait_s(submitted: list[float], results: list) -> float:
    """Seconds between the first chunk's arrival and the last decode's end during which none of this
    fetch's chunks was decoding: the decoders waiting for bytes (``results``: ``ChunkResult``s)."""
    spans = sorted(
        (t + r.queued_s, t + r.queued_s + r.decode_s) for t, r in zip(submitted, results, strict=True)
    )
    if not spans:
        return 0.0
    idle, covered = 0.0, submitted[0]
    for a, b in spans:
        idle += max(0.0, a - covered)
        covered = max(covered, b)
    return idle


class NvdecFetchBackend(ThreadedFetchBackend):
    """Fetch chunks from ``client``, decode them on a shared :class:`DecoderPool` and write them into the
    pool through ``kv_writer`` (see module docstring). ``adapter``: adaptive resolution (None: the anchor
    version only); ``metrics``: ``RemoteKVMetrics`` for the per-resolution counters (None: not counted)."""

    label = "nvdec-fetch"
    direct = True  # the caller reserves the rows; frames land there as they decode
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
        adapter: ResolutionAdapter | None = None,
        metrics=None,
    ) -> None:
        super().__init__(client, codec, fingerprint, chunk_size, workers=fetch_threads, on_done=on_done)
        self.pool, self.kv_writer, self.adapter, self.metrics = pool, kv_writer, adapter, metrics
        self.anchor_res = getattr(codec, "tokens_per_frame", 0)
        self._versions: dict[int, HevcCodec] = {self.anchor_res: codec}
        if adapter is not None:
            from sgl_remote_kv.nvdec.versions import version_codec

            for r in adapter.resolutions:
                self._versions.setdefault(r, version_codec(codec, r))

    def estimate(self, nbytes: int, decoded: int, depth: int, spb: float) -> tuple[float, float]:
        """The policy's estimate for this path (``ResolutionAdapter.estimate``)."""
        return self.adapter.estimate(nbytes, decoded, depth, spb)

    def _on_success(self, handle: FetchHandle) -> None:
        handle.layers_ready = self.fingerprint.layout.num_layers

    def _count(self, name: str, value: float = 1.0, **labels) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name)(value, **labels)

    def _fetch_and_decode(self, handle: FetchHandle, keys: list[bytes]) -> None:
        if handle.cancelled:
            handle._fail_from(0, "cancelled")
            return
        if len(handle.rows) < len(keys) * self.chunk_size:
            raise ValueError("the NVDEC backend is direct: submit with one reserved row per token")
        lay, c = self.fingerprint.layout, self.chunk_size
        progress = _Progress(handle, self.kv_writer, lay.num_layers)
        shape = (lay.num_layers, c, lay.num_kv_heads, lay.head_dim)
        blobs, headers, futs, submitted, chosen, loads = [], [], [], [], [], []
        link_wait = link_s = 0.0
        source = self._adaptive(handle, keys) if self.adapter is not None else self._anchors(handle, keys)
        for i, (res, blob, hdr, waited, sent_s) in enumerate(source):
            link_wait += waited
            link_s += sent_s
            k = np.empty(shape, numpy_storage_dtype(lay.dtype))
            v = np.empty(shape, numpy_storage_dtype(lay.dtype))
            restore = SlotWriter(k, v, np.arange(c), lay.dtype)  # the chunk's host restore buffer
            progress.frames[i] = self._versions[res].frame_layout(c, lay.num_kv_heads, lay.head_dim).frames
            blobs.append(blob)
            headers.append(hdr)
            chosen.append(res)
            loads.append(self.pool.load() + 1)
            submitted.append(time.perf_counter())
            futs.append(self.pool.submit(blob, self.fingerprint, progress.sink(i, restore, k, v), chunk_id=i))
        handle.fetch_s = link_s
        handle._mark_verified(blobs, headers, self._on_done)
        results = []
        for i, fut in enumerate(futs):  # every future is awaited: no worker writes after we return
            try:
                res = fut.result()
                fail = "decode:chunk_size" if res.tokens != c else None
                handle.decode_s += res.decode_s
                results.append(res)
                if self.adapter is not None:
                    self.adapter.observe_decode(chosen[i], loads[i], res.decode_s)
            except ChunkError as e:
                fail = f"decode:{type(e).__name__}"
                if isinstance(e, CORRUPTION):  # counted and logged as a corrupt store value
                    self.client.report_corrupt(self._key(keys[i], chosen[i]), "nvdec codec", str(e))
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
        handle.resolutions = tuple(chosen)
        if results:
            n = len(results)
            handle.bubbles = (decoder_wait_s(submitted[:n], results), link_wait)
            self._count("nvdec_bubble", handle.bubbles[0], kind="decoder_wait")
            self._count("nvdec_bubble", handle.bubbles[1], kind="link_wait")
        for i, r in enumerate(chosen[: handle.ok_chunks]):
            self._count("nvdec_chunk", len(blobs[i]), resolution=label(r))

    def _key(self, anchor_key: bytes, res: int) -> bytes:
        return version_key(anchor_key, res, self.anchor_res)

    def _check(self, handle: FetchHandle, i: int, key: bytes, blob, res: int):
        """Chunk ``i``'s version ``res`` parsed (header) or None (a miss from ``i``, corrupt ones counted)."""
        try:
            hdr = self._versions[res].parse(blob, self.fingerprint)
        except ChunkError as e:
            self._chunk_error(handle, i, key, e)
            return None
        if hdr.num_tokens != handle.tokens[i]:
            handle._fail_from(i, "decode:chunk_size")
            return None
        return hdr

    def _anchors(self, handle: FetchHandle, keys: list[bytes]):
        """One resolution: every anchor blob in one ``get_many``, then verified in order."""
        t0 = time.perf_counter()
        blobs = self.client.get_many(keys)
        sent = time.perf_counter() - t0
        for i, blob in enumerate(blobs):
            if handle.cancelled:
                handle._fail_from(i, "cancelled")
                return
            if blob is None:
                handle._fail_from(i, "store_miss")
                return
            handle.fetched_bytes += len(blob)
            hdr = self._check(handle, i, keys[i], blob, self.anchor_res)
            if hdr is None:
                return
            yield self.anchor_res, blob, hdr, 0.0, sent if i == 0 else 0.0

    def _adaptive(self, handle: FetchHandle, keys: list[bytes]):
        """Chunk by chunk at Alg. 1's resolution (see module docstring): yields (resolution, blob, header,
        seconds the link waited for buffer space, seconds on the link)."""
        cap = BUFFER_PER_INSTANCE * self.pool.instances
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            while self.pool.load() >= cap and not handle.cancelled:
                time.sleep(0.002)
            waited = time.perf_counter() - t0
            if handle.cancelled:
                handle._fail_from(i, "cancelled")
                return
            sent = 0.0
            for choice in self.adapter.ranking(self.pool.load() + 1):
                res = choice.resolution
                vkey = self._key(key, res)
                t1 = time.perf_counter()
                blob = self.client.get_many([vkey])[0]
                dt = time.perf_counter() - t1
                sent += dt
                if blob is None:
                    self._count("nvdec_fallback", resolution=label(res))
                    continue
                handle.fetched_bytes += len(blob)
                self.adapter.observe_transfer(res, len(blob), dt)
                hdr = self._check(handle, i, vkey, blob, res)
                if hdr is None:
                    return
                self.adapter.decoded(res)  # the pool decodes in FIFO order: the next switch is from res
                yield res, blob, hdr, waited, sent
                break
            else:
                handle._fail_from(i, "store_miss")
                return
