"""The data plane's job table: submitted jobs, their rounds' admission into the staging slots, cancels.

Job ids are per client (the table is keyed by (peer, job id)). A ``SubmitFetch`` from a registered
client is checked against its registration (``validate.check_submit``) and the table's limits, then
planned into rounds (``buffers.plan_rounds``); otherwise it is rejected (``ChunkFailed`` ``bad_request``
for every chunk, then ``JobDone``). Rounds wait for a staging slot in one FIFO per client and are
admitted round-robin across clients (``tasks.FairQueue``); the staging slots and the pipeline are
shared. Chunks cancelled (or whose client was dropped) before their round was admitted are finished here
(``ChunkFailed`` ``cancelled``); the pipeline finishes the admitted ones. Once a job's ``JobDone`` was
sent it leaves the table and its client is told (``ClientTable.job_over``).

Logs: one WARNING per rejected job.

Threads: server thread only (``server.DataPlaneServer`` calls in: messages, freed slots, ``JobDone``s
the pipeline emitted). A ``JobState`` is created here and shared with the pipeline workers, which
mutate it under its ``lock``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.sizing import ChunkRegion, plan_rounds

from .clients import ClientTable
from .config import DataPlaneConfig
from .tasks import FairQueue, JobState
from .validate import Codecs, check_submit

logger = logging.getLogger(__name__)


class JobTable:
    """Active jobs by (peer, job id), rounds waiting for a slot, and the free staging slots.

    ``send(peer, msg)``: a message to a peer on the ROUTER socket. ``submit_round(job, regions, slot)``:
    hand an admitted round to the pipeline (``Pipeline.submit_round``). ``clients``: the registrations
    jobs are checked against and whose job sets this table keeps. ``counters``: the server's
    (``Heartbeat`` reports them); this table counts ``submitted``, ``rejected`` and ``cancels``."""

    def __init__(
        self,
        cfg: DataPlaneConfig,
        codecs: Codecs,
        counters: dict[str, int],
        send: Callable[[bytes, P.Message], None],
        submit_round: Callable[[JobState, list[ChunkRegion], int], None],
        clients: ClientTable,
    ) -> None:
        self.cfg, self.codecs, self.counters = cfg, codecs, counters
        self._send, self._submit_round, self.clients = send, submit_round, clients
        self.jobs: dict[tuple[bytes, int], JobState] = {}  # (peer, job id) -> job
        self.pending = FairQueue()  # per peer: (job, regions) rounds waiting for a slot
        self.free_slots = list(range(cfg.settings.slots))

    def __len__(self) -> int:
        return len(self.jobs)

    def submit(self, peer: bytes, msg: P.SubmitFetch) -> None:
        try:
            job, rounds = self._prepare(peer, msg)
        except (ValueError, KeyError, TypeError, ChunkError) as e:
            self._reject(peer, msg, str(e)[:400])
            return
        self.counters["submitted"] += 1
        self.jobs[(peer, msg.job)] = job
        self.clients.get(peer).jobs.add(msg.job)
        for r in rounds:
            self.pending.append(peer, (job, r))
        self._admit()

    def internal_error(self, peer: bytes, msg: P.SubmitFetch) -> None:
        """Handling ``msg`` raised: forget the job and reject it."""
        self.jobs.pop((peer, msg.job), None)
        self._reject(peer, msg, "internal error")

    def _reject(self, peer: bytes, msg: P.SubmitFetch, detail: str) -> None:
        self.counters["rejected"] += 1
        logger.warning("rejecting job %d: %s", msg.job, detail)
        for i in range(len(msg.chunks)):
            self._send(peer, P.ChunkFailed(msg.job, i, "bad_request", detail))
        self._send(peer, P.JobDone(msg.job, 0, len(msg.chunks)))

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

    def cancel(self, peer: bytes, msg: P.Cancel) -> None:
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

    def cancel_client(self, peer: bytes, job_ids: set[int]) -> None:
        """``peer`` was dropped: finish its queued rounds as cancelled, then cancel its admitted jobs
        (``job_ids``: its live set of job ids, read once the queued rounds are finished)."""
        for job, regions in self.pending.pop_client(peer):
            job.cancel(0)
            for r in regions:
                self._finish_unadmitted(job, r.index)
        for job_id in list(job_ids):
            job = self.jobs.get((peer, job_id))
            if job is not None:
                job.cancel(0)

    def _finish_unadmitted(self, job: JobState, index: int) -> None:
        with job.lock:
            job.terminal += 1
            job.failed += 1
            over = job.terminal == len(job.dests)
        self._send(job.peer, P.ChunkFailed(job.job, index, "cancelled", ""))
        if over:
            self._send(job.peer, P.JobDone(job.job, job.done, job.failed))
            self.job_over(job.peer, job.job)

    def job_over(self, peer: bytes, job_id: int) -> None:
        """``JobDone`` of ``(peer, job_id)`` was emitted: nothing more is written for it."""
        self.jobs.pop((peer, job_id), None)
        self.clients.job_over(peer, job_id)

    def slot_freed(self, slot: int) -> None:
        """The pipeline is done with staging slot ``slot``: admit the next round into it."""
        self.free_slots.append(slot)
        self._admit()

    def _admit(self) -> None:
        while self.free_slots and self.pending:
            job, regions = self.pending.popleft()
            self._submit_round(job, regions, self.free_slots.pop())
