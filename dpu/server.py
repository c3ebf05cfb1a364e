"""The data-plane process: a ZeroMQ ROUTER front end, round admission, and the pipeline.

Threads: the *server thread* (the process's main thread, ``DataPlaneServer.run``) owns the sockets,
the job table, the pending-round queue and the free-slot list; it is the only thread touching them.
Pipeline workers send their completions back through per-thread PUSH sockets on an inproc endpoint
that the server thread polls, so no ZeroMQ socket is ever shared between threads.

Ownership: the staging buffers and the store client belong to this process; the destination region
belongs to the host (attached here by name, never unlinked here).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.types import KVLayout, ModelFingerprint

from . import protocol as P
from .buffers import DestRegion, StagingBuffers, layer_bytes, plan_rounds
from .pipeline import Pipeline
from .settings import DataPlaneSettings
from .tasks import JobState

logger = logging.getLogger(__name__)

_SLOT_FREE = b"slot"
_EVENTS = "inproc://dpu-events"


@dataclass(frozen=True)
class DataPlaneConfig:
    """Where this data plane serves and for whom, plus its ``DataPlaneSettings``; built once at the CLI
    edge (``__main__``)."""

    endpoint: str
    store_url: str
    dest_name: str
    settings: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    max_jobs: int = 1024
    max_active_chunks: int = 1 << 16  # over all active jobs: bounds the job table's memory
    parent_pid: int = 0  # when set, exit as soon as this process is no longer our parent
    warm: P.Warmup | None = None  # decoded once before serving (``DataPlaneServer.warm_up``)


class DataPlaneServer:
    def __init__(self, cfg: DataPlaneConfig) -> None:
        from sgl_remote_kv.store.client import ClientConfig, open_client

        self.cfg = cfg
        st = cfg.settings
        if st.cpus:
            try:
                os.sched_setaffinity(0, st.cpus)
            except OSError as e:  # e.g. a core outside our cpuset: serve unpinned, say so
                logger.error("cannot pin the data plane to cores %s: %s; running unpinned", st.cpus, e)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # completions are small; never drop one
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES + 1024)
        self.router.bind(cfg.endpoint)
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(_EVENTS)
        self._push_sock = self.ctx.socket(zmq.PUSH)
        self._push_sock.setsockopt(zmq.LINGER, 0)
        self._push_sock.setsockopt(zmq.SNDHWM, 0)
        self._push_sock.connect(_EVENTS)
        self._push_lock = threading.Lock()
        self.dest = DestRegion.attach(cfg.dest_name)
        self.buffers = StagingBuffers(st.slots, st.slot_bytes, st.inflate_ratio)
        self.store = open_client(cfg.store_url, ClientConfig(timeout_s=st.store_timeout_s))
        self.pipeline = Pipeline(
            st.pipeline(), self.buffers, self.dest.array, self.store, self._emit, self._slot_freed
        )
        self.jobs: dict[int, JobState] = {}
        self.pending: deque[tuple[JobState, list]] = deque()
        self.free_slots = list(range(st.slots))
        self._codecs: dict[tuple[str, bytes], object] = {}
        self._stop = False
        self.counters = {"submitted": 0, "rejected": 0, "bad_frames": 0, "cancels": 0, "handler_errors": 0}
        self.peers: set[bytes] = set()

    # ---- called from any thread -------------------------------------------------------------------
    def _push(self, frames: list[bytes]) -> None:
        # One socket under one lock: events reach the host in the order workers emitted them (a
        # chunk's LayerDone always precedes its ChunkDone and the job's JobDone).
        with self._push_lock:
            self._push_sock.send_multipart(frames)

    def _emit(self, peer: bytes, msg: P.Message) -> None:
        self._push([peer, P.encode(msg)])

    def _slot_freed(self, slot: int) -> None:
        self._push([_SLOT_FREE, slot.to_bytes(4, "little")])

    # ---- server thread ----------------------------------------------------------------------------
    def request_stop(self, *_: object) -> None:
        self._stop = True

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or ``request_stop``); then shut down cleanly."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        self.warm_up()
        logger.info("data plane pid %d serving on %s", os.getpid(), self.cfg.endpoint)
        try:
            while not self._stop:
                ready = dict(poller.poll(100))
                if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                    logger.warning("parent %d is gone; exiting", self.cfg.parent_pid)
                    break
                if self.events in ready:
                    self._drain_events()
                if self.router in ready:
                    self._drain_router()
        finally:
            self.close()

    def _drain_events(self) -> None:
        while True:
            try:
                frames = self.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[0] == _SLOT_FREE:
                self.free_slots.append(int.from_bytes(frames[1], "little"))
                self._admit()
                continue
            msg = P.decode(frames[1])
            if isinstance(msg, P.JobDone):
                self.jobs.pop(msg.job, None)
            self.router.send_multipart(frames, zmq.NOBLOCK)

    def _drain_router(self) -> None:
        P.drain(self.router, self._on_message, self._bad_frame, parts=2)

    def _bad_frame(self, reason: str) -> None:
        self.counters["bad_frames"] += 1
        logger.warning("dropping bad frame from peer: %s", reason)

    def _on_message(self, head: list[bytes], msg: P.Message) -> None:
        peer = head[0]
        self.peers.add(peer)
        try:
            self._handle(peer, msg)
        except Exception:  # process boundary: a message must never take the server thread down
            self.counters["handler_errors"] += 1
            logger.exception("handling %s failed", type(msg).__name__)
            if isinstance(msg, P.SubmitFetch):
                self.jobs.pop(msg.job, None)
                self._reject(peer, msg, "internal error")

    def _handle(self, peer: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.Heartbeat):
            stats = {"pipeline": self.pipeline.stats_snapshot(), **self.counters}
            stats["cpus"] = sorted(os.sched_getaffinity(0))  # effective affinity (benchmarks check it)
            pong = P.Pong(msg.seq, msg.sent_ns, os.getpid(), len(self.jobs), json.dumps(stats).encode())
            self.router.send_multipart([peer, P.encode(pong)], zmq.NOBLOCK)
        elif isinstance(msg, P.SubmitFetch):
            self._submit(peer, msg)
        elif isinstance(msg, P.Cancel):
            self._cancel(msg)
        else:
            self.counters["bad_frames"] += 1

    def _reject(self, peer: bytes, msg: P.SubmitFetch, detail: str) -> None:
        self.counters["rejected"] += 1
        logger.warning("rejecting job %d: %s", msg.job, detail)
        for i in range(len(msg.chunks)):
            self.router.send_multipart([peer, P.encode(P.ChunkFailed(msg.job, i, "bad_request", detail))])
        self.router.send_multipart([peer, P.encode(P.JobDone(msg.job, 0, len(msg.chunks)))])

    def _submit(self, peer: bytes, msg: P.SubmitFetch) -> None:
        try:
            job, rounds = self._prepare(peer, msg)
        except (ValueError, KeyError, TypeError, ChunkError) as e:
            self._reject(peer, msg, str(e)[:400])
            return
        self.counters["submitted"] += 1
        self.jobs[msg.job] = job
        for r in rounds:
            self.pending.append((job, r))
        self._admit()

    def _prepare(self, peer: bytes, msg: P.SubmitFetch) -> tuple[JobState, list]:
        if msg.job in self.jobs:
            raise ValueError(f"job id {msg.job} already active")
        if len(self.jobs) >= self.cfg.max_jobs:
            raise ValueError("too many active jobs")
        if sum(len(j.dests) for j in self.jobs.values()) + len(msg.chunks) > self.cfg.max_active_chunks:
            raise ValueError("too many active chunks")
        if msg.dest_name != self.dest.name.lstrip("/"):
            raise ValueError(f"unknown destination {msg.dest_name!r}")
        if msg.blob_off + msg.blob_cap > self.dest.size:
            raise ValueError("blob area outside the destination region")
        fp = _fingerprint(msg.fingerprint)
        layout = fp.layout
        for c in msg.chunks:
            end = layer_bytes(layout, c.tokens) + (layout.num_layers - 1) * c.layer_stride
            if max(c.k_off, c.v_off) + end > self.dest.size or c.layer_stride < layer_bytes(layout, c.tokens):
                raise ValueError("chunk destination outside the destination region")
        codec = self._codec(msg.codec, msg.codec_params)
        job = JobState(msg.job, peer, codec, fp, layout, list(msg.chunks), (msg.blob_off, msg.blob_cap))
        ratio = self.cfg.settings.inflate_ratio
        rounds = plan_rounds([c.tokens for c in msg.chunks], layout, self.cfg.settings.slot_bytes, ratio)
        return job, rounds

    def warm_up(self) -> None:
        """Decode one synthetic chunk of ``cfg.warm``'s codec and model (before ``run`` answers its first
        ping, so the host's ``wait_ready`` covers it). A failure is logged and costs only the first job's
        latency: the data plane serves all the same."""
        w = self.cfg.warm
        if w is None:
            return
        t0 = time.perf_counter()
        try:
            self._codec(w.codec, w.codec_params.encode()).warm_up(_fingerprint(w.fingerprint))
        except (ValueError, KeyError, ChunkError) as e:  # unknown codec, bad params, no tables, ...
            logger.warning("warm-up of codec %s failed (%r); the first job loads its kernels", w.codec, e)
            return
        logger.info("warmed up codec %s in %.0f ms", w.codec, (time.perf_counter() - t0) * 1000)

    def _codec(self, name: str, params: bytes):
        key = (name, params)
        if key not in self._codecs:
            kwargs = json.loads(params) if params else {}
            if not isinstance(kwargs, dict):
                raise ValueError("codec params must be a JSON object")
            codec = get_codec(name, **kwargs)
            if params and codec.params_bytes() != params:
                raise ValueError("codec params are not canonical")
            self._codecs[key] = codec
        return self._codecs[key]

    def _cancel(self, msg: P.Cancel) -> None:
        self.counters["cancels"] += 1
        job = self.jobs.get(msg.job)
        if job is None:
            return
        job.cancel(msg.from_chunk)
        keep: deque = deque()
        for j, regions in self.pending:  # chunks not admitted yet are finished right here
            if j is not job:
                keep.append((j, regions))
                continue
            live = [r for r in regions if r.index < job.cancel_from]
            for r in regions[len(live) :]:
                self._finish_unadmitted(job, r.index)
            if live:
                keep.append((j, live))
        self.pending = keep

    def _finish_unadmitted(self, job: JobState, index: int) -> None:
        with job.lock:
            job.terminal += 1
            job.failed += 1
            over = job.terminal == len(job.dests)
        self.router.send_multipart([job.peer, P.encode(P.ChunkFailed(job.job, index, "cancelled", ""))])
        if over:
            self.jobs.pop(job.job, None)
            self.router.send_multipart([job.peer, P.encode(P.JobDone(job.job, job.done, job.failed))])

    def _admit(self) -> None:
        while self.free_slots and self.pending:
            job, regions = self.pending.popleft()
            self.pipeline.submit_round(job, regions, self.free_slots.pop())

    def close(self) -> None:
        logger.info("data plane shutting down")
        self.pipeline.close()
        self.store.close()
        with self._push_lock:
            self._push_sock.close(0)
        self.events.close(0)
        self.router.close(0)
        self.ctx.term()
        self._unlink_orphaned_region()
        self.dest.close()

    def _unlink_orphaned_region(self) -> None:
        """A host that dies without ``DpuClient.close`` (SGLang's shutdown never calls it; SIGTERM to the
        server's process group) leaks the destination region's shm (128 MiB+) for good: unlink it when
        our host is gone. ``DpuClient.close`` unlinks the name before SIGTERMing us (no wait then); an
        external SIGTERM with the host alive leaves it alone (the host restarts us into it)."""
        pid = self.cfg.parent_pid
        if not pid:
            return
        deadline = time.monotonic() + 1.0
        while os.getppid() == pid and self.dest.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() != pid:
            logger.warning("host %d is gone; unlinking its destination region %s", pid, self.dest.name)
            self.dest.unlink()


def _fingerprint(w: P.Fingerprint) -> ModelFingerprint:
    """The model fingerprint a wire ``Fingerprint`` names; ``ValueError`` if its digest does not match."""
    layout = KVLayout(w.layout.num_layers, w.layout.num_kv_heads, w.layout.head_dim, w.layout.dtype)
    fp = ModelFingerprint(w.architecture, layout, w.weights_id, w.tp_rank, w.tp_size)
    if fp.digest() != w.digest:
        raise ValueError("fingerprint digest does not match its fields")
    return fp
