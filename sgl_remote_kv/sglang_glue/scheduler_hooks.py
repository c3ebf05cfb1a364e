"""HookRegistry hooks on SGLang's ``Scheduler`` that run the waiting_for_KV queue, and the write-back hook.

Hooks (registered by ``register()`` from the plugin's ``load()``, in every process; they do nothing
unless ``--remote-kv`` is on and the linker built the runtime):

- AROUND ``_add_request_to_queue``: a new request whose prompt may hit the remote tier is parked in
  the waiting_for_KV queue instead of SGLang's waiting queue (retracted requests pass through).
- BEFORE ``_process_hicache_events`` (first thing of every ``get_next_batch_to_run``): follow the store
  generation (``generation.GenerationWatch``), poll the queue; requests whose KV is installed (or that
  missed) are released into SGLang's waiting queue in
  time for this very scheduling pass.
- AFTER ``is_fully_idle``: not idle while requests are parked (keeps ``--sleep-on-idle`` and the idle
  leak checks away from in-flight fetches).
- BEFORE ``on_idle``: with nothing to run but parked requests, wait a few ms for a worker to report
  progress instead of spinning a core.
- BEFORE ``abort_request``: cancel parked requests' fetches and hand them to SGLang's abort path.
- AROUND ``run_batch``: time prefill batches for the policy's prefill-time model. With the overlap
  scheduler a batch's time includes waiting for the previous one, a slight over-estimate of
  recompute cost (it biases towards fetching).
- AFTER ``UnifiedRadixCache.checkpoint`` (after each prefill chunk and at finish): hand the newly computed
  full chunks to the write-back worker (``after_checkpoint``).

The queue's tree is ``admission.staged_tree.StagedTree`` over the device prefix (``seam.DeviceTree``): a
released request's chunks are staged, and SGLang's linker wrapper loads them (``linker.py``).

All hooks run on the scheduler thread. The queue object (``admission.WaitingForKV``) of a scheduler is
kept here (``_QUEUES``, weakly keyed by the scheduler: nothing is written on SGLang's object), created on
first use with its collaborators from the process's runtime and the SGLang seam. A released request goes
back through ``_add_request_to_queue`` (``SchedulerHost.release``), which this hook passes through while
``host.releasing`` is set.
"""

from __future__ import annotations

import logging
import time
import weakref

from sgl_remote_kv import runtime
from sgl_remote_kv.admission import Agreement, Collaborators, WaitingForKV
from sgl_remote_kv.admission.staged_tree import StagedTree
from sgl_remote_kv.sglang_glue import seam
from sgl_remote_kv.types import FailureKind

logger = logging.getLogger(__name__)

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
# scheduler -> its queue (None: the tier is off for it); a scheduler that is gone takes its entry along
_QUEUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _built(scheduler) -> WaitingForKV | None:
    """The scheduler's queue if ``_queue`` built one (never builds)."""
    return _QUEUES.get(scheduler)


def _queue(scheduler) -> WaitingForKV | None:
    """The scheduler's WaitingForKV, or None when the tier is off on this process."""
    q = _QUEUES.get(scheduler, False)
    if q is False:
        rt = runtime.get()
        q = None
        try:
            if rt is not None and seam.plain_scheduler(scheduler):
                q = _build_queue(scheduler, rt)
        except Exception as e:  # boundary: the tier off for this scheduler, never a crashed server
            rt.metrics.failure(FailureKind.INTERNAL)
            logger.error("remote KV reads disabled: building the waiting_for_KV queue failed: %r", e)
        _QUEUES[scheduler] = q
    return q


def _build_queue(scheduler, rt: runtime.RemoteKVRuntime) -> WaitingForKV | None:
    tree = seam.scheduler_tree(scheduler)
    why = seam.DeviceTree.supported(tree, rt.chunk_size)
    if why is not None:
        logger.warning("remote KV reads disabled: %s", why)
        return None
    page = rt.staged.page
    c = Collaborators(
        tree=StagedTree(seam.DeviceTree(tree), rt.staged, lambda req, end: seam.page_hashes(req, end, page)),
        host=seam.SchedulerHost(scheduler),
        paths=rt.paths,
        policy=rt.policy,
        metrics=rt.metrics,
        lookup=rt.client.lookup_prefix,
        delete=rt.client.delete_many,
        keys=rt.keys.keys_for,
        tail_keys=rt.keys.tail_keys,
        agreement=Agreement.over(seam.tp_cpu_group(scheduler)),
        bytes_per_token=rt.fingerprint.layout.bytes_per_token(),
        wakeup=rt.wakeup,
        layerwise=rt.layerwise,
        on_installed=rt.writeback.note_present if rt.writeback is not None else None,
        write_codec=rt.codec,
    )
    logger.info("remote KV waiting_for_KV queue active")
    return WaitingForKV(c, rt.admission)


def around_add_request_to_queue(original, self, req, is_retracted: bool = False, *args, **kwargs):
    q = _queue(self)
    if q is None or is_retracted or args or kwargs or q.c.host.releasing:
        return original(self, req, is_retracted, *args, **kwargs)
    try:
        parked = q.park(req)
    except Exception as e:  # boundary: the tier must never lose a request
        q.c.metrics.failure(FailureKind.PARK)
        logger.warning("remote KV park failed for %s: %r", seam.SchedulerHost.rid(req), e)
        parked = False
    if not parked:
        return original(self, req, is_retracted)
    return None


def before_process_hicache_events(self, *args, **kwargs):
    q = _queue(self)
    if q is not None:
        rt = runtime.get()
        if rt.generation is not None:
            rt.generation.poll()  # other servers' tier flushes (never blocks: the read is on a worker)
        q.poll()


def after_is_fully_idle(result, self, *args, **kwargs):
    if result:
        q = _built(self)
        if q is not None and q.busy():
            return False
    return result


def before_on_idle(self, *args, **kwargs):
    q = _built(self)
    if q is not None and q.busy():
        q.wait()


def before_abort_request(self, recv_req, *args, **kwargs):
    q = _built(self)
    if q is not None:
        q.abort(*seam.abort_target(recv_req))


def around_run_batch(original, self, batch, *args, **kwargs):
    """Time pure prefill batches to fit the policy's prefill-time model (the recompute estimate), and tell
    the write-back the server is serving (it paces its encoding then)."""
    rt = runtime.get()
    if rt is not None and rt.writeback is not None:
        rt.writeback.note_serving()
    q = _built(self)
    tokens = seam.prefill_tokens(batch) if q is not None else None
    if tokens is None:
        return original(self, batch, *args, **kwargs)
    t0 = time.perf_counter()
    result = original(self, batch, *args, **kwargs)
    q.c.policy.observe_prefill(tokens, time.perf_counter() - t0)
    return result


def after_checkpoint(result, cache, req, *args, up_to: int, **kwargs):
    """AFTER hook on ``UnifiedRadixCache.checkpoint`` (scheduler thread, after each prefill chunk and at
    finish): hand the newly computed full chunks to the write-back worker."""
    rt = runtime.get()
    if rt is None or rt.writeback is None:
        return result
    try:
        rt.writeback.offer(req, up_to, final=seam.req_finished(req))
    except Exception as e:  # boundary: write-back must never break the scheduler
        rt.metrics.failure(FailureKind.WRITEBACK_OFFER)
        logger.warning("write-back offer failed for %s: %r", seam.SchedulerHost.rid(req), e)
    if seam.req_finished(req):
        rt.writeback.forget(seam.SchedulerHost.rid(req))
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
        after_checkpoint,
        HookType.AFTER,
    )
    HookRegistry.register(f"{_SCHED}._add_request_to_queue", around_add_request_to_queue, HookType.AROUND)
    HookRegistry.register(f"{_SCHED}._process_hicache_events", before_process_hicache_events, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.is_fully_idle", after_is_fully_idle, HookType.AFTER)
    HookRegistry.register(f"{_SCHED}.on_idle", before_on_idle, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.abort_request", before_abort_request, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.run_batch", around_run_batch, HookType.AROUND)
