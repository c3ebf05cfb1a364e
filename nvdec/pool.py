"""Decoder pool with frame-wise KV restoration (KVFetcher §3.3.2).

``DecoderPool`` runs N decoder instances (threads; on a GPU one per NVDEC engine), each owning one
:class:`VideoDecoder`. Chunks wait in a bounded FIFO; an idle instance takes the next one, parses and
verifies the blob, and decodes its videos frame by frame. Every decoded frame goes straight to the chunk's
*sink* (the restoration callback, called on the worker thread), e.g. :class:`SlotWriter`, which
dequantizes the frame's tokens into the fetch's host staging rows (the SGLang glue then puts them into the
KV pool through the pool's ``KVWriter``, like every other path).

Usage (what the SGLang glue would do per fetched chunk)::

    pool = DecoderPool(instances=2)                     # device="cuda" -> PyNvVideoCodec (nvcodec.py)
    sink = SlotWriter(k_rows, v_rows, rows, dtype)      # per-layer [S, H, D] host arrays, rows [T]
    fut = pool.submit(blob, fingerprint, sink)          # -> concurrent.futures.Future[ChunkResult]
    fut.result()                                        # raises ChunkError (treat as a miss) / PoolClosed
    pool.close()                                        # cancels queued chunks, aborts running ones

A failed or cancelled chunk may have written some of its slots: the caller must treat all of the chunk's
slots as garbage (free them or recompute), exactly as for a miss.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from sgl_remote_kv.nvdec.hevc_codec import FrameCodes, HevcCodec
from sgl_remote_kv.nvdec.video import VideoDecoder

from sgl_remote_kv.codec import quant
from sgl_remote_kv.codec.base import codec_for_header
from sgl_remote_kv.codec.errors import ChunkError, ForeignChunk
from sgl_remote_kv.codec.format import DEFAULT_LIMITS, Limits, parse_header
from sgl_remote_kv.types import ModelFingerprint, numpy_storage_dtype

logger = logging.getLogger(__name__)

FrameSink = Callable[[FrameCodes], None]
_MODES = {"float32": 0, "float16": 1, "bfloat16": 2}


class PoolClosed(Exception):
    """The pool was closed before or while the chunk was decoded."""


class DecoderCrashed(RuntimeError):
    """A decoder instance died mid-chunk (e.g. SystemExit from a native binding); the chunk is a miss."""


@dataclass(frozen=True)
class ChunkResult:
    chunk_id: object
    tokens: int
    frames: int
    blob_bytes: int
    queued_s: float
    decode_s: float  # parse + decode + restoration, on the worker (wall)
    cpu_s: float  # the worker thread's CPU time for this chunk (robust to other load on the machine)


@dataclass(frozen=True)
class _Job:
    blob: bytes
    fingerprint: ModelFingerprint
    sink: FrameSink
    future: Future
    chunk_id: object
    enqueued: float


class SlotWriter:
    """Restoration callback: dequantize a frame's codes into per-layer host arrays at rows ``slots``.

    ``k_layers``/``v_layers``: per-layer numpy arrays ``[S, H, D]`` in the KV storage dtype (the fetch's
    host staging; the pool itself is written only through its ``KVWriter``), owned by the caller;
    ``slots[t]`` is the row of the chunk's token ``t``. Called on pool worker threads; writes only rows of ``slots`` (chunks in
    flight must use disjoint slots). Scratch is per call (one frame's tokens).
    """

    def __init__(
        self, k_layers: Sequence[np.ndarray], v_layers: Sequence[np.ndarray], slots: np.ndarray, dtype: str
    ):
        self.k_layers, self.v_layers, self.slots = k_layers, v_layers, np.asarray(slots, np.int64)
        self.mode, self.dtype = _MODES[dtype], numpy_storage_dtype(dtype)

    def __call__(self, fc: FrameCodes) -> None:
        dest = self.k_layers if fc.kind == "k" else self.v_layers
        n, c = fc.codes.shape[1:]
        rows = self.slots[fc.tokens]
        out = np.empty((n, c), self.dtype)
        for j, layer in enumerate(fc.layers):
            side = fc.sides[j]
            if fc.kind == "k":
                scales, cs, m = side.k_scales[fc.tokens], side.k_cs, side.mk
            else:
                scales, cs, m = side.v_scales[fc.tokens], np.empty(0, np.float32), side.mv
            if self.mode == 0:
                quant.dequant_rows(fc.codes[j], scales, cs, m, 0, out, quant._EMPTY16)
            else:
                quant.dequant_rows(fc.codes[j], scales, cs, m, self.mode, quant._EMPTY32, out.view(np.uint16))
            tgt = dest[layer]
            tgt[rows] = out.reshape(n, *tgt.shape[1:])


class DecoderPool:
    """N decoder threads over one FIFO of chunks. ``submit`` may be called from any thread."""

    def __init__(
        self,
        instances: int = 2,
        device: str = "cpu",
        max_queued: int = 256,
        limits: Limits = DEFAULT_LIMITS,
        gpu_id: int = 0,
    ):
        if instances < 1:
            raise ValueError("instances must be >= 1")
        self.instances, self.device, self.limits, self.gpu_id = instances, device, limits, gpu_id
        self._q: queue.Queue[_Job | None] = queue.Queue(max_queued)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._busy = 0
        self.stats = {
            "ok": 0,
            "chunk_errors": 0,
            "internal_errors": 0,
            "cancelled": 0,
            "frames": 0,
            "instance_restarts": 0,
        }
        self._threads = [
            threading.Thread(target=self._worker, name=f"nvdec-{i}", daemon=True) for i in range(instances)
        ]
        for t in self._threads:
            t.start()

    # ---- caller side --------------------------------------------------------------------------
    def submit(self, blob, fingerprint: ModelFingerprint, sink: FrameSink, *, chunk_id=None) -> Future:
        """Queue a chunk; the future resolves to a :class:`ChunkResult` or raises ``ChunkError`` /
        :class:`PoolClosed`. The pool keeps ``blob`` (read-only) until the chunk finishes."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(PoolClosed("pool is closed"))
            return fut
        self._q.put(_Job(blob, fingerprint, sink, fut, chunk_id, time.perf_counter()))
        return fut

    def load(self) -> int:
        """Chunks queued or being decoded (the adaptive policy's pool load)."""
        with self._lock:
            return self._q.qsize() + self._busy

    def close(self, cancel_pending: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the pool. ``cancel_pending``: queued chunks fail with ``PoolClosed`` and running ones abort
        at their next frame; otherwise queued chunks are finished first. Joins the worker threads."""
        if not cancel_pending:
            for _ in self._threads:
                self._q.put(None)
            for t in self._threads:
                t.join(timeout)
        self._stop.set()
        self._drain()
        for _ in self._threads:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                break
        for t in self._threads:
            t.join(timeout)
        self._drain()

    def __enter__(self) -> DecoderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drain(self) -> None:
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                self._count("cancelled")
                job.future.set_exception(PoolClosed("pool closed before the chunk was decoded"))

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    # ---- worker side --------------------------------------------------------------------------
    def _worker(self) -> None:
        decoder = VideoDecoder(self.device, gpu_id=self.gpu_id)
        while True:
            job = self._q.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            if self._stop.is_set():
                self._count("cancelled")
                job.future.set_exception(PoolClosed("pool closed before the chunk was decoded"))
                continue
            with self._lock:
                self._busy += 1
            try:
                job.future.set_result(self._decode(job, decoder))
                self._count("ok")
            except (ChunkError, PoolClosed) as e:
                self._count("chunk_errors" if isinstance(e, ChunkError) else "cancelled")
                decoder.reset()
                job.future.set_exception(e)
            except Exception as e:  # thread boundary: a sink or decoder bug must not kill the instance
                self._count("internal_errors")
                logger.exception(
                    "decoder instance %s: chunk %r failed", threading.current_thread().name, job.chunk_id
                )
                decoder.reset()
                job.future.set_exception(e)
            except BaseException as e:  # noqa: B036 -- thread boundary: SystemExit & co. from a binding
                # The decoder instance is in an unknown state: fail this chunk (a miss for the caller) and
                # replace the instance; the thread keeps serving the queue.
                self._count("instance_restarts")
                logger.error(
                    "decoder instance %s died (%r); replacing it", threading.current_thread().name, e
                )
                job.future.set_exception(DecoderCrashed(f"decoder instance died: {e!r}"))
                decoder = VideoDecoder(self.device, gpu_id=self.gpu_id)
            finally:
                with self._lock:
                    self._busy -= 1

    def _decode(self, job: _Job, decoder: VideoDecoder) -> ChunkResult:
        t0, c0 = time.perf_counter(), time.thread_time()
        hdr = parse_header(job.blob, job.fingerprint, self.limits)
        codec = codec_for_header(hdr)
        if not isinstance(codec, HevcCodec):
            raise ForeignChunk(f"the decoder pool takes hevc chunks, not codec {hdr.codec_id}")
        frames = 0
        for fc in codec.iter_frames(job.blob, hdr, decoder):
            if self._stop.is_set():
                raise PoolClosed("pool closed while the chunk was decoding")
            job.sink(fc)
            frames += 1
        self._count("frames", frames)
        return ChunkResult(
            job.chunk_id,
            hdr.num_tokens,
            frames,
            len(job.blob),
            t0 - job.enqueued,
            time.perf_counter() - t0,
            time.thread_time() - c0,
        )
