"""Layer-wise fetch/compute pipelining (``--remote-kv-layerwise``, off by default).

A request is released to SGLang once its chunks are verified, before every layer is decoded into its
host staging rows. ``LayerwiseInstalls`` tracks those installs per layer: the linker's load thread calls
``wait_until(layer)`` before it copies a layer from staging into the slots SGLang allocated
(``linker.RemoteKVLinker``), and SGLang's forward waits for that copy per layer through the linker's
layer counter. (It keeps ``wait_until`` and ``consumer_index`` of SGLang's ``LayerDoneCounter``, so a
pool's readers can wait on it directly, as the tests' pools do; SGLang itself never holds it -- its
``set_consumer`` calls go to the linker's counter -- so it has no ``set_consumer``.)

Safety rule: a fetched request is released before its KV is in the staging rows only when **every chunk's bytes
were fetched and verified** (the codec's ``parse`` checked header and checksums: the handle's
``verified`` event, with ``ok_chunks == n_chunks``). The remaining work is deterministic (decode +
dequant + scatter). ``wait_until(layer)`` then, for every pending install and every layer up to
``layer``: waits for the backend's per-layer completion and writes that layer from the path's staging
into the rows; if the backend failed, was cancelled, or makes no progress for ``stall_s``, it decodes the layer
from the already-fetched, verified blobs in-process (``codec.decode_layer_into``) instead. A decode
error there is impossible short of a codec bug; it raises, the linker fails the load (SGLang aborts
the request with a 503) rather than letting attention read wrong KV.

A non-direct path holds each layer in its handle and this class writes it into the rows through the
staging's ``KVWriter``. The DPU and NVDEC paths are *direct*: the DPU client's receiver thread (the
decoder pool's workers) write each layer (layer group) into the rows as it is ready (``layer_ready``,
set only after the write returned), so waiting is all this class does for them; the DPU's fallback blobs are host copies the
data plane made before signalling verified (``fetch/dpu.py``), and falling back cancels the client's
handle first (under the client's lock), after which the receiver never writes the rows again. The
in-process path is decoded *on demand* (``on_demand``): its worker is cancelled at admission and each
layer is decoded from the verified blobs in the load thread when first needed — a Python decode
thread running next to the forward pass suffers a GIL convoy (docs/results/INTEGRATION_NOTES.md). That
decode frees no buffer while a forward pass may run (``_DecodeBuffers``): freed codec bytes were handed
to attention's ``torch.empty`` padding and read as denormal floats (much slower attention, same notes).

A write of a staged layer that fails is retried once from the verified blobs (host decode); if that write
fails too the released request cannot be given correct KV and this raises (the load fails: a 503).

Threads: ``add``/``finish_all`` on the scheduler thread, ``wait_until`` on the linker's load thread; one
lock serialises them. Rows: held by the queue's staging entry from release; only this class writes them
until the install is complete.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from sgl_remote_kv.fetch.base import FetchHandle, LayerDecodeError, Scratch, decode_layer
from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.types import numpy_storage_dtype

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    handle: FetchHandle
    rows: object  # torch int64 tensor, one staging row per fetched token
    codec: object
    next_layer: int = 0
    fell_back: bool = False
    on_demand: bool = False  # decode each layer from the verified blobs when first needed
    admitted: float = field(default_factory=time.monotonic)
    decode_s: float = 0.0  # load-thread time spent decoding / writing this install's layers
    write_s: float = 0.0


class LayerwiseInstalls:
    """Per-layer completion of layer-wise installs into staging rows (see module docstring)."""

    @property
    def consumer_index(self) -> int:
        """SGLang reads this to decide whether to wait at all: a full prefill CUDA graph
        (``--cuda-graph-backend-prefill full``) replays without the pool accessors' per-layer waits and
        calls ``wait_until(num_layers - 1)`` before the replay only when it is >= 0; hybrid pools wait
        for their Mamba layers on the same condition. So: 0 while an install is pending, else -1."""
        return 0 if self._pending else -1

    def __init__(self, kv_writer, fingerprint, metrics, stall_s: float = 5.0) -> None:
        self.kv_writer, self.fingerprint, self.metrics = kv_writer, fingerprint, metrics
        self.num_layers = fingerprint.layout.num_layers
        self.stall_s = stall_s
        self._pending: list[_Pending] = []
        self._bufs = _DecodeBuffers(fingerprint.layout)  # lock held; see _DecodeBuffers
        self._lock = threading.Lock()

    # -- LayerDoneCounter surface --------------------------------------------------------------------
    def wait_until(self, threshold: int) -> None:
        if not self._pending:  # hot path of every forward pass: no lock
            return
        t0 = time.perf_counter()
        with self._lock:
            for p in self._pending:
                self._complete(p, threshold + 1)
            done = [p for p in self._pending if p.next_layer >= self.num_layers]
            self._pending = [p for p in self._pending if p.next_layer < self.num_layers]
        self.metrics.layerwise_wait(time.perf_counter() - t0)
        for p in done:
            logger.debug(
                "layer-wise install of %s complete %.3f s after admission (fallback %s; decode %.3f s, "
                "write %.3f s)",
                p.handle.request_id,
                time.monotonic() - p.admitted,
                p.fell_back,
                p.decode_s,
                p.write_s,
            )

    def reset(self) -> None:
        pass

    # -- scheduler side --------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self._pending)

    def add(self, handle: FetchHandle, rows, codec, on_demand: bool = False) -> None:
        with self._lock:
            self._pending.append(_Pending(handle, rows, codec, on_demand=on_demand))

    def finish_all(self) -> None:
        """Complete every pending install (start of each scheduling pass, before any row reuse)."""
        self.wait_until(self.num_layers - 1)

    # -- internals (lock held) -----------------------------------------------------------------------
    def _complete(self, p: _Pending, upto: int) -> None:
        while p.next_layer < min(upto, self.num_layers):
            layer = p.next_layer
            if p.on_demand:
                self._decode_layer(p, layer)
            elif not p.fell_back and self._wait_layer(p.handle, layer):
                if not getattr(p.handle, "direct", False):  # direct: already in the rows
                    h = p.handle
                    n = h.total_tokens
                    try:
                        self._write(p, layer, h.k[layer : layer + 1, :n], h.v[layer : layer + 1, :n])
                    except KVWriteError as e:
                        self.metrics.failure("write")
                        logger.warning(
                            "layer-wise write of %s failed (%s); decoding in-process", h.request_id, e
                        )
                        self._decode_layer(p, layer)
            else:
                if not p.fell_back:
                    p.fell_back = True
                    p.handle.cancel()
                    self.metrics.failure("layerwise_fallback")
                    logger.warning(
                        "layer-wise fetch %s: backend failed/stalled; decoding in-process",
                        p.handle.request_id,
                    )
                self._decode_layer(p, layer)
            self.kv_writer.wait_layer(layer)
            p.next_layer = layer + 1

    def _wait_layer(self, h: FetchHandle, layer: int) -> bool:
        """True when ``layer`` of every chunk is in staging; False on failure / cancel / stall."""
        deadline = time.monotonic() + self.stall_s
        while True:
            # layer first: workers cut ok_chunks *before* they advance layers_ready
            if h.layer_ready(layer):
                return not _broken(h)
            if _broken(h) or h.done() or time.monotonic() > deadline:
                return False
            h.wait(0.002)

    def _decode_layer(self, p: _Pending, layer: int) -> None:
        """``layer`` of every chunk from the verified blobs (``decode_layer``, the shared scratch), then into the
        rows: on a device pool whose codec has a device stage, codes per chunk (``write_quantized``: the
        dequant runs on the device, each chunk's codes written before the scratch is reused); else decoded
        K/V, one write for the layer."""
        t0 = time.perf_counter()
        h = p.handle
        on_device = self.kv_writer.device_dequant and p.codec.device_dequant
        k, v = (None, None) if on_device else self._bufs.kv(h.total_tokens)
        into = None if on_device else (lambda i: (k[h.span(i)], v[h.span(i)]))
        try:
            for item in decode_layer(p.codec, h.blobs, h.headers, layer, self._bufs.scratch, into):
                if on_device:
                    self._write_or_fail(
                        p, layer, self.kv_writer.write_quantized, [item[1]], p.rows[h.span(item[0])], layer
                    )
        except LayerDecodeError as e:
            self.metrics.failure("layerwise_decode_error")
            raise RuntimeError(
                f"verified chunk {e.index} of {h.request_id} failed to decode: {e.cause!r}"
            ) from e
        t1 = time.perf_counter()
        if not on_device:
            self._write_or_fail(p, layer, self.kv_writer.write, k[None], v[None], p.rows, layer)
        p.decode_s += t1 - t0
        p.write_s += time.perf_counter() - t1

    def _write_or_fail(self, p: _Pending, layer: int, write, *args) -> None:
        """``write(*args)`` (a ``kv_writer`` method); a failed write of a released install fails the load (a 503)."""
        try:
            write(*args)
        except KVWriteError as e:
            self.metrics.failure("write")
            raise RuntimeError(
                f"layer {layer} of admitted {p.handle.request_id} cannot be written: {e}"
            ) from e

    def _write(self, p: _Pending, layer: int, k, v) -> None:
        self.kv_writer.write(k, v, p.rows, layer)


class _DecodeBuffers:
    """Grow-only K/V staging for one layer and the codec's scratch, reused by every on-demand decode.

    Why: the decode runs while a forward pass waits for its layers. Buffers allocated and freed there go
    back to a malloc arena *with their bytes* (compressed / decoded codec
    bytes), and SGLang's ``torch_native`` extend attention allocates its padded query with
    ``torch.empty`` and runs SDPA over those rows: garbage that reads as denormal float32 made every
    attention layer much slower (docs/results/INTEGRATION_NOTES.md). So nothing is freed during a
    forward pass; a buffer outgrown (rare: a longer hit) is zeroed before it is dropped.
    Called under ``LayerwiseInstalls._lock`` only; the arrays are owned here and only lent out."""

    def __init__(self, layout) -> None:
        self._row = (layout.num_kv_heads, layout.head_dim)
        self._dtype = numpy_storage_dtype(layout.dtype)
        self._k = self._v = np.zeros((0, *self._row), self._dtype)
        self.scratch = Scratch()

    def kv(self, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        if self._k.shape[0] < tokens:
            for old in (self._k, self._v):
                old.fill(0)
            self._k, self._v = (np.zeros((tokens, *self._row), self._dtype) for _ in range(2))
        return self._k[:tokens], self._v[:tokens]


def _broken(h: FetchHandle) -> bool:
    """Some chunk failed or the fetch was cancelled (the DPU handle knows before it is done)."""
    broken = getattr(h, "broken", None)
    if broken is not None:
        return broken()
    return h.ok_chunks < h.n_chunks or h.failure is not None
