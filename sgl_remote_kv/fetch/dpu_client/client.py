"""The DPU client: the host side of the DPU data plane; lives in the SGLang scheduler process.

``DpuClient`` creates the shared destination region, spawns ``python -m sgl_remote_kv.dpu`` as its own
process (pinned away from the serving cores when the machine has enough) -- or, with
``DpuClientConfig.endpoint``, attaches to a data-plane service shared by every rank and server of the
host --, registers its region, fingerprint and codec with it (``protocol.Register``), and runs one background
*receiver thread* (``receiver.Receiver``) that owns the ZeroMQ socket: it sends queued submissions,
heartbeats, turns completions into per-request state (``ClientFetch``), writes finished layers of a round
into the target's rows through its ``KVWriter`` (in the server: host staging rows,
``kvpool.rows.RowStore``; decoded KV, or the codec's codes that the writer dequantizes:
``DpuClientConfig.output``), and has the data plane replaced when it dies or hangs, or the service
reconnected when it restarts (``supervisor.Supervisor``: in-flight chunks become misses, kind
``dataplane_lost``).

This module is the client's interface and lifecycle (``start``/``close``, ``submit``/``cancel``/``fetch``,
``stats``, pinning the region on the pools' writers); the receiver thread is ``receiver.py``, the data
plane's supervision ``supervisor.py``, the link to it ``link.py``, and the round bookkeeping (slots,
in-flight rounds, completion events -> handles, scatters) ``rounds.RoundBook``.

Threads: ``start``/``submit``/``cancel``/``stats``/``close`` may be called from any thread (they take
``cv``); socket I/O and scatters run only on the receiver thread, the scatters outside ``cv``
(``rounds.RoundBook``: a slow device write does not hold up ``submit``; ``cancel`` waits only for a write
of its own fetch). Buffers: the destination region is owned by this client (``host_region.HostRegion``:
anonymous memory a spawned data plane inherits, so a stopped or killed server leaves nothing in
/dev/shm; for a service, a file named after our pid, removed in ``close``; ``start`` first sweeps those
of dead creators, ``shm_names.py``); the data plane writes into it, the receiver thread reads it while
scattering. A destination slot is reused only after the data plane said ``JobDone`` for the job using it
(it then writes nothing more there). With ``blob_slot_bytes`` > 0 each slot also has a blob area the
data plane copies a round's verified compressed blobs into (layer-wise admission: ``receiver.py``).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable

import zmq

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.types import ModelFingerprint

from .host_region import HostRegion
from .jobs import ClientFetch, FetchResult, HostRound, KVTarget
from .link import AttachedService, DataPlaneProcess
from .owner import DpuClientConfig
from .receiver import Receiver
from .round_io import RoundIO
from .rounds import RoundBook
from .supervisor import Supervisor

logger = logging.getLogger(__name__)


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
        self.on_event = on_event  # called (receiver thread) when a fetch is verified or finished
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
        self.supervisor: Supervisor | None = None  # created in ``start`` once the data plane accepted us
        self._receiver: Receiver | None = None
        self.on_store_error = on_store_error  # (op, kind, n): the data plane's store client failures
        self.on_restart = on_restart  # (reason: "exited" | "hung" | "restarted"): replaced / reconnected
        self.on_write = on_write  # (seconds, layers, output): the receiver thread wrote a round's layers
        self.book: RoundBook | None = None  # created in ``start`` (needs the region)
        self._closed = False
        self._ctx = zmq.Context()
        self._wake_tx = self._wake_rx = None
        self.counters = {"submitted": 0, "restarts": 0, "chunks_done": 0, "chunks_failed": 0, "bad_frames": 0}
        self.counters.update({"receiver_errors": 0, "write_s": 0, "rounds": 0, "verified": 0})
        self.counters.update({"verify_rejected": 0, "write_failed": 0, "send_dropped": 0})
        self._writers: list = []  # KV writers the destination region is registered with (pinned)
        self._pin_lock = threading.Lock()  # not self.cv: pinning a large region takes a while

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
            self.on_event,
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
        self.supervisor = Supervisor(self, self._proc)
        self._receiver = Receiver(self, self._proc, self.supervisor, self._wake_rx)
        self._receiver.start()

    def close(self) -> None:
        """Stop the receiver, terminate the data plane (SIGTERM, then SIGKILL), free the region.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._receiver is not None:
            self._receiver.stop()
        self._wake()
        if self._receiver is not None:
            self._receiver.join(timeout=10)
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

    @property
    def last_pong(self) -> P.Pong | None:
        """The data plane's latest answer to a heartbeat (None before the first one)."""
        return self.supervisor.last_pong if self.supervisor is not None else None

    # ---- submit / cancel ---------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        keys: list[bytes],
        chunk_tokens: int | list[int],
        target: KVTarget | None,
    ) -> ClientFetch:
        """Fetch chunks ``keys`` (a prefix, in order) into ``target`` (``None``: fetch and discard). The
        target's writer is registered with the destination region (pinned once) on first use."""
        tokens = [chunk_tokens] * len(keys) if isinstance(chunk_tokens, int) else list(chunk_tokens)
        if len(tokens) != len(keys) or not keys:
            raise ValueError("need one token count per key and at least one key")
        if target is not None and len(target.rows) < sum(tokens):
            raise ValueError("target.rows shorter than the fetched tokens")
        h = ClientFetch(
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

    def cancel(self, handle: ClientFetch) -> None:
        """Cancel a fetch: nothing more is written for it once this returns (a write of it already running
        is waited for; queued ones are dropped), so the caller may free its KV slots; its unfinished chunks
        become misses."""
        with self.cv:
            self.book.cancel(handle)
            self.cv.notify_all()
            receiver = self._receiver.thread if self._receiver is not None else None
            if threading.current_thread() is not receiver:  # the receiver runs (or drops) them itself
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
        pong = self.last_pong
        if pong is not None:
            out["dataplane"] = pong.stats_json.decode()
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
