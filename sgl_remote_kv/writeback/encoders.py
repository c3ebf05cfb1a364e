"""The write-back's encoder processes: a host encode that runs outside the scheduler process.

``HostEncode(codec, fingerprint, pool)`` is what the write-back calls: a host encode in ``pool``'s processes
while they serve, else in the calling thread. ``EncoderPool(codec, fingerprint, slot_tokens, processes,
nice)`` spawns ``processes`` encoder processes
(``encoder_process.py``), each with its own Unix socket and its own slot (a shared memory file holding K and
V of one chunk of at most ``slot_tokens`` tokens). ``encode(k, v, start)`` takes a free encoder, copies the
chunk into its slot, asks for the encode and returns the blob (and the encoder's CPU-seconds for it, which
the write-back paces by): the bytes ``codec.encode`` returns in this
process (the encoder runs the same codec, built from its name and canonical params). The frames are
``wire.py``'s; nothing is pickled. Each encoder is one core's worth: its numeric libraries run one thread.

Failures: ``start`` raises ``EncoderUnavailable`` when an encoder cannot start (its process exits, or its
codec cannot be built there, e.g. a calibration this process registered but never saved: ``Ready.error``);
the write-back then encodes in its own threads. An encoder lost later (killed, crashed, a frame that is not
ours, no answer within ``reply_timeout_s``) raises ``EncoderLost`` from that ``encode``, is stopped, and is
started afresh on its next use; when that fresh start fails, that ``encode`` (and every later one) raises
``EncoderUnavailable`` without trying again, and the write-back encodes in its own threads from then on. A
chunk its codec refuses raises ``EncodeRefused``.

Threads: ``encode`` from any thread (the write-back's worker and encoder threads); each encoder serves one
call at a time (a queue of free encoders; a caller waits for one). ``start`` and ``close`` from one thread,
``close`` with no ``encode`` in flight (the write-back's worker closes the pool after its last job).
Buffers: the caller keeps its ``k``/``v``; the slot is the pool's, overwritten by the next call.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import socket
import subprocess
import sys
import threading

import numpy as np

from sgl_remote_kv import env
from sgl_remote_kv.codec.base import check_chunk_arrays
from sgl_remote_kv.types import KVLayout, ModelFingerprint
from sgl_remote_kv.writeback import wire

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # an encoder's interpreter, numpy, numba and codec imports
REPLY_TIMEOUT_S = 300.0  # one chunk's encode at the lowest priority on a busy host
STOP_GRACE_S = 2.0


class EncoderUnavailable(RuntimeError):
    """An encoder process could not start (the write-back encodes in-process instead)."""


class EncoderLost(RuntimeError):
    """An encoder process stopped answering during an encode (the chunk was not encoded)."""


class EncodeRefused(ValueError):
    """The encoder's codec refused the chunk (the same exception an in-process encode raises, in words)."""


class _Encoder:
    """One encoder process, its socket and its slot."""

    def __init__(self, hello: wire.Hello, layout: KVLayout) -> None:
        self.hello, self.layout = hello, layout
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.slot: mmap.mmap | None = None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = os.memfd_create("srkv-writeback-slot", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.hello.slot_bytes)
            self.slot = mmap.mmap(fd, self.hello.slot_bytes)
            cmd = [sys.executable, "-m", "sgl_remote_kv.writeback.encoder_process"]
            cmd += ["--sock", str(theirs.fileno()), "--slot", str(fd)]
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(), fd), env=env.single_threaded_env()
            )
        finally:
            theirs.close()
            os.close(fd)
        self.sock = ours
        ours.settimeout(START_TIMEOUT_S)
        try:
            wire.send(ours, self.hello)
            ready = wire.recv(ours)
        except (EOFError, OSError, wire.WireError) as e:
            self.stop()
            raise EncoderUnavailable(f"the encoder process did not start: {type(e).__name__}: {e}") from None
        if not isinstance(ready, wire.Ready) or ready.error:
            self.stop()
            why = ready.error if isinstance(ready, wire.Ready) else f"answered {type(ready).__name__}"
            raise EncoderUnavailable(f"the encoder process cannot encode: {why}")
        ours.settimeout(REPLY_TIMEOUT_S)

    @property
    def started(self) -> bool:
        return self.proc is not None

    def encode(self, k: np.ndarray, v: np.ndarray, start: int) -> tuple[bytes, float]:
        check_chunk_arrays(k, v, self.layout)  # the encoder reads the slot as this layout's chunk
        n = k.nbytes
        if 2 * n > self.hello.slot_bytes:
            raise ValueError(
                f"{k.shape[1]} tokens do not fit the encoder's {self.hello.slot_bytes}-byte slot"
            )
        mem = np.frombuffer(self.slot, np.uint8)
        np.copyto(mem[:n].view(k.dtype).reshape(k.shape), k)
        np.copyto(mem[n : 2 * n].view(v.dtype).reshape(v.shape), v)
        del mem  # no export of the slot outlives the call (``stop`` closes the map)
        try:
            wire.send(self.sock, wire.Encode(tokens=k.shape[1], start=start))
            reply = wire.recv(self.sock, 2 * self.hello.slot_bytes + wire.CONTROL_FRAME_BYTES)
        except (EOFError, OSError, wire.WireError) as e:
            raise EncoderLost(f"{type(e).__name__}: {e}") from None
        if not isinstance(reply, wire.Encoded):
            raise EncoderLost(f"answered {type(reply).__name__} to Encode")
        if reply.error:
            raise EncodeRefused(reply.error)
        return reply.blob, reply.cpu_s

    def stop(self) -> None:
        """Close the socket (the encoder's EOF), reap it (SIGKILL after ``STOP_GRACE_S``); idempotent."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        p, self.proc = self.proc, None
        if p is not None:
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.slot is not None:
            self.slot.close()
            self.slot = None


class EncoderPool:
    """See module docstring."""

    def __init__(
        self, codec, fingerprint: ModelFingerprint, slot_tokens: int, processes: int = 1, nice: int = 0
    ):
        slot_bytes = slot_tokens * fingerprint.layout.bytes_per_token()  # K and V of one chunk
        hello = wire.Hello(
            codec=codec.name,
            codec_params=codec.params_bytes().decode(),
            fingerprint=fingerprint.canonical().decode(),
            slot_bytes=slot_bytes,
            nice=nice,
        )
        self._all = [_Encoder(hello, fingerprint.layout) for _ in range(max(1, processes))]
        self._free: queue.SimpleQueue[_Encoder] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards ``closed`` and ``unavailable`` against a concurrent restart
        self.closed = False
        self.unavailable: EncoderUnavailable | None = None  # why a lost encoder could not start again

    @property
    def processes(self) -> int:
        return len(self._all)

    def pids(self) -> list[int]:
        return [e.proc.pid for e in self._all if e.proc is not None]

    def start(self) -> None:
        """Start every encoder; ``EncoderUnavailable`` (and none left running) when one cannot start."""
        try:
            for e in self._all:
                e.start()
        except EncoderUnavailable:
            self.close()
            raise
        for e in self._all:
            self._free.put(e)

    def encode(self, k: np.ndarray, v: np.ndarray, start: int) -> tuple[bytes, float]:
        """``codec.encode(k, v, fingerprint, start=start)`` in an encoder process (see module docstring), and
        the CPU-seconds the encoder spent on it."""
        e = self._free.get()
        try:
            with self._lock:
                if self.closed:
                    raise EncoderLost("the encoder pool is closed")
                if self.unavailable is not None:
                    raise self.unavailable
                if not e.started:  # lost earlier: a fresh process
                    try:
                        e.start()
                    except EncoderUnavailable as err:
                        self.unavailable = err
                        raise
            try:
                return e.encode(k, v, start)
            except EncoderLost:
                logger.warning(
                    "write-back encoder pid %s lost; a new one starts on next use", e.proc and e.proc.pid
                )
                e.stop()
                raise
        finally:
            self._free.put(e)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        for e in self._all:
            e.stop()


class HostEncode:
    """A host encode: in ``pool``'s encoder processes while they serve, else in the calling thread (no pool,
    a pool that could not start, or a lost encoder that could not start again: each switch logged once, with
    why; a pool given up on is closed with this). Threads: ``start`` and ``close`` on the write-back's worker
    thread; ``encode`` from any of its threads."""

    def __init__(self, codec, fingerprint: ModelFingerprint, pool: EncoderPool | None) -> None:
        self.codec, self.fingerprint = codec, fingerprint
        self._pool, self._left = pool, []
        self._lock = threading.Lock()  # guards ``_pool`` and ``_left`` against two threads leaving at once

    def start(self) -> None:
        pool = self._pool
        if pool is None:
            return
        try:
            pool.start()
            logger.info(
                "remote-kv write-back encodes in %d process(es), pids %s", pool.processes, pool.pids()
            )
        except EncoderUnavailable as e:
            logger.warning("remote-kv write-back encodes in the scheduler process: %s", e)
            self._pool = None

    @property
    def pool(self) -> EncoderPool | None:
        """The pool that serves the encode (None: this process encodes)."""
        return self._pool

    def pids(self) -> list[int]:
        pool = self._pool
        return pool.pids() if pool is not None else []

    def encode(self, k: np.ndarray, v: np.ndarray, start: int) -> tuple[bytes, float | None]:
        """The chunk's blob and, from an encoder process, the CPU-seconds it spent (None: encoded here)."""
        pool = self._pool
        if pool is not None:
            try:
                return pool.encode(k, v, start)
            except EncoderUnavailable as e:  # a lost encoder could not start again: encode here from now on
                self._leave(pool, e)
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        return self.codec.encode(k, v, self.fingerprint, start=start), None

    def _leave(self, pool: EncoderPool, why: EncoderUnavailable) -> None:
        """``pool``'s encoders are stopped by ``close``, not here, where other threads may still encode."""
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
            self._left.append(pool)
        logger.warning("remote-kv write-back encodes in the scheduler process from now on: %s", why)

    def close(self) -> None:
        for pool in (self._pool, *self._left):
            if pool is not None:
                pool.close()
