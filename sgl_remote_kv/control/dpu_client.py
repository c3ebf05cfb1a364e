"""Host control plane for the DPU data plane; lives in the SGLang scheduler process.

``DpuClient`` creates the shared destination region, spawns ``python -m sgl_remote_kv.dpu`` as its own
process (pinned away from the serving cores when the machine has enough), and runs one background
*receiver thread* that owns the ZeroMQ socket: it sends queued submissions, heartbeats, turns
completions into per-request state (``FetchHandle``), scatters each finished layer of a round into the
caller's paged KV pool, and restarts the data plane when it dies or hangs. In-flight chunks of a lost
data plane become misses (kind ``dataplane_lost``); later submissions go to the new process.

Threads: ``start``/``submit``/``cancel``/``stats``/``close`` may be called from any thread (they take
``cv``); socket I/O and scatters run only on the receiver thread. Buffers: the destination region is
owned by this client (created here, unlinked in ``close``); the data plane writes into it, the receiver
thread reads it while scattering. A destination slot is reused only after the data plane said
``JobDone`` for the job using it (it then writes nothing more there).

Layer-wise admission (``blob_slot_bytes`` > 0): each slot also has a blob area; the data plane copies a
round's verified compressed blobs there before ``ChunksVerified``. The receiver thread copies them out
(before it can see that round's ``JobDone``), re-parses them here (header + checksum) and, once every
chunk of a fetch has them, sets ``FetchHandle.verified`` and calls ``on_event``. The copies are what
the host decodes from if the data plane dies, stalls or is cancelled after that point.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.dpu import protocol as P
from sgl_remote_kv.dpu.buffers import DestRegion, plan_rounds
from sgl_remote_kv.types import ModelFingerprint

from .dpu_process import DataPlaneProcess, ProcessSpec
from .jobs import DONE, FAILED, FetchHandle, FetchResult, HostRound
from .round_io import RoundIO
from .scatter import KVPoolTarget

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DpuClientConfig:
    store_url: str
    dest_slots: int = 2
    dest_slot_bytes: int = 64 << 20
    blob_slot_bytes: int = 0  # > 0: host-visible copies of verified blobs (layer-wise admission)
    process: ProcessSpec = ProcessSpec()
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    job_timeout_s: float = 30.0  # an in-flight round with no event for this long: data plane hung
    start_timeout_s: float = 60.0


class DpuClient:
    """See module docstring. Typical use::

    client = DpuClient(cfg, fingerprint, codec); client.start()
    h = client.submit("req-1", keys, 256, KVPoolTarget(k_pool, v_pool, slots))
    h.wait_layer(0); ...; res = h.wait()
    """

    def __init__(self, cfg: DpuClientConfig, fingerprint: ModelFingerprint, codec, on_event=None) -> None:
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
        self.dest: DestRegion | None = None
        self.io: RoundIO | None = None
        self._proc: DataPlaneProcess | None = None
        self._tmp = tempfile.mkdtemp(prefix="srkv-dpu-")
        self._pending: deque[HostRound] = deque()
        self._inflight: dict[int, HostRound] = {}  # data-plane job id -> round
        self._free_slots: list[int] = []
        self._outbox: deque[bytes] = deque()
        self._job_ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._running = False
        self._ctx = zmq.Context()
        self._wake_tx = self._wake_rx = None
        self.counters = {"submitted": 0, "restarts": 0, "chunks_done": 0, "chunks_failed": 0, "bad_frames": 0}
        self.counters.update({"receiver_errors": 0, "scatter_s": 0, "rounds": 0, "verified": 0})
        self.counters.update({"verify_rejected": 0})
        self.last_pong: P.Pong | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the destination region, spawn the data plane, wait until it answers a heartbeat."""
        cfg = self.cfg
        self.dest = DestRegion.create(cfg.dest_slots * (cfg.dest_slot_bytes + cfg.blob_slot_bytes))
        self.io = RoundIO(self.dest, self.layout, cfg.dest_slot_bytes, cfg.dest_slots, cfg.blob_slot_bytes)
        self._free_slots = list(range(cfg.dest_slots))
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://srkv-wake-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://srkv-wake-{id(self)}")
        self._proc = DataPlaneProcess(
            self._ctx, cfg.process, cfg.store_url, self.dest.name.lstrip("/"), self._tmp
        )
        self._proc.spawn()
        if not self._proc.wait_ready(cfg.start_timeout_s):
            self.close()
            raise RuntimeError("data plane did not start (see its log)")
        self._running = True
        self._thread = threading.Thread(target=self._receiver, name="srkv-dpu-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the receiver, terminate the data plane (SIGTERM, then SIGKILL), free the region."""
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self.cv:
            for r in list(self._inflight.values()) + list(self._pending):
                self._lose_round(r, "cancelled")
            self._inflight.clear()
            self._pending.clear()
        if self.dest is not None:
            self.dest.unlink()  # first: tells the data plane it need not clean up after us
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
        shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ---- submit / cancel ---------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        keys: list[bytes],
        chunk_tokens: int | list[int],
        target: KVPoolTarget | None,
    ) -> FetchHandle:
        """Fetch chunks ``keys`` (a prefix, in order) into ``target`` (``None``: fetch and discard)."""
        tokens = [chunk_tokens] * len(keys) if isinstance(chunk_tokens, int) else list(chunk_tokens)
        if len(tokens) != len(keys) or not keys:
            raise ValueError("need one token count per key and at least one key")
        if target is not None and len(target.slots) < sum(tokens):
            raise ValueError("target.slots shorter than the fetched tokens")
        h = FetchHandle(self.cv, request_id, list(keys), tokens, self.layout.num_layers, target)
        plan = plan_rounds(tokens, self.layout, self.cfg.dest_slot_bytes, 1.0)
        with self.cv:
            t = 0
            for regions in plan:
                n = sum(r.tokens for r in regions)
                r = HostRound(h, regions[0].index, regions[-1].index + 1, t, n)
                r.layer_done = [0] * self.layout.num_layers
                r.layer_scattered = [False] * self.layout.num_layers
                h.rounds.append(r)
                self._pending.append(r)
                t += n
            self.counters["submitted"] += 1
            self._pump()
        self._wake()
        return h

    def cancel(self, handle: FetchHandle) -> None:
        """Cancel a fetch: nothing more is scattered for it; its unfinished chunks become misses."""
        with self.cv:
            handle.cancelled = True
            lead = next((i for i, s in enumerate(handle.state) if s != DONE), len(handle.state))
            handle.first_fail = min(handle.first_fail, lead)
            for r in handle.rounds:
                if r.job and not r.terminal:
                    self._outbox.append(P.encode(P.Cancel(r.job, 0)))
            self._drop_pending(handle)
            self._pump()
            self.cv.notify_all()
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
            out.update(pending_rounds=len(self._pending), inflight_rounds=len(self._inflight), pid=self.pid)
        if self.last_pong is not None:
            out["dataplane"] = self.last_pong.stats_json.decode()
        return out

    # ---- internals (under cv) ----------------------------------------------------------------------
    def _wake(self) -> None:
        with self.cv:
            if self._wake_tx is not None:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # plenty of wake-ups already queued
                    pass

    def _drop_pending(self, h: FetchHandle) -> None:
        """Forget ``h``'s queued rounds that can no longer produce hits (cancelled or past a miss)."""
        keep: deque[HostRound] = deque()
        for r in self._pending:
            if r.handle is h and (h.cancelled or r.chunk_lo >= h.first_fail):
                self._lose_round(r, None)
            else:
                keep.append(r)
        self._pending = keep

    def _pump(self) -> None:
        """Hand pending rounds free destination slots (skipping rounds already beyond a miss)."""
        while self._pending and self._free_slots:
            r = self._pending.popleft()
            h = r.handle
            if h.cancelled or r.chunk_lo >= h.first_fail:
                self._lose_round(r, None)
                continue
            r.slot = self._free_slots.pop()
            r.job = next(self._job_ids)
            r.last_event = time.monotonic()
            self._inflight[r.job] = r
            dests = self.io.chunk_dests(r, h.keys, h.chunk_tokens)
            blob_off, blob_cap = self.io.blob_area(r.slot)
            msg = P.SubmitFetch(
                r.job,
                h.request_id,
                self.codec_name,
                self.codec_params,
                self._wire_fp,
                self.dest.name.lstrip("/"),
                dests,
                blob_off,
                blob_cap,
            )
            self._outbox.append(P.encode(msg))

    def _lose_round(self, r: HostRound, kind: str | None) -> None:
        """Round ends without (more) data: its unfinished chunks fail with ``kind`` (None: not fetched)."""
        h = r.handle
        for i in range(r.chunk_lo, r.chunk_hi):
            if kind is not None and h.state[i] != DONE:
                h.mark_failed(i, kind)
        r.terminal = True
        if r.slot >= 0:
            self._free_slots.append(r.slot)
            r.slot = -1
        if h.check_finished() and self._on_event_cb is not None:
            self._on_event_cb()
        self.cv.notify_all()

    # ---- receiver thread ---------------------------------------------------------------------------
    def _receiver(self) -> None:
        last_hb = 0.0
        while self._running:
            try:
                sock = self._proc.sock
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLIN)
                poller.register(self._wake_rx, zmq.POLLIN)
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
                    sock.send(P.encode(P.Heartbeat(self._proc.next_seq(), time.time_ns())), zmq.NOBLOCK)
                if self._unhealthy(now):
                    self._restart()
            except Exception:  # thread boundary: never let the receiver die while serving
                self.counters["receiver_errors"] += 1
                logger.exception("DPU receiver error")
                time.sleep(0.05)

    def _flush_outbox(self, sock) -> None:
        while True:
            with self.cv:
                if not self._outbox:
                    return
                frame = self._outbox.popleft()
            sock.send(frame, zmq.NOBLOCK)

    def _drain(self, sock) -> None:
        P.drain(sock, self._on_message, self._bad_frame)

    def _bad_frame(self, reason: str) -> None:
        self.counters["bad_frames"] += 1
        logger.warning("bad frame from data plane: %s", reason)

    def _on_message(self, _head: list[bytes], msg: P.Message) -> None:
        if isinstance(msg, P.Pong):
            self._proc.pong(msg)
            self.last_pong = msg
        elif isinstance(msg, P.ChunksVerified):
            self._on_verified(msg)
        else:
            with self.cv:
                self._on_event(msg)

    def _on_verified(self, msg: P.ChunksVerified) -> None:
        """Copy out and re-parse a round's verified blobs (outside ``cv``: the slot cannot be reused
        before this thread handles the round's ``JobDone``), then record them on the handle."""
        with self.cv:
            r = self._inflight.get(msg.job)
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

    def _on_event(self, msg) -> None:
        r = self._inflight.get(msg.job)
        if r is None:
            return  # a job of a previous data-plane generation, or already cancelled
        r.last_event = time.monotonic()
        h = r.handle
        if isinstance(msg, P.LayerDone):
            i = r.chunk_lo + msg.chunk
            if i < r.chunk_hi and msg.layer + msg.count <= h.num_layers:
                h.layers_seen[i] += msg.count
                for layer in range(msg.layer, msg.layer + msg.count):
                    r.layer_done[layer] += 1
                self._try_scatter(r)
        elif isinstance(msg, P.ChunkDone):
            i = r.chunk_lo + msg.chunk
            if i < r.chunk_hi and h.layers_seen[i] >= h.num_layers and h.state[i] != FAILED:
                h.state[i] = DONE
                h.wire_bytes[i] = msg.wire_bytes
                self.counters["chunks_done"] += 1
        elif isinstance(msg, P.ChunkFailed):
            self._on_failed(r, r.chunk_lo + msg.chunk, msg.kind)
        elif isinstance(msg, P.JobDone):
            self._try_scatter(r)
            del self._inflight[msg.job]
            self.counters["rounds"] += 1
            self._lose_round(r, "internal")  # chunks without ChunkDone by now are not trustworthy
            self._pump()
        self.cv.notify_all()

    def _on_failed(self, r: HostRound, i: int, kind: str) -> None:
        h = r.handle
        if not r.chunk_lo <= i < r.chunk_hi:
            return
        self.counters["chunks_failed"] += 1
        h.mark_failed(i, kind)
        for other in h.rounds:  # later rounds of this request are beyond the miss now
            if other.job and not other.terminal and other.chunk_lo > i:
                self._outbox.append(P.encode(P.Cancel(other.job, 0)))
        self._drop_pending(h)
        self._try_scatter(r)

    def _try_scatter(self, r: HostRound) -> None:
        """Scatter every layer whose chunks (those before the first miss) are all in the region."""
        h = r.handle
        valid = max(0, min(r.chunk_hi, h.first_fail) - r.chunk_lo)
        if h.cancelled:
            return
        for layer in range(h.num_layers):
            if r.layer_scattered[layer] or r.layer_done[layer] < valid:
                continue
            r.layer_scattered[layer] = True
            if valid and h.target is not None:
                t0 = time.perf_counter()
                n_tok = sum(h.chunk_tokens[r.chunk_lo : r.chunk_lo + valid])
                self.io.scatter_layer(r, layer, n_tok, h.target)
                self.counters["scatter_s"] += time.perf_counter() - t0
            h.layer_ready[layer] += valid

    def _unhealthy(self, now: float) -> bool:
        if not self._proc.alive():
            logger.error("data plane exited (rc=%s)", self._proc.returncode())
            return True
        if now - self._proc.last_pong_at > self.cfg.heartbeat_timeout_s:
            logger.error("data plane missed heartbeats for %.1f s", now - self._proc.last_pong_at)
            return True
        with self.cv:
            stale = [r for r in self._inflight.values() if now - r.last_event > self.cfg.job_timeout_s]
        if stale:
            logger.error(
                "data plane made no progress on %d rounds for %.1f s", len(stale), self.cfg.job_timeout_s
            )
        return bool(stale)

    def _restart(self) -> None:
        """Kill and replace the data plane; its in-flight rounds become misses."""
        with self.cv:
            lost = list(self._inflight.values())
            self._inflight.clear()
            for r in lost:
                self._lose_round(r, "dataplane_lost")
            self._outbox.clear()
            self.counters["restarts"] += 1
        logger.warning("restarting data plane (%d rounds lost)", len(lost))
        self._proc.stop(kill=True)
        self._proc.spawn()
        if not self._proc.wait_ready(self.cfg.start_timeout_s):
            logger.error("restarted data plane not ready yet; will retry")
        with self.cv:
            self._pump()
