"""The data plane's client table: host clients' registrations, their replacement and drop, and the
destination regions they registered.

A client first ``Register``s on its connection (fingerprint, codec, the shm destination regions it
created); only then may it submit jobs (``jobs.py``), and only into those regions, for that model and
codec. A client that says ``Goodbye``, sends nothing for ``client_timeout_s`` or is replaced by a newer
registration of its session is dropped: its queued rounds are finished as cancelled, its admitted jobs
cancelled (both by the job table, through ``cancel_jobs``), and once its last job reported ``JobDone``
(``ClientTable.job_over``) its regions are unmapped (and unlinked when their creator process is gone). A
``Register`` repeating the registration of its connection (a client resends it until answered) is
answered again, nothing else.

Logs: one INFO line per accepted registration (``client ... registered``) and per ``Goodbye``
(``client ... detached (goodbye)``); WARNING for a client dropped while live (``client ... dropped
(silent for ...)``, replaced) and for refused registrations.

Threads: server thread only (``server.DataPlaneServer`` calls in; nothing here is locked).

Ownership: destination regions belong to the hosts that created them (attached here by name on
``Register``, or by the descriptor our spawning host passed down; unlinked here only when their creator
is gone).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.types import ModelFingerprint

from .buffers import DestRegion
from .config import DataPlaneConfig
from .validate import Codecs, attach_regions, fingerprint

logger = logging.getLogger(__name__)


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


class ClientTable:
    """The registered clients by peer (routing id), the dropped ones whose jobs are still finishing, the
    registrations waiting for those, and released regions a worker still held a view of.

    ``send(peer, msg, flags)``: answer a peer on the ROUTER socket (``Registered``). ``cancel_jobs(peer,
    jobs)``: finish a dropped client's queued rounds as cancelled and cancel its admitted jobs
    (``JobTable.cancel_client``; ``jobs`` is the client's live set of job ids). ``counters``: the server's
    (``Heartbeat`` reports them); this table counts ``registered``, ``register_refused``,
    ``register_deferred`` and ``clients_dropped``."""

    def __init__(
        self,
        cfg: DataPlaneConfig,
        codecs: Codecs,
        counters: dict[str, int],
        send: Callable[[bytes, P.Message, int], None],
        cancel_jobs: Callable[[bytes, set[int]], None],
    ) -> None:
        self.cfg, self.codecs, self.counters = cfg, codecs, counters
        self._send, self._cancel_jobs = send, cancel_jobs
        self.clients: dict[bytes, ClientState] = {}  # peer (routing id) -> registration
        self.leaving: list[ClientState] = []  # dropped clients whose jobs are still finishing
        self.deferred: dict[bytes, P.Register] = {}  # registrations waiting for their session's old jobs
        self.unmapping: list[DestRegion] = []  # released regions a worker still held a view of

    def __len__(self) -> int:
        return len(self.clients)

    def __contains__(self, peer: bytes) -> bool:
        return peer in self.clients

    def get(self, peer: bytes) -> ClientState | None:
        return self.clients.get(peer)

    def touch(self, peer: bytes) -> None:
        """``peer`` sent something (it is not silent)."""
        client = self.clients.get(peer)
        if client is not None:
            client.last_seen = time.monotonic()

    def register(self, peer: bytes, msg: P.Register) -> None:
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
            self._send(peer, P.Registered(False, str(e)[:500]), zmq.NOBLOCK)
            return
        for old in replaced:
            self.drop(old, "replaced by a new registration of its session")
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

    def goodbye(self, peer: bytes) -> None:
        """``peer`` detaches (an ordinary ``Goodbye``)."""
        self.deferred.pop(peer, None)
        self.drop(peer, "goodbye", warn=False)

    def _answer_registered(self, peer: bytes) -> None:
        timeout_ms = int(self.cfg.client_timeout_s * 1000)
        self._send(peer, P.Registered(True, "", timeout_ms, os.getpid()), zmq.NOBLOCK)

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

    def drop(self, peer: bytes, why: str, warn: bool = True) -> None:
        """Forget ``peer``'s registration: finish its queued rounds as cancelled, cancel its admitted jobs;
        its regions are released when its last job is over (at once if it has none). Logs one line:
        WARNING ``client ... dropped (why)``, or INFO ``client ... detached (goodbye)`` when not ``warn``."""
        client = self.clients.pop(peer, None)
        if client is None:
            return
        self.counters["clients_dropped"] += 1
        if warn:  # dropped while live: an operator should look
            logger.warning("client %r dropped (%s): %d jobs cancelled", client.label, why, len(client.jobs))
        else:  # it said Goodbye: an ordinary detach
            logger.info("client %r detached (%s): %d jobs cancelled", client.label, why, len(client.jobs))
        self.leaving.append(client)
        self._cancel_jobs(peer, client.jobs)
        self._release_if_idle(client)

    def _release_if_idle(self, client: ClientState) -> None:
        if client.jobs or not any(c is client for c in self.leaving):
            return
        self.leaving = [c for c in self.leaving if c is not client]
        self._release_regions(client.regions.values())
        for peer, msg in list(self.deferred.items()):  # a registration waiting for this one's jobs
            if msg.session == client.session and self.deferred.pop(peer, None) is not None:
                self.register(peer, msg)

    def _release_regions(self, regions) -> None:
        """Unmap regions of a client that is gone; unlink those whose creator process is gone too (the
        creator -- ``DpuClient.close`` -- unlinks them otherwise; a live creator's region is never
        unlinked). A region a worker thread still holds a view of (it just emitted the last ``JobDone``)
        is unmapped by a later tick of the server loop (``unmap_released``)."""
        for r in regions:
            if r.exists() and not shm_names.creator_alive(r.name.lstrip("/")):
                logger.info("creator of destination region %s is gone; unlinking it", r.name)
                r.unlink()
            if not r.try_close():
                self.unmapping.append(r)

    def job_over(self, peer: bytes, job_id: int) -> None:
        """``JobDone`` of ``(peer, job_id)`` was emitted: nothing more is written for it."""
        for c in [self.clients.get(peer), *self.leaving]:
            if c is not None and c.peer == peer and job_id in c.jobs:
                c.jobs.discard(job_id)
                self._release_if_idle(c)
                return

    def expire(self, now: float) -> None:
        """Drop the clients silent for longer than ``client_timeout_s`` (never when it is 0)."""
        timeout = self.cfg.client_timeout_s
        if timeout:
            for c in [c for c in self.clients.values() if now - c.last_seen > timeout]:
                self.drop(c.peer, f"silent for {now - c.last_seen:.1f} s")

    def unmap_released(self) -> None:
        """Unmap the released regions no worker holds a view of any more (a tick of the server loop)."""
        if self.unmapping:
            self.unmapping = [r for r in self.unmapping if not r.try_close()]

    def close(self) -> None:
        """At shutdown (the pipeline stopped): release every client's regions, registered or leaving."""
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
