"""The DPU client: the host side of the DPU data plane; lives in the SGLang scheduler process.

``DpuClient`` creates the shared destination region, spawns ``python -m sgl_remote_kv.dpu`` as its own
process (pinned away from the serving cores when the machine has enough) -- or, with
``DpuClientConfig.endpoint``, attaches to a data-plane service shared by every rank and server of the
host --, registers its region, fingerprint and codec with it (``protocol.Register``), and runs one background
*receiver thread* that owns the ZeroMQ socket: it sends queued submissions, heartbeats, turns
completions into per-request state (``FetchHandle``), writes finished layers of a round into the
caller's paged KV pool through the target's ``KVWriter`` (``kvpool``; decoded KV, or the codec's codes
that the writer dequantizes: ``DpuClientConfig.output``), and restarts the data plane when
it dies or hangs. In-flight chunks of a lost data plane become misses (kind ``dataplane_lost``); later
submissions go to the new process. An attached client never starts or kills the service: when it
misses heartbeats, or the service no longer knows it (``Pong.registered`` False: it restarted), the
client fails its in-flight rounds (``dataplane_lost``), opens a new connection and registers again;
until the service accepted it, every submission fails at once (``dataplane_lost``), so a fetch never
waits on a service that is down.

This module is the process side (lifecycle, heartbeats, supervision, the receiver loop); the round
bookkeeping (slots, in-flight rounds, completion events -> handles, scatters) is ``rounds.RoundBook``.
A chunk the data plane's store client failed on, or whose value it found corrupt (store frame, MAC or
codec CRCs), arrives as ``ChunkFailed`` with ``store_error``: it is passed to ``on_store_error(op, kind, n)``
(the serving glue: ``store_errors_total{op="get",kind}``), once per chunk; a corrupt one is also logged
here (``store/corruption.py``, rate-limited).

Threads: ``start``/``submit``/``cancel``/``stats``/``close`` may be called from any thread (they take
``cv``); socket I/O and scatters run only on the receiver thread, the scatters outside ``cv``
(``rounds.RoundBook``: a slow device write does not hold up ``submit``; ``cancel`` waits only for a write
of its own fetch). Buffers: the destination region is owned by this client (``host_region.HostRegion``:
anonymous memory a spawned data plane inherits, so a stopped or killed server leaves nothing in
/dev/shm; for a service, a file named after our pid, removed in ``close``; ``start`` first sweeps those
of dead creators, ``shm_names.py``); the data plane writes into it, the receiver thread reads it while
scattering. A destination slot is reused only after the data plane said ``JobDone`` for the job using it
(it then writes nothing more there).

Layer-wise admission (``blob_slot_bytes`` > 0): each slot also has a blob area; the data plane copies a
round's verified compressed blobs there before ``ChunksVerified``. The receiver thread copies them out
(before it can see that round's ``JobDone``), re-parses them here (header + checksum) and, once every
chunk of a fetch has them, sets ``FetchHandle.verified`` and calls ``on_event``. The copies are what
the host decodes from if the data plane dies, stalls or is cancelled after that point.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.contract.endpoints import check_endpoint
from sgl_remote_kv.dpu.settings import DataPlaneSettings
from sgl_remote_kv.kvpool import KVWriteError
from sgl_remote_kv.store import corruption
from sgl_remote_kv.types import DPU_OUTPUTS, ModelFingerprint

from .host_region import HostRegion
from .jobs import FetchHandle, FetchResult, HostRound, KVTarget
from .link import AttachedService, DataPlaneProcess
from .round_io import RoundIO
from .rounds import RoundBook

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DpuClientConfig:
    store_url: str
    dest_slots: int = 2
    dest_slot_bytes: int = 64 << 20
    blob_slot_bytes: int = 0  # > 0: host-visible copies of verified blobs (layer-wise admission)
    process: DataPlaneSettings = DataPlaneSettings()
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    job_timeout_s: float = 30.0  # an in-flight round with no event for this long: data plane hung
    start_timeout_s: float = 60.0
    endpoint: str = ""  # "": spawn a private data plane; else attach to the service there (ipc:// or tcp://)
    auth_key_file: str = ""  # shared secret of an attached service's endpoint (CURVE); required for tcp://
    # write each run of finished layers into the pool as soon as every chunk of the round has it (always
    # with a blob area); False: one write per host round once all its layers arrived (fewer device launches)
    eager_writes: bool = True
    # what the data plane writes for the pool's writer: "kv" (decoded KV), "codes" (the lossless stage's
    # output, dequantized by the writer: ``KVWriter.write_quantized``), or "auto": codes where the writer
    # dequantizes on a device (``KVWriter.device_dequant``: a GPU pool), KV otherwise. Codes only for codecs
    # with a device dequant stage; other codecs always fetch KV.
    output: str = "auto"

    def __post_init__(self) -> None:
        if self.output not in DPU_OUTPUTS:
            raise ValueError(f"data-plane output must be one of {DPU_OUTPUTS}, got {self.output!r}")
        if self.endpoint:
            check_endpoint(
                self.endpoint,
                authenticated=bool(self.auth_key_file),
                what="data-plane endpoint",
                key_hint="an auth key file (--remote-kv-auth-key-file)",
            )


class DpuClient:
    """See module docstring. Typical use::

    client = DpuClient(cfg, fingerprint, codec); client.start()
    h = client.submit("req-1", keys, 256, KVTarget(writer, slots))
    h.wait_layer(0); ...; res = h.wait()
    """

    def __init__(
        self,
        cfg: DpuClientConfig,
        fingerprint: ModelFingerprint,
        codec,
        on_event: Callable[[], None] | None = None,
        on_store_error: Callable[[str, str, int], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
        on_write: Callable[[float, int, str], None] | None = None,
    ) -> None:
        self.cfg, self.fingerprint, self.layout = cfg, fingerprint, fingerprint.layout
        self.codec, self.codec_name, self.codec_params = codec, codec.name, codec.params_bytes()
        self._on_event_cb = on_event  # called (receiver thread) when a fetch is verified or finished
        lay = fingerprint.layout
        self._wire_fp = P.Fingerprint(
            fingerprint.architecture,
            P.Layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype),
            fingerprint.weights_id,
            fingerprint.tp_rank,
            fingerprint.tp_size,
            fingerprint.digest(),
        )
        self.cv = threading.Condition(threading.RLock())
        self.dest: HostRegion | None = None
        self.io: RoundIO | None = None
        self._proc: DataPlaneProcess | AttachedService | None = None
        self._attached = bool(cfg.endpoint)
        self._registered = False  # attached: the service accepted our current connection's Register
        self._connect_at = 0.0
        self._forgotten = False  # attached: a Pong said the service does not know this connection
        self.on_store_error = on_store_error  # (op, kind, n): the data plane's store client failures
        self.on_restart = on_restart  # (reason: "exited" | "hung" | "restarted"): replaced / reconnected
        self.on_write = on_write  # (seconds, layers, output): the receiver thread wrote a round's layers
        self.book: RoundBook | None = None  # created in ``start`` (needs the region)
        self._thread: threading.Thread | None = None
        self._running = False
        self._closed = False
        self._ctx = zmq.Context()
        self._wake_tx = self._wake_rx = None
        self.counters = {"submitted": 0, "restarts": 0, "chunks_done": 0, "chunks_failed": 0, "bad_frames": 0}
        self.counters.update({"receiver_errors": 0, "write_s": 0, "rounds": 0, "verified": 0})
        self.counters.update({"verify_rejected": 0, "write_failed": 0, "send_dropped": 0})
        self._writers: list = []  # KV writers the destination region is registered with (pinned)
        self._pin_lock = threading.Lock()  # not self.cv: pinning a large region takes a while
        self.last_pong: P.Pong | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the destination region, spawn the data plane, wait until it answers a heartbeat."""
        cfg = self.cfg
        shm_names.sweep_stale()  # regions of hosts that died together with their data plane
        shm_names.sweep_stale_dirs()
        nbytes = cfg.dest_slots * (cfg.dest_slot_bytes + cfg.blob_slot_bytes)
        self.dest = HostRegion(nbytes, shm_names.region_name(), named=self._attached)
        self.io = RoundIO(
            self.dest, self.layout, cfg.dest_slot_bytes, cfg.dest_slots, cfg.blob_slot_bytes, self.codec
        )
        self.book = RoundBook(
            self.layout,
            self.io,
            cfg.dest_slots,
            cfg.dest_slot_bytes,
            self._submit_msg,
            self.counters,
            self._on_event_cb,
            eager=cfg.eager_writes or cfg.blob_slot_bytes > 0,
            on_write=self.on_write,
        )
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://srkv-wake-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://srkv-wake-{id(self)}")
        fp = self.fingerprint
        register = P.Register(
            secrets.token_bytes(16),
            f"pid {os.getpid()} tp {fp.tp_rank}/{fp.tp_size}",
            self._wire_fp,
            self.codec_name,
            self.codec_params,
            [self.dest.name.lstrip("/")],
        )
        if self._attached:
            from sgl_remote_kv.store.security import load_auth_key

            key = load_auth_key(cfg.auth_key_file) if cfg.auth_key_file else b""
            self._proc = AttachedService(self._ctx, cfg.endpoint, register, key)
        else:
            warm = P.encode_warmup(P.Warmup(self.codec_name, self.codec_params.decode(), self._wire_fp))
            regions = {self.dest.name: self.dest.fd}  # inherited by every child (restarts too)
            self._proc = DataPlaneProcess(self._ctx, cfg.process, cfg.store_url, register, warm, regions)
        self._proc.spawn()
        if not self._proc.wait_ready(cfg.start_timeout_s):
            why = self._proc.refused
            self.close()
            if why:
                raise RuntimeError(f"the data plane refused this client: {why}")
            where = cfg.endpoint or "the spawned process (see its log)"
            raise RuntimeError(f"data plane did not answer: {where}")
        self._registered = True
        self._running = True
        self._thread = threading.Thread(target=self._receiver, name="srkv-dpu-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the receiver, terminate the data plane (SIGTERM, then SIGKILL), free the region.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self.cv:
            if self.book is not None:
                self.book.lose_all("cancelled")  # also drops writes still queued (the receiver is gone)
            self.cv.notify_all()
        with self._pin_lock:
            for w in self._writers:
                try:
                    w.unregister_host(self.dest.array)
                except Exception as e:  # boundary (shutdown): a faulted device must not stop the cleanup
                    logger.warning("unpinning the destination region failed: %r", e)
            self._writers.clear()
        if self.dest is not None:
            self.dest.remove_name()  # first: tells the data plane it need not clean up after us
        if self._proc is not None:
            self._proc.stop()
        for s in (self._wake_tx, self._wake_rx):
            if s is not None:
                s.close(0)
        self._ctx.term()
        if self.io is not None:
            self.io.close()
        if self.dest is not None:
            self.dest.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ---- submit / cancel ---------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        keys: list[bytes],
        chunk_tokens: int | list[int],
        target: KVTarget | None,
    ) -> FetchHandle:
        """Fetch chunks ``keys`` (a prefix, in order) into ``target`` (``None``: fetch and discard). The
        target's writer is registered with the destination region (pinned once) on first use."""
        tokens = [chunk_tokens] * len(keys) if isinstance(chunk_tokens, int) else list(chunk_tokens)
        if len(tokens) != len(keys) or not keys:
            raise ValueError("need one token count per key and at least one key")
        if target is not None and len(target.kv_slots) < sum(tokens):
            raise ValueError("target.kv_slots shorter than the fetched tokens")
        h = FetchHandle(
            self.cv, request_id, list(keys), tokens, self.layout.num_layers, target, self._wants_codes(target)
        )
        if target is not None:
            self._pin_for(target.writer)
        with self.cv:
            self.book.add(h)  # raises ValueError (nothing queued) if a chunk does not fit a slot
            self.counters["submitted"] += 1
            self.cv.notify_all()
        self._wake()
        return h

    def _pin_for(self, writer) -> None:
        """Register the destination region with ``writer`` once (pins it on a device pool), outside the
        client's lock: the receiver thread and other submits do not wait for a pinning."""
        with self._pin_lock:
            if not any(w is writer for w in self._writers):
                writer.register_host(self.dest.array)
                self._writers.append(writer)

    def cancel(self, handle: FetchHandle) -> None:
        """Cancel a fetch: nothing more is written for it once this returns (a write of it already running
        is waited for; queued ones are dropped), so the caller may free its KV slots; its unfinished chunks
        become misses."""
        with self.cv:
            self.book.cancel(handle)
            self.cv.notify_all()
            if threading.current_thread() is not self._thread:  # the receiver runs (or drops) them itself
                self.cv.wait_for(lambda: handle.writing == 0)
        self._wake()

    def fetch(self, request_id: str, keys, chunk_tokens, target, timeout: float | None = None) -> FetchResult:
        """Blocking convenience: submit and wait."""
        res = self.submit(request_id, keys, chunk_tokens, target).wait(timeout)
        if res is None:
            raise TimeoutError(f"fetch {request_id} did not finish in {timeout} s")
        return res

    def stats(self) -> dict:
        with self.cv:
            out = dict(self.counters)
            pending, inflight = (len(self.book.pending), len(self.book.inflight)) if self.book else (0, 0)
            out.update(pending_rounds=pending, inflight_rounds=inflight, pid=self.pid)
        if self.last_pong is not None:
            out["dataplane"] = self.last_pong.stats_json.decode()
        return out

    # ---- internals (under cv) ----------------------------------------------------------------------
    def _wants_codes(self, target: KVTarget | None) -> bool:
        """Fetch codes for ``target`` (``DpuClientConfig.output``; ``None``: fetch and discard)?"""
        if not self.codec.device_dequant or self.cfg.output == "kv":
            return False
        return self.cfg.output == "codes" or (target is not None and target.writer.device_dequant)

    def _wake(self) -> None:
        with self.cv:
            if self._wake_tx is not None:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # plenty of wake-ups already queued
                    pass

    def _submit_msg(self, r: HostRound) -> P.SubmitFetch:
        """The ``SubmitFetch`` of round ``r`` (slot and job id already assigned; under ``cv``)."""
        h = r.handle
        blob_off, blob_cap = self.io.blob_area(r.slot)
        dests = self.io.chunk_dests(r, h.keys, h.chunk_tokens, h.codes)
        name = self.dest.name.lstrip("/")
        fp = self._wire_fp
        return P.SubmitFetch(
            r.job,
            h.request_id,
            self.codec_name,
            self.codec_params,
            fp,
            name,
            dests,
            blob_off,
            blob_cap,
            h.output,
        )

    # ---- receiver thread ---------------------------------------------------------------------------
    def _receiver(self) -> None:
        last_hb = 0.0
        while self._running:
            try:
                sock = self._proc.sock
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLIN)
                poller.register(self._wake_rx, zmq.POLLIN)
                monitor = getattr(self._proc, "monitor", None)  # attached: connection events
                if monitor is not None:
                    poller.register(monitor, zmq.POLLIN)
                ready = dict(poller.poll(int(self.cfg.heartbeat_s * 500)))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                self._flush_outbox(sock)
                if sock in ready:
                    self._drain(sock)
                now = time.monotonic()
                if now - last_hb >= self.cfg.heartbeat_s:
                    last_hb = now
                    self._proc.heartbeat()
                self._supervise(now)
            except Exception:  # thread boundary: never let the receiver die while serving
                self.counters["receiver_errors"] += 1
                logger.exception("DPU receiver error")
                time.sleep(0.05)

    def _flush_outbox(self, sock) -> None:
        while True:
            with self.cv:
                if self._attached and not self._registered:
                    # Never submit on a connection the service has not accepted: the service could
                    # still take the job after ``_supervise`` failed its round and freed its slot.
                    self.book.outbox.clear()
                    return
                if not self.book.outbox:
                    return
                frame = self.book.outbox.popleft()
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # no connection right now: the round ends as a miss when the link is lost
                self.counters["send_dropped"] += 1

    def _drain(self, sock) -> None:
        P.drain(sock, self._on_message, self._bad_frame)

    def _bad_frame(self, reason: str) -> None:
        self.counters["bad_frames"] += 1
        logger.warning("bad frame from data plane: %s", reason)

    def _on_message(self, _head: list[bytes], msg: P.Message) -> None:
        if isinstance(msg, P.Pong):
            self._proc.pong(msg)
            self.last_pong = msg
            if self._attached and self._registered and not msg.registered:
                logger.error("the data-plane service no longer knows this client (it restarted?)")
                self._forgotten = True  # ``_supervise`` reconnects (not here: we are reading the socket)
        elif isinstance(msg, P.Registered):
            if msg.ok and self._proc.accepted:
                return  # the answer to a repeated Register of this connection (``wait_ready`` resends)
            if self._proc.registered(msg):
                if self._attached:
                    logger.info(
                        "registered with the data-plane service %s (pid %s)", self.cfg.endpoint, self.pid
                    )
                self._registered = True
                with self.cv:
                    self.book.pump()
            else:
                logger.error("the data-plane service refused this client: %s", msg.detail)
        elif isinstance(msg, P.ChunksVerified):
            self._on_verified(msg)
        else:
            if isinstance(msg, P.ChunkFailed) and msg.store_error:
                if msg.store_error == "corrupt":  # the data plane logged it too, in its own log
                    key, why = corruption.split_detail(msg.detail)
                    corruption.note(key, "found by the data plane", why)
                if self.on_store_error is not None:  # its store client failed, or a value was corrupt
                    self.on_store_error("get", msg.store_error, 1)
            with self.cv:
                self.book.on_event(msg)
                self.cv.notify_all()
            self._run_writes()

    def _run_writes(self) -> None:
        """Run the pool writes the last event queued, outside ``cv`` (receiver thread; before it reads the
        next event or sends anything: a slot freed by ``JobDone`` is not handed out before its write ran)."""
        while True:
            with self.cv:
                op = self.book.next_write()
                if op is None:
                    self.cv.notify_all()
                    return
            try:
                error, seconds = self.book.run_write(op)
            except Exception as e:  # boundary: a writer bug must not leave the fetch waiting for this write
                self.counters["receiver_errors"] += 1
                logger.exception("KV write raised unexpectedly")
                error, seconds = KVWriteError(f"unexpected {type(e).__name__}: {e}"), 0.0
            with self.cv:
                self.book.write_done(op, error, seconds, ran=True)
                self.cv.notify_all()

    def _on_verified(self, msg: P.ChunksVerified) -> None:
        """Copy out and re-parse a round's verified blobs (outside ``cv``: the slot cannot be reused
        before this thread handles the round's ``JobDone``), then record them on the handle."""
        with self.cv:
            r = self.book.inflight.get(msg.job)
            if r is None:
                return
            r.last_event = time.monotonic()
            n = r.chunk_hi - r.chunk_lo
            if msg.ok < n or not msg.blobs or r.handle.cancelled or r.handle.first_fail < r.chunk_hi:
                return
            slot, h = r.slot, r.handle
        tokens = h.chunk_tokens[r.chunk_lo : r.chunk_hi]
        try:
            blobs, headers = self.io.verified_copies(slot, msg.blobs, self.codec, self.fingerprint, tokens)
        except ChunkError as e:  # never admitted early then; the normal completion path still works
            self.counters["verify_rejected"] += 1
            logger.warning("verified blobs of job %d rejected on the host: %s", msg.job, e)
            return
        with self.cv:
            if h.set_verified(r.chunk_lo, blobs, headers):
                self.counters["verified"] += 1
                if self._on_event_cb is not None:
                    self._on_event_cb()
            self.cv.notify_all()

    def _supervise(self, now: float) -> None:
        """Replace a dead or hung data plane (spawned), or reconnect to the service (attached)."""
        if not self._attached:
            why = self._unhealthy(now)
            if why is not None:
                self._restart(why)
            return
        down = self._proc.disconnected()  # drains the connection's events in every state
        if self._registered:
            why = "restarted" if self._forgotten else "exited" if down else self._unhealthy(now)
            if why is not None:
                self._reconnect(why)
        else:  # not registered (service down, restarting, or refusing us): every fetch is a miss
            with self.cv:
                if self.book.lose_all("dataplane_lost"):
                    self.cv.notify_all()
                self.book.outbox.clear()
            if now - self._connect_at > self.cfg.heartbeat_timeout_s:
                self._reconnect(None)

    def _reconnect(self, why: str | None) -> None:
        """Attached: in-flight rounds become misses; a new connection registers again (answered in
        ``_on_message``). ``why`` None: a retry while still unregistered."""
        self._registered = self._forgotten = False
        with self.cv:
            lost = self.book.lose_inflight("dataplane_lost") + self.book.lose_all("dataplane_lost")
            self.cv.notify_all()
        if why is not None:
            self.counters["restarts"] += 1
            logger.warning(
                "reconnecting to the data-plane service %s (%s; %d rounds lost)", self.cfg.endpoint, why, lost
            )
            if self.on_restart is not None:
                self.on_restart(why)
        self._proc.stop(kill=True)
        self._proc.spawn()
        self._connect_at = time.monotonic()

    def _unhealthy(self, now: float) -> str | None:
        """Why the data plane must be replaced (``exited`` / ``hung``), or None."""
        if not self._proc.alive():
            logger.error("data plane exited (rc=%s)", self._proc.returncode())
            return "exited"
        if now - self._proc.last_pong_at > self.cfg.heartbeat_timeout_s:
            logger.error("data plane missed heartbeats for %.1f s", now - self._proc.last_pong_at)
            return "hung"
        with self.cv:
            stale = self.book.stale(now, self.cfg.job_timeout_s)
        if stale:
            logger.error("data plane made no progress on %d rounds for %.1f s", stale, self.cfg.job_timeout_s)
        return "hung" if stale else None

    def _restart(self, why: str) -> None:
        """Kill and replace the data plane; its in-flight rounds become misses."""
        with self.cv:
            lost = self.book.lose_inflight("dataplane_lost")
            self.counters["restarts"] += 1
            self.cv.notify_all()
        logger.warning("restarting data plane (%d rounds lost)", lost)
        if self.on_restart is not None:
            self.on_restart(why)
        self._proc.stop(kill=True)
        self._proc.spawn()
        if not self._proc.wait_ready(self.cfg.start_timeout_s):
            logger.error("restarted data plane not ready yet; will retry")
        with self.cv:
            self.book.pump()
