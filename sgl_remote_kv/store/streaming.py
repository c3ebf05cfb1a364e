"""A store value read in pieces: what ``StoreClient.stream_get`` hands out.

``StreamedGet.pieces()`` yields the value's *payload* bytes (store framing stripped, ``framing.FrameReader``)
as they arrive, so a consumer can start on the front of a value while the rest is on the wire. When the
generator ends, ``outcome`` says what it was worth:

- ``OK``: every payload byte arrived and the frame's length and CRC (over key and payload) passed. Only
  then may the consumer *publish* anything it derived from the pieces: each piece is unverified on its
  own (a value framed for another key, or rewritten between pieces, fails only at the end);
- ``ABSENT`` (no value), ``CORRUPT`` (not a valid frame, longer than ``max_bytes``, or the CRC failed;
  the client deletes it best-effort), ``FAILED`` (the store call failed or timed out: ``error`` holds the
  store client's error kind), ``ABORTED`` (the consumer closed the generator early).

Like every ``StoreClient`` call it never raises and has a deadline: ``timeout_s`` plus the value's bytes at
the client's slowest tolerated rate. A failure before the first payload byte is retried (the client's
``retries``); after it, never (the consumer may be decoding the front already).

Threads: the backend's ``stream_get`` runs on the client's worker pool (a producer) and passes pieces through
a queue; ``pieces()`` runs on the consumer's thread, which alone touches the frame reader and sees the
pieces. A producer whose consumer left stops at its next piece (the backend then drops its connection).
Buffers: each piece is a fresh ``bytes`` owned by the consumer.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .framing import FrameError, FrameReader

_END = object()
_RETRYABLE = frozenset({"timeout", "unavailable"})


class StreamOutcome(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    ABSENT = "absent"
    CORRUPT = "corrupt"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class StreamPlan:
    """What the client fixes for one streamed get."""

    piece_bytes: int
    max_bytes: int  # longest acceptable payload; a longer frame is CORRUPT before it is read
    timeout_s: float  # fixed part of the deadline
    min_bytes_s: float  # slowest tolerated rate: the deadline grows by payload bytes / this
    expect_bytes: float  # payload size assumed for the deadline until the frame header says
    retries: int
    backoff_s: float


class StreamedGet:
    """One streamed get; see the module docstring. Built by ``StoreClient.stream_get`` only."""

    def __init__(
        self,
        key: bytes,
        plan: StreamPlan,
        open_stream: Callable[[], Iterator[bytes]],
        submit: Callable[..., object],
        classify: Callable[[BaseException], str],
        on_done: Callable[[StreamedGet, float], None],
    ) -> None:
        self.key, self.plan = key, plan
        self._open, self._submit, self._classify, self._on_done = open_stream, submit, classify, on_done
        self.outcome = StreamOutcome.PENDING
        self.error = ""  # the store client's error kind (FAILED), or why a value is CORRUPT
        self.detail = ""  # FAILED: the failure's own message (for the log)
        self.payload_len: int | None = None
        self.received = 0
        self.attempts = 0

    def pieces(self) -> Iterator[memoryview]:
        t0 = time.perf_counter()
        try:
            for attempt in range(self.plan.retries + 1):
                self.attempts = attempt + 1
                yielded = yield from self._attempt()
                if self.outcome is not StreamOutcome.FAILED or yielded or self.error not in _RETRYABLE:
                    break
                if attempt < self.plan.retries:
                    time.sleep(self.plan.backoff_s * (2**attempt))
                    self.outcome, self.error = StreamOutcome.PENDING, ""
        except GeneratorExit:
            self.outcome = StreamOutcome.ABORTED
            raise
        finally:
            if self.outcome is StreamOutcome.PENDING:
                self.outcome = StreamOutcome.ABORTED
            self._on_done(self, time.perf_counter() - t0)

    def _attempt(self) -> Iterator[memoryview]:
        """One backend call; sets ``outcome`` (PENDING only if the consumer left); True if bytes were yielded."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        try:
            self._submit(_produce, self._open, q, stop)
        except RuntimeError:  # the client's pool is shut down
            self._set(StreamOutcome.FAILED, "closed")
            return False
        reader, yielded, got_any = FrameReader(self.key), False, False
        p = self.plan
        deadline = time.monotonic() + p.timeout_s + p.expect_bytes / p.min_bytes_s
        try:
            while True:
                try:
                    item = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    return self._set(StreamOutcome.FAILED, "timeout", yielded)
                if item is _END:
                    if not got_any:
                        return self._set(StreamOutcome.ABSENT, "", yielded)
                    try:
                        reader.finish()
                    except FrameError as e:
                        return self._set(StreamOutcome.CORRUPT, str(e), yielded)
                    return self._set(StreamOutcome.OK, "", yielded)
                if isinstance(item, BaseException):
                    self.detail = str(item)
                    return self._set(StreamOutcome.FAILED, self._classify(item), yielded)
                got_any = True
                known = reader.payload_len is not None
                try:
                    data = reader.feed(item)
                except FrameError as e:
                    return self._set(StreamOutcome.CORRUPT, str(e), yielded)
                if not known and reader.payload_len is not None:
                    if reader.payload_len > p.max_bytes:
                        return self._set(StreamOutcome.CORRUPT, f"a {reader.payload_len}-byte value", yielded)
                    self.payload_len = reader.payload_len
                    deadline += (reader.payload_len - p.expect_bytes) / p.min_bytes_s
                if len(data):
                    self.received = reader.received
                    yielded = True
                    yield data
        finally:
            stop.set()

    def _set(self, outcome: StreamOutcome, error: str, yielded: bool = False) -> bool:
        self.outcome, self.error = outcome, error
        return yielded


def _produce(open_stream: Callable[[], Iterator[bytes]], q: queue.SimpleQueue, stop: threading.Event) -> None:
    """The producer (a client pool thread): the backend's pieces into ``q``, then ``_END`` or the exception."""
    try:
        gen = open_stream()
        try:
            for piece in gen:
                if stop.is_set():
                    return
                q.put(piece)
        finally:
            gen.close()
        q.put(_END)
    except Exception as e:  # a thread boundary: the consumer classifies and counts it
        q.put(e)
