"""The data-plane process: a ZeroMQ ROUTER front end, client registrations, round admission, the pipeline.

One process serves any number of host clients (``DpuClient``: one per TP rank of each server): a child
spawned by one client (the default; it exits with its parent) or a long-lived service on an endpoint
(``ipc://`` or, authenticated with CURVE, ``tcp://``). A client first ``Register``s on its connection
(fingerprint, codec, the shm destination regions it created); only then may it submit jobs, and only
into those regions, for that model and codec. Job ids are per client. Rounds wait for a staging slot in
one FIFO per client and are admitted round-robin across clients (``tasks.FairQueue``); the staging
slots and the pipeline are shared. A client that says ``Goodbye``, sends nothing for
``client_timeout_s`` or is replaced by a newer registration of its session is dropped: its queued rounds
are finished as cancelled, its admitted jobs cancelled, and once its last job reported ``JobDone`` its
regions are unmapped (and unlinked when their creator process is gone). A ``Register`` repeating the
registration of its connection (a client resends it until answered) is answered again, nothing else.

Logs: one INFO line when serving (version, pid, endpoint, store, staging, auth) and one per accepted
registration or ``Goodbye``; WARNING only for what an operator should look at (a client dropped while
live: silent, replaced; refused registrations, rejected jobs, bad frames). A stopped service removes its
``ipc://`` socket file (``ipc_file.py``).

Threads: the *server thread* (the process's main thread, ``DataPlaneServer.run``) owns the sockets,
the client and job tables, the pending-round queue and the free-slot list; it is the only thread touching
them. Pipeline workers send their completions back through one lock-protected PUSH socket on an inproc
endpoint that the server thread polls. With an auth key, pyzmq's ZAP authenticator runs one more thread.

Ownership: the staging buffers and the store client belong to this process; destination regions belong
to the hosts that created them (attached here by name on ``Register``; unlinked here only when their
creator is gone).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from sgl_remote_kv import __version__
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import auth, shm_names
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.endpoints import check_endpoint
from sgl_remote_kv.store.base import redact_url
from sgl_remote_kv.types import ModelFingerprint

from .buffers import DestRegion, StagingBuffers, plan_rounds
from .ipc_file import BoundFile
from .pipeline import Pipeline
from .settings import DataPlaneSettings
from .tasks import FairQueue, JobState
from .validate import Codecs, attach_regions, check_submit, fingerprint

logger = logging.getLogger(__name__)

_SLOT_FREE = b"slot"
_EVENTS = "inproc://dpu-events"


@dataclass(frozen=True)
class DataPlaneConfig:
    """Where this data plane serves and for whom, plus its ``DataPlaneSettings``; built once at the CLI
    edge (``__main__``). ``auth_key``: the shared secret; the endpoint then speaks CURVE with keys derived
    from it (``auth.py``); a ``tcp://`` endpoint without one is refused."""

    endpoint: str
    store_url: str
    settings: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    max_jobs: int = 1024
    max_active_chunks: int = 1 << 16  # over all active jobs: bounds the job table's memory
    parent_pid: int = 0  # when set, exit as soon as this process is no longer our parent
    warm: P.Warmup | None = None  # decoded once before serving (``DataPlaneServer.warm_up``)
    auth_key: bytes = field(default=b"", repr=False)
    client_timeout_s: float = 10.0  # drop a registered client silent this long; 0: never (spawned child)
    max_clients: int = 256
    allowed_fingerprints: tuple[bytes, ...] = ()  # model digests this service accepts; (): any
    # regions our spawning host passed down as descriptors (name, fd): anonymous memory, no name to attach
    inherited_regions: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        check_endpoint(
            self.endpoint, authenticated=bool(self.auth_key), what="endpoint", key_hint="--auth-key-file"
        )
        if not 0 <= self.client_timeout_s <= 3600:
            raise ValueError("client_timeout_s must be in [0, 3600]")


@dataclass
class ClientState:
    """One registered host client (server thread only). ``jobs``: its job ids not yet ``JobDone``;
    ``regions``: its destination regions, mapped here until it is gone and ``jobs`` is empty."""

    peer: bytes
    session: bytes
    label: str
    fingerprint: ModelFingerprint
    codec_key: tuple[str, bytes]
    regions: dict[str, DestRegion]
    last_seen: float
    register: P.Register | None = None  # what it registered with (a repeat of it is answered again)
    warm_s: float | None = None  # seconds its registration spent warming its codec up (first of a model)
    jobs: set[int] = field(default_factory=set)


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
        self.zap = auth.bind_server(self.ctx, self.router, cfg.endpoint, cfg.auth_key)
        self.socket_file = BoundFile.after_bind(cfg.endpoint)  # removed at close
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(_EVENTS)
        self._push_sock = self.ctx.socket(zmq.PUSH)
        self._push_sock.setsockopt(zmq.LINGER, 0)
        self._push_sock.setsockopt(zmq.SNDHWM, 0)
        self._push_sock.connect(_EVENTS)
        self._push_lock = threading.Lock()
        self.buffers = StagingBuffers(st.slots, st.slot_bytes, st.inflate_ratio)
        self.store = open_client(cfg.store_url, ClientConfig(timeout_s=st.store_timeout_s))
        self.pipeline = Pipeline(st.pipeline(), self.buffers, self.store, self._emit, self._slot_freed)
        self.clients: dict[bytes, ClientState] = {}  # peer (routing id) -> registration
        self.leaving: list[ClientState] = []  # dropped clients whose jobs are still finishing
        self.deferred: dict[bytes, P.Register] = {}  # registrations waiting for their session's old jobs
        self.unmapping: list[DestRegion] = []  # released regions a worker still held a view of
        self.jobs: dict[tuple[bytes, int], JobState] = {}  # (peer, job id) -> job
        self.pending = FairQueue()  # per peer: (job, regions) rounds waiting for a slot
        self.free_slots = list(range(st.slots))
        self.codecs = Codecs()
        self._stop = False
        self.counters = {"submitted": 0, "rejected": 0, "bad_frames": 0, "cancels": 0, "handler_errors": 0}
        self.counters.update(
            {"registered": 0, "register_refused": 0, "register_deferred": 0, "clients_dropped": 0}
        )

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

    def run(self, notes: tuple[str, ...] = ()) -> None:
        """Serve until SIGTERM/SIGINT (or ``request_stop``); then shut down cleanly. ``notes``: more for
        the start line (e.g. the store proxy's endpoint)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        warm = self.warm_up()
        logger.info("%s", self.start_line((warm, *notes) if warm else notes))
        try:
            while not self._stop:
                ready = dict(poller.poll(100))
                if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                    # INFO: how a server's own data plane ends when SGLang stops the scheduler (no close)
                    logger.info("host pid %d is gone; exiting", self.cfg.parent_pid)
                    break
                if self.events in ready:
                    self._drain_events()
                if self.router in ready:
                    self._drain_router()
                self._expire_clients(time.monotonic())
                if self.unmapping:
                    self.unmapping = [r for r in self.unmapping if not r.try_close()]
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
                self._job_over(frames[0], msg.job)
            self.router.send_multipart(frames, zmq.NOBLOCK)

    def _drain_router(self) -> None:
        P.drain(self.router, self._on_message, self._bad_frame, parts=2)

    def _bad_frame(self, reason: str) -> None:
        self.counters["bad_frames"] += 1
        logger.warning("dropping bad frame from peer: %s", reason)

    def _on_message(self, head: list[bytes], msg: P.Message) -> None:
        peer = head[0]
        client = self.clients.get(peer)
        if client is not None:
            client.last_seen = time.monotonic()
        try:
            self._handle(peer, msg)
        except Exception:  # process boundary: a message must never take the server thread down
            self.counters["handler_errors"] += 1
            logger.exception("handling %s failed", type(msg).__name__)
            if isinstance(msg, P.SubmitFetch):
                self.jobs.pop((peer, msg.job), None)
                self._reject(peer, msg, "internal error")

    def _handle(self, peer: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.Heartbeat):
            stats = {"pipeline": self.pipeline.stats_snapshot(), **self.counters}
            stats["fetch_gate"] = self.pipeline.gate.snapshot()
            stats["cpus"] = sorted(os.sched_getaffinity(0))  # effective affinity (benchmarks check it)
            stats["clients"] = len(self.clients)
            stats["auth_refused"] = self.zap.refused if self.zap else 0
            pong = P.Pong(
                msg.seq,
                msg.sent_ns,
                os.getpid(),
                len(self.jobs),
                json.dumps(stats).encode(),
                peer in self.clients,
            )
            self.router.send_multipart([peer, P.encode(pong)], zmq.NOBLOCK)
        elif isinstance(msg, P.Register):
            self._register(peer, msg)
        elif isinstance(msg, P.Goodbye):
            self.deferred.pop(peer, None)
            self._drop_client(peer, "goodbye", warn=False)  # an ordinary detach
        elif isinstance(msg, P.SubmitFetch):
            self._submit(peer, msg)
        elif isinstance(msg, P.Cancel):
            self._cancel(peer, msg)
        else:
            self.counters["bad_frames"] += 1

    # ---- clients --------------------------------------------------------------------------------
    def start_line(self, notes: tuple[str, ...] = ()) -> str:
        """The one INFO line a data plane logs when it starts serving."""
        cfg, st = self.cfg, self.cfg.settings
        auth_how = "CURVE" if cfg.auth_key else "socket file 0600" if cfg.endpoint.startswith("ipc") else ""
        parts = [
            f"store {redact_url(cfg.store_url)}",
            f"staging {st.slots} x {st.slot_bytes / 2**20:.0f} MiB",
            f"auth: {auth_how}" if auth_how else "",
            f"client timeout {cfg.client_timeout_s:g} s" if cfg.client_timeout_s else "",
            f"{len(cfg.allowed_fingerprints)} models allowed" if cfg.allowed_fingerprints else "",
            *notes,
        ]
        detail = ", ".join(p for p in parts if p)
        return (
            f"sgl-remote-kv {__version__} data plane pid {os.getpid()} serving on {cfg.endpoint} ({detail})"
        )

    def _register(self, peer: bytes, msg: P.Register) -> None:
        """Accept or refuse ``msg`` (answering ``Registered``). A registration of the same peer or the
        same session replaces the old one (its jobs are cancelled); the same registration again on its
        connection is only answered again."""
        current = self.clients.get(peer)
        if current is not None and current.register == msg:
            self._answer_registered(peer)
            return
        if self.deferred.get(peer) == msg:
            return  # answered once the old registration's jobs are over
        self.deferred.pop(peer, None)
        replaced = [c.peer for c in self.clients.values() if c.peer == peer or c.session == msg.session]
        try:
            client = self._new_client(peer, msg, set(replaced))
        except (ValueError, KeyError, TypeError, ChunkError) as e:
            self.counters["register_refused"] += 1
            logger.warning("refusing registration of %r: %s", msg.label, e)
            self.router.send_multipart([peer, P.encode(P.Registered(False, str(e)[:500]))], zmq.NOBLOCK)
            return
        for old in replaced:
            self._drop_client(old, "replaced by a new registration of its session")
        if any(c.session == msg.session and c.jobs for c in self.leaving):
            # The same client's previous registration still has jobs finishing (a slab may still be
            # copied into its region): answer only once they are over, so the client cannot reuse a
            # destination slot an old job still writes into.
            self._release_regions(client.regions.values())
            self.counters["register_deferred"] += 1
            self.deferred = {p: m for p, m in self.deferred.items() if m.session != msg.session}
            self.deferred[peer] = msg  # only the newest connection of a session waits
            return
        self.clients[peer] = client
        self.counters["registered"] += 1
        warm = f", warmed up in {client.warm_s * 1000:.0f} ms" if client.warm_s is not None else ""
        logger.info(
            "client %r registered (codec %s%s; regions %s)",
            msg.label,
            msg.codec,
            warm,
            sorted(client.regions),
        )
        self._answer_registered(peer)

    def _answer_registered(self, peer: bytes) -> None:
        timeout_ms = int(self.cfg.client_timeout_s * 1000)
        self.router.send_multipart(
            [peer, P.encode(P.Registered(True, "", timeout_ms, os.getpid()))], zmq.NOBLOCK
        )

    def _new_client(self, peer: bytes, msg: P.Register, replaced: set[bytes]) -> ClientState:
        """Validate a registration and map its regions; ``ValueError`` with a clear reason otherwise."""
        if len(self.clients) - len(replaced) >= self.cfg.max_clients:
            raise ValueError(f"too many clients (max {self.cfg.max_clients})")
        fp = fingerprint(msg.fingerprint)
        allowed = self.cfg.allowed_fingerprints
        if allowed and fp.digest() not in allowed:
            raise ValueError(
                f"foreign fingerprint: this data plane does not serve model {fp.architecture!r} "
                f"({fp.weights_id!r}, tp {fp.tp_rank}/{fp.tp_size})"
            )
        codec = self.codecs.get(msg.codec, msg.codec_params)
        held = {n: c.label for c in self.clients.values() if c.peer not in replaced for n in c.regions}
        held.update({n: c.label for c in self.leaving if c.session != msg.session for n in c.regions})
        regions = attach_regions(list(msg.regions), held, dict(self.cfg.inherited_regions))
        warm_s = self.codecs.warm(codec, msg.codec, msg.codec_params, fp)
        key = (msg.codec, msg.codec_params)
        return ClientState(peer, msg.session, msg.label, fp, key, regions, time.monotonic(), msg, warm_s)

    def _drop_client(self, peer: bytes, why: str, warn: bool = True) -> None:
        """Forget ``peer``'s registration: finish its queued rounds as cancelled, cancel its admitted jobs;
        its regions are released when its last job is over (at once if it has none)."""
        client = self.clients.pop(peer, None)
        if client is None:
            return
        self.counters["clients_dropped"] += 1
        (logger.warning if warn else logger.info)(
            "client %r dropped (%s): %d jobs cancelled", client.label, why, len(client.jobs)
        )
        self.leaving.append(client)
        for job, regions in self.pending.pop_client(peer):
            job.cancel(0)
            for r in regions:
                self._finish_unadmitted(job, r.index)
        for job_id in list(client.jobs):
            job = self.jobs.get((peer, job_id))
            if job is not None:
                job.cancel(0)
        self._release_if_idle(client)

    def _release_if_idle(self, client: ClientState) -> None:
        if client.jobs or not any(c is client for c in self.leaving):
            return
        self.leaving = [c for c in self.leaving if c is not client]
        self._release_regions(client.regions.values())
        for peer, msg in list(self.deferred.items()):  # a registration waiting for this one's jobs
            if msg.session == client.session and self.deferred.pop(peer, None) is not None:
                self._register(peer, msg)

    def _release_regions(self, regions) -> None:
        """Unmap regions of a client that is gone; unlink those whose creator process is gone too (the
        creator -- ``DpuClient.close`` -- unlinks them otherwise; a live creator's region is never
        unlinked). A region a worker thread still holds a view of (it just emitted the last ``JobDone``)
        is unmapped by a later tick of the server loop."""
        for r in regions:
            if r.exists() and not shm_names.creator_alive(r.name.lstrip("/")):
                logger.info("creator of destination region %s is gone; unlinking it", r.name)
                r.unlink()
            if not r.try_close():
                self.unmapping.append(r)

    def _job_over(self, peer: bytes, job_id: int) -> None:
        """``JobDone`` of ``(peer, job_id)`` was emitted: nothing more is written for it."""
        self.jobs.pop((peer, job_id), None)
        for c in [self.clients.get(peer), *self.leaving]:
            if c is not None and c.peer == peer and job_id in c.jobs:
                c.jobs.discard(job_id)
                self._release_if_idle(c)
                return

    def _expire_clients(self, now: float) -> None:
        timeout = self.cfg.client_timeout_s
        if timeout:
            for c in [c for c in self.clients.values() if now - c.last_seen > timeout]:
                self._drop_client(c.peer, f"silent for {now - c.last_seen:.1f} s")

    # ---- jobs -----------------------------------------------------------------------------------
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
        self.jobs[(peer, msg.job)] = job
        self.clients[peer].jobs.add(msg.job)
        for r in rounds:
            self.pending.append(peer, (job, r))
        self._admit()

    def _prepare(self, peer: bytes, msg: P.SubmitFetch) -> tuple[JobState, list]:
        client = self.clients.get(peer)
        if client is None:
            raise ValueError("not registered (send Register first)")
        if (peer, msg.job) in self.jobs:
            raise ValueError(f"job id {msg.job} already active")
        if len(self.jobs) >= self.cfg.max_jobs:
            raise ValueError("too many active jobs")
        if sum(len(j.dests) for j in self.jobs.values()) + len(msg.chunks) > self.cfg.max_active_chunks:
            raise ValueError("too many active chunks")
        region = check_submit(msg, client.regions, client.fingerprint, client.codec_key)
        fp, layout = client.fingerprint, client.fingerprint.layout
        codec = self.codecs.get(msg.codec, msg.codec_params)
        if msg.output == "codes" and not codec.device_dequant:
            raise ValueError(f"codec {msg.codec} has no device dequant stage: output must be kv")
        blob_area = (msg.blob_off, msg.blob_cap)
        # the jobs of one request share the place of its first job in the pipeline's order (``slab_key``)
        lead = next(
            (j for j in self.jobs.values() if j.peer == peer and j.request_id == msg.request_id), None
        )
        if lead is not None and lead.lead is not None:
            lead = lead.lead
        job = JobState(
            msg.job,
            peer,
            codec,
            fp,
            layout,
            list(msg.chunks),
            blob_area,
            region.array,
            msg.request_id,
            lead,
            codes=msg.output == "codes",
        )
        ratio = self.cfg.settings.inflate_ratio
        rounds = plan_rounds([c.tokens for c in msg.chunks], layout, self.cfg.settings.slot_bytes, ratio)
        return job, rounds

    def warm_up(self) -> str:
        """Decode one synthetic chunk of ``cfg.warm``'s codec and model (before ``run`` answers its first
        ping, so the host's ``wait_ready`` covers it); what the start line says about it ("" when nothing
        was warmed up). A failure is logged and costs only the first job's latency: the data plane serves
        all the same."""
        w = self.cfg.warm
        if w is None:
            return ""
        try:
            codec = self.codecs.get(w.codec, w.codec_params.encode())
            fp = fingerprint(w.fingerprint)
        except (ValueError, KeyError, ChunkError) as e:  # unknown codec, bad params, ...
            logger.warning("warm-up of codec %s failed (%r); the first job loads its kernels", w.codec, e)
            return ""
        seconds = self.codecs.warm(codec, w.codec, w.codec_params.encode(), fp)
        return "" if seconds is None else f"codec {w.codec} warmed up in {seconds * 1000:.0f} ms"

    def _cancel(self, peer: bytes, msg: P.Cancel) -> None:
        self.counters["cancels"] += 1
        job = self.jobs.get((peer, msg.job))
        if job is None:
            return
        job.cancel(msg.from_chunk)

        def keep(item):  # chunks not admitted yet are finished right here
            j, regions = item
            if j is not job:
                return item
            live = [r for r in regions if r.index < job.cancel_from]
            for r in regions[len(live) :]:
                self._finish_unadmitted(job, r.index)
            return (j, live) if live else None

        self.pending.filter(peer, keep)

    def _finish_unadmitted(self, job: JobState, index: int) -> None:
        with job.lock:
            job.terminal += 1
            job.failed += 1
            over = job.terminal == len(job.dests)
        self.router.send_multipart([job.peer, P.encode(P.ChunkFailed(job.job, index, "cancelled", ""))])
        if over:
            self.router.send_multipart([job.peer, P.encode(P.JobDone(job.job, job.done, job.failed))])
            self._job_over(job.peer, job.job)

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
        if self.socket_file is not None:
            self.socket_file.remove()
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()
        clients = list(self.clients.values()) + self.leaving
        self._wait_for_dying_parent([n for c in clients for n in c.regions])
        for c in clients:
            self._release_regions(c.regions.values())
        self.clients.clear()
        self.leaving = []

    def _wait_for_dying_parent(self, names: list[str]) -> None:
        """A host that dies without ``DpuClient.close`` (SGLang's shutdown never calls it; SIGTERM to the
        server's process group) would leak its region's shm (128 MiB+) for good; we unlink regions whose
        creator is gone (``_release_regions``). When that SIGTERM reached us first, give our parent up to
        1 s to go. ``DpuClient.close`` unlinks its region before SIGTERMing us (no wait then)."""
        pid = self.cfg.parent_pid
        if not pid or not names:
            return
        deadline = time.monotonic() + 1.0
        while os.getppid() == pid and time.monotonic() < deadline:
            if not any(os.path.exists("/dev/shm/" + n) for n in names):
                return
            time.sleep(0.05)
