"""Host-side per-request fetch state: ``ClientFetch`` (what ``fetch/dpu.py``'s ``DpuFetchHandle`` wraps), host rounds.

A request's chunks (a prefix, in order) are cut into *host rounds* that each fit one slot of the shared
destination region; each host round is one data-plane job. A chunk that fails makes it and every later
chunk a miss (``first_fail``); completions past it are ignored.

Threads: handles are mutated only by the DPU client's receiver thread (and ``submit``/``cancel`` on the
caller's thread), always under the client's condition variable ``cv``; the SGLang thread reads them via
``wait``/``wait_layer``/``result``. The destination bytes a round points at belong to the client.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

import torch

from sgl_remote_kv.kvpool import KVWriter

PENDING, DONE, FAILED = 0, 1, 2


@dataclass(frozen=True)
class KVTarget:
    """Where a request's fetched KV goes: a ``KVWriter`` (in the server: the host staging's, a
    ``kvpool.rows.RowStore``) and its rows (host ``int64 [tokens]``, one per token of the fetched prefix,
    in order)."""

    writer: KVWriter
    rows: torch.Tensor


@dataclass(frozen=True)
class FetchResult:
    """Outcome of a fetch: the first ``hit_chunks`` chunks (``hit_tokens`` tokens) are in the target's
    rows."""

    request_id: str
    hit_chunks: int
    hit_tokens: int
    num_chunks: int
    failures: dict[int, str]  # chunk index -> kind (ChunkFailed kinds)
    elapsed_s: float
    wire_bytes: int = 0  # compressed bytes the data plane fetched for the hit chunks


class LayerWrite(enum.IntEnum):
    """One layer of one chunk of a round on its way into the target's rows: not in the destination region
    yet (``ABSENT``), there but not handed out (``WAITING``), queued for or in the receiver thread's write
    outside the lock (``QUEUED``), in the rows (``WRITTEN``)."""

    ABSENT = 0
    WAITING = 1
    QUEUED = 2
    WRITTEN = 3


@dataclass
class HostRound:
    handle: ClientFetch
    chunk_lo: int
    chunk_hi: int
    token_lo: int  # first token of this round within the request
    tokens: int
    slot: int = -1
    job: int = 0
    last_event: float = 0.0
    chunk_layers: list[bytearray] = field(
        default_factory=list
    )  # per chunk of the round, per layer: LayerWrite
    code_lengths: list[list[int]] = field(
        default_factory=list
    )  # fetched as codes: per chunk, per layer, bytes
    terminal: bool = False


class ClientFetch:
    """One fetch submitted to the data plane (the fetch paths' ``FetchHandle`` is ``fetch/base.py``'s; the
    DPU path's wraps this one). Read by the caller; mutated by the client under ``cv``."""

    def __init__(
        self,
        cv: threading.Condition,
        request_id: str,
        keys: list[bytes],
        chunk_tokens: list[int],
        num_layers: int,
        target: KVTarget | None,
        codes: bool = False,
    ) -> None:
        self._cv = cv
        self.request_id, self.keys, self.chunk_tokens = request_id, keys, chunk_tokens
        self.num_layers, self.target = num_layers, target
        # the data plane writes the codec's lossless output, the target's writer dequantizes (``round_io``)
        self.codes = codes
        self.output = "codes" if codes else "kv"  # ``SubmitFetch.output``, the metrics' label
        self.state = [PENDING] * len(keys)
        self.layers_seen = [0] * len(keys)  # per chunk: layers reported done
        self.failures: dict[int, str] = {}
        self.wire_bytes = [0] * len(keys)
        self.first_fail = len(keys)
        self.written = [
            bytearray(num_layers) for _ in keys
        ]  # per chunk, per layer: 1 once the write returned
        self.layer_ready = [0] * num_layers  # per layer: leading chunks whose layer is written
        self.rounds: list[HostRound] = []
        self.cancelled = False
        self.writing = 0  # layer runs queued for or in a write into the rows (the handle finishes after)
        self.finished = False
        self.t0 = time.monotonic()
        self.t_done = 0.0
        # Layer-wise admission: host copies of the verified compressed blobs (and their parsed headers),
        # filled per round on ``ChunksVerified``; ``verified`` is set once every chunk has one.
        self.blobs: list[bytes | None] = [None] * len(keys)
        self.headers: list[object] = [None] * len(keys)
        self.verified = threading.Event()
        self.verified_bytes = 0
        self.verified_s = 0.0

    # ---- caller API (any thread) -------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def wait(self, timeout: float | None = None) -> FetchResult | None:
        """Block until every chunk is terminal; the result, or ``None`` on timeout."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.finished, timeout):
                return None
            return self._result()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until ``layer`` of every chunk of the hit prefix is written (or the fetch is over).

        Returns False on timeout. After True, ``hit_chunks_now()`` bounds the usable prefix; the final
        prefix is ``wait().hit_chunks`` (it can only shrink while chunks are in flight)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        with self._cv:
            return self._cv.wait_for(
                lambda: self.finished or self.layer_ready[layer] >= self.first_fail, timeout
            )

    def layer_is_ready(self, layer: int) -> bool:
        """Non-blocking ``wait_layer(layer, 0)``."""
        with self._cv:
            return self.finished or self.layer_ready[layer] >= self.first_fail

    def hit_chunks_now(self) -> int:
        with self._cv:
            return self.first_fail

    def result(self) -> FetchResult | None:
        with self._cv:
            return self._result() if self.finished else None

    # ---- client side (under cv) --------------------------------------------------------------------
    def _result(self) -> FetchResult:
        """The hit ends at the first failed chunk, and before the first chunk whose layers were not all
        written into the target's rows (a finished chunk whose write never ran is not a hit)."""
        hit = self.first_fail
        if self.target is not None:
            hit = min(hit, *self.layer_ready)
        return FetchResult(
            self.request_id,
            hit,
            sum(self.chunk_tokens[:hit]),
            len(self.keys),
            dict(self.failures),
            (self.t_done or time.monotonic()) - self.t0,
            sum(self.wire_bytes[:hit]),
        )

    def set_verified(self, lo: int, blobs: list[bytes], headers: list) -> bool:
        """Record host copies of chunks ``lo ..``; True when this made every chunk verified."""
        if self.cancelled or self.first_fail < len(self.keys) or self.verified.is_set():
            return False
        self.blobs[lo : lo + len(blobs)] = blobs
        self.headers[lo : lo + len(headers)] = headers
        if any(b is None for b in self.blobs):
            return False
        self.verified_bytes = sum(len(b) for b in self.blobs)
        self.verified_s = time.monotonic() - self.t0
        self.verified.set()
        return True

    def mark_written(self, lo: int, hi: int, layer_lo: int, layer_hi: int) -> None:
        """Layers ``layer_lo..layer_hi`` of chunks ``lo..hi`` are in the target's rows; advances
        ``layer_ready``."""
        for c in range(lo, hi):
            self.written[c][layer_lo:layer_hi] = b"\x01" * (layer_hi - layer_lo)
        n = len(self.keys)
        for layer in range(layer_lo, layer_hi):
            while self.layer_ready[layer] < n and self.written[self.layer_ready[layer]][layer]:
                self.layer_ready[layer] += 1

    def mark_failed(self, index: int, kind: str) -> None:
        """Chunk ``index`` failed (also a chunk the data plane finished whose write into the rows failed)."""
        if self.state[index] != FAILED:
            self.state[index] = FAILED
            self.failures[index] = kind
        self.first_fail = min(self.first_fail, index)

    def check_finished(self) -> bool:
        if not self.finished and not self.writing and all(r.terminal for r in self.rounds):
            self.finished = True
            self.t_done = time.monotonic()
        return self.finished
