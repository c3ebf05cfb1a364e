"""The fetch-path interface: what the waiting_for_KV queue (``admission/``) drives, whatever gets the
chunks and decodes them (``inproc.py``: worker threads of this process; ``dpu.py``: the DPU data plane;
``nvdec.py``: the video decoder pool). ``paths.py`` chooses the paths and the codec.

- ``FetchBackend.submit(request_id, keys, start_token, rows, tokens) -> FetchHandle`` starts fetching
  ``keys`` (consecutive chunk keys of one prompt, the first one starting at token ``start_token``;
  ``tokens``: each chunk's token count — full chunks, then possibly tail sub-chunks; backends with
  ``tails = False`` take full chunks only); a *direct*
  backend (``direct = True``: DPU, NVDEC) writes the KV into the reserved staging ``rows`` itself
  through the staging's ``KVWriter`` (``kvpool.rows.RowStore``), the others hold it in the handle
  (``handle.k``/``handle.v`` or ``handle.codes``) until the install writes it into the rows;
- ``FetchHandle`` reports progress: ``layers_ready`` (layers fully decoded for every chunk that is
  still valid), ``done()``, ``ok_chunks`` (leading chunks fetched and decoded; chunks after the first
  failure are dropped, since a hit must stay prefix-contiguous), ``failure`` (kind of the first
  failure), ``cancel()``;
- ``FetchPath``: one backend plus the codec it decodes (``paths.build_paths``).

``ThreadedFetchBackend`` is the base of the backends that fetch on a thread pool of this process
(in-process, NVDEC).

Threads: ``submit``/``cancel``/reads of a handle happen on the scheduler thread; the decode runs on
the backend's worker threads. Buffers: the staging arrays ``handle.k``/``handle.v``
(``[L, n_chunks * chunk, H, D]``) or ``handle.codes`` (per layer, one codes view per chunk) are
allocated by the backend and owned by the handle; the scheduler reads them only after ``done()`` is
true (``write_staged``), then drops the handle.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from sgl_remote_kv.codec.base import Codec
from sgl_remote_kv.codec.errors import CORRUPTION, ChunkError
from sgl_remote_kv.kvpool import KVWriter
from sgl_remote_kv.types import ModelFingerprint, PathName

logger = logging.getLogger(__name__)


class FetchHandle:
    """Progress of one request's fetch. Written by one worker thread, read by the scheduler thread."""

    decoded_here = True  # the decode ran in this process (``decode_s`` is its time)
    direct = False  # the backend writes the KV into ``rows`` itself (nothing held to write at install)

    def __init__(
        self,
        request_id: str,
        n_chunks: int,
        start_token: int,
        chunk_size: int,
        tokens: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.n_chunks = n_chunks
        self.start_token = start_token
        self.chunk_size = chunk_size  # tokens of a full chunk
        self.tokens = tuple(tokens) if tokens is not None else (chunk_size,) * n_chunks  # per chunk
        if len(self.tokens) != n_chunks or min(self.tokens, default=1) <= 0:
            raise ValueError(f"need {n_chunks} positive per-chunk token counts, got {self.tokens}")
        self.offsets = (0, *itertools.accumulate(self.tokens))  # chunk i = tokens [offsets[i], offsets[i+1])
        self.k: np.ndarray | None = None
        self.v: np.ndarray | None = None
        self.codes: list[list] | None = None  # [layer][chunk] codes views (Codec.codes_stage), instead of k/v
        self.rows = None  # direct backends: the reserved staging rows (host int64), one per token
        self.ok_chunks = n_chunks
        self.layers_ready = 0
        self.failure: str | None = None
        self.fetched_bytes = 0
        self.decoded_bytes = 0
        self.fetch_s = 0.0
        self.decode_s = 0.0
        self.submitted_at = time.monotonic()
        self.finished_at: float | None = None  # monotonic time the KV was ready (or the fetch failed)
        self._done = threading.Event()
        self._cancelled = threading.Event()
        # Set once every chunk's bytes are fetched and verified (the store framing's HMAC when on, then
        # ``codec.parse``: header, checksums) with ``ok_chunks == n_chunks``; ``blobs``/``headers`` then
        # stay readable (layer-wise admission and its in-process fallback decode, ``layerwise.py``).
        self.verified = threading.Event()
        self.blobs: list | None = None
        self.headers: list | None = None

    # -- scheduler side ------------------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def layer_ready(self, layer: int) -> bool:
        return layer < self.layers_ready

    @property
    def ok_tokens(self) -> int:
        return self.offsets[self.ok_chunks] if self.failure != "cancelled" else 0

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    def span(self, chunk: int) -> slice:
        """Token positions (relative to ``start_token``) of chunk ``chunk``."""
        return slice(self.offsets[chunk], self.offsets[chunk + 1])

    def has_staged(self) -> bool:
        return self.k is not None or self.codes is not None

    def write_staged(self, writer: KVWriter, rows, tokens: int) -> None:
        """The first ``tokens`` tokens held in the handle into ``rows`` through ``writer`` (after
        ``done()``). Raises ``KVWriteError``."""
        if self.codes is not None:
            n = bisect.bisect_right(self.offsets, tokens) - 1  # chunks that end within ``tokens``
            writer.write_quantized_layers([views[:n] for views in self.codes], rows)
        else:
            writer.write(self.k[:, :tokens], self.v[:, :tokens], rows)

    # -- worker side ---------------------------------------------------------------------------
    def _fail_from(self, chunk: int, kind: str) -> None:
        if chunk < self.ok_chunks:
            self.ok_chunks = chunk
            self.failure = self.failure or kind

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        self._done.set()

    def _mark_verified(self, blobs: list, headers: list, on_event=None) -> None:
        if self.ok_chunks == self.n_chunks and len(headers) == self.n_chunks and not self.cancelled:
            self.blobs, self.headers = list(blobs[: self.n_chunks]), list(headers)
            self.verified.set()
            if on_event is not None:
                on_event()


class LayerDecodeError(Exception):
    """Chunk ``index`` failed in ``decode_layer`` (``cause``: the codec's ``ChunkError``)."""

    def __init__(self, index: int, cause: ChunkError) -> None:
        super().__init__(f"chunk {index}: {cause!r}")
        self.index, self.cause = index, cause


class Scratch:
    """A grow-only uint8 scratch for ``decode_layer``: one buffer lent to every call, replaced by a larger one
    when a chunk-layer needs more; the outgrown one is zeroed before it is dropped (decoded codec bytes must
    not reach a later ``torch.empty``: ``layerwise._DecodeBuffers``). Not thread-safe: one user at a time."""

    def __init__(self) -> None:
        self._buf = np.zeros(1, np.uint8)

    def __call__(self, nbytes: int) -> np.ndarray:
        if self._buf.size < nbytes:
            self._buf.fill(0)
            self._buf = np.zeros(nbytes, np.uint8)
        return self._buf


def decode_layer(codec: Codec, blobs, headers, layer: int, scratch, into=None):
    """The one in-process decode loop: ``layer`` of each verified chunk ``(blobs[i], headers[i])``, in order.

    ``scratch(nbytes) -> uint8 array`` lends the codec's scratch (the caller decides whether it is reused
    or fresh). With ``into(i) -> (k, v)`` it decodes chunk ``i`` fully into those arrays and yields ``i``;
    without, it runs the lossless stage only and yields ``(i, codes)`` (a view into that chunk's scratch,
    for a device dequant). A chunk that fails raises ``LayerDecodeError`` (its index and cause): the caller
    decides what a failure means (a fetch worker cuts the hit there; a released install cannot)."""
    for i, (blob, hdr) in enumerate(zip(blobs, headers, strict=True)):
        buf = scratch(codec.scratch_bytes(hdr, layer))
        try:
            if into is None:
                out = (i, codec.codes_stage(blob, hdr, layer, buf))
            else:
                codec.decode_layer_into(blob, hdr, layer, buf, *into(i))
                out = i
        except ChunkError as e:
            raise LayerDecodeError(i, e) from e
        yield out


class FetchBackend(Protocol):
    direct: bool  # True: the backend writes the reserved rows (DPU, NVDEC); else the install does
    tails: bool  # True: ``submit`` takes chunks of different token counts (tail sub-chunks)

    def submit(
        self, request_id: str, keys: list[bytes], start_token: int, rows, tokens: list[int] | None = None
    ) -> FetchHandle: ...

    def queue_depth(self) -> int: ...

    def close(self) -> None: ...


class ThreadedFetchBackend:
    """Base of the fetch backends that run each request's fetch on a thread pool of this process.

    ``submit`` (scheduler thread) queues ``_fetch_and_decode(handle, keys)`` (subclass, worker thread);
    any unexpected exception there is a miss for the whole request. ``_on_success`` runs on the worker
    just before the handle finishes, when no chunk failed.
    """

    direct = False
    tails = True
    label = "fetch"

    def __init__(
        self,
        client,
        codec: Codec,
        fingerprint: ModelFingerprint,
        chunk_size: int,
        workers: int = 1,
        on_done=None,
    ) -> None:
        self.client = client
        self.codec = codec
        self.fingerprint = fingerprint
        self.chunk_size = chunk_size
        self._on_done = on_done
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"srkv-{self.label}")
        self._pending = 0
        self._lock = threading.Lock()

    def queue_depth(self) -> int:
        with self._lock:
            return self._pending

    def submit(
        self,
        request_id: str,
        keys: list[bytes],
        start_token: int,
        rows=None,
        tokens: list[int] | None = None,
    ) -> FetchHandle:
        """Queue a fetch; ``rows``: the reserved staging rows of its tokens (used by direct backends);
        ``tokens``: per-chunk token counts (default: full chunks)."""
        if tokens is not None and not self.tails and set(tokens) != {self.chunk_size}:
            raise ValueError(f"{self.label} takes full chunks only")
        handle = FetchHandle(request_id, len(keys), start_token, self.chunk_size, tokens)
        if self.direct:
            if rows is None:
                raise ValueError(f"{self.label} is a direct backend: submit with the reserved rows")
            handle.rows, handle.direct = rows.to("cpu", torch.int64), True
        with self._lock:
            self._pending += 1
        self._pool.submit(self._run, handle, list(keys))
        return handle

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- worker thread -------------------------------------------------------------------------
    def _run(self, handle: FetchHandle, keys: list[bytes]) -> None:
        try:
            self._fetch_and_decode(handle, keys)
        except Exception as e:  # thread boundary: any surprise is a miss for this request
            logger.warning("%s for %s failed unexpectedly: %r", self.label, handle.request_id, e)
            handle._fail_from(0, "internal")
        finally:
            with self._lock:
                self._pending -= 1
            if handle.failure is None:
                self._on_success(handle)
            handle._finish()
            if self._on_done is not None:
                self._on_done()

    def _on_success(self, handle: FetchHandle) -> None:
        pass

    def _chunk_error(self, handle: FetchHandle, i: int, key: bytes, e: ChunkError) -> None:
        """Chunk ``i`` (store key ``key``) failed to parse or decode: the hit ends before it; a damaged value
        (``CORRUPTION``) is also counted and logged as a corrupt store value (the store client's
        ``report_corrupt``: ``store_errors_total{op="get",kind="corrupt"}``)."""
        handle._fail_from(i, f"decode:{type(e).__name__}")
        if isinstance(e, CORRUPTION):
            self.client.report_corrupt(key, f"{self.label} codec", str(e))

    def _verify(self, handle: FetchHandle, keys: list[bytes], blobs: list) -> list:
        """Parse (header, checksum) every fetched chunk up front, cut the hit at the first bad one,
        publish ``handle.verified`` when all are good; return the good chunks' headers."""
        headers = []
        for i in range(handle.ok_chunks):
            try:
                headers.append(self.codec.parse(blobs[i], self.fingerprint))
            except ChunkError as e:
                self._chunk_error(handle, i, keys[i], e)
                break
            if headers[-1].num_tokens != handle.tokens[i]:
                handle._fail_from(i, "decode:chunk_size")
                headers.pop()
                break
        handle._mark_verified(blobs, headers, self._on_done)
        return headers

    def _fetch_and_decode(self, handle: FetchHandle, keys: list[bytes]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class FetchPath:
    """One way to get a prefix into the pool: a backend plus the codec it decodes. A path's chunks
    live under its codec's namespace (codec id + params are part of every key)."""

    name: PathName
    backend: FetchBackend
    codec: Codec
    closers: tuple = field(default=())  # extra resources to close with the backend (e.g. a pool)
    estimate: object = None  # the path's own fetch-time model for the policy (Policy.estimators), or None

    def close(self) -> None:
        self.backend.close()
        for c in self.closers:
            c.close()
