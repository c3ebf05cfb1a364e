"""HookRegistry hooks on SGLang's ``Scheduler`` that run the waiting_for_KV queue.

Hooks (registered by ``register()`` from the plugin's ``load()``, in every process; they do nothing
unless ``--remote-kv`` is on and the ``remote_kv`` radix cache built the runtime):

- AROUND ``_add_request_to_queue``: a new request whose prompt may hit the remote tier is parked in
  the waiting_for_KV queue instead of SGLang's waiting queue (retracted requests pass through).
- BEFORE ``_process_hicache_events`` (first thing of every ``get_next_batch_to_run``): poll the
  queue; requests whose KV is installed (or that missed) are released into SGLang's waiting queue in
  time for this very scheduling pass.
- AFTER ``is_fully_idle``: not idle while requests are parked (keeps ``--sleep-on-idle`` and the idle
  leak checks away from in-flight fetches).
- BEFORE ``on_idle``: with nothing to run but parked requests, wait a few ms for a worker to report
  progress instead of spinning a core.
- BEFORE ``abort_request``: cancel parked requests' fetches and hand them to SGLang's abort path.
- AROUND ``run_batch``: time prefill batches for the policy's prefill-time model. With the overlap
  scheduler a batch's time includes waiting for the previous one, a slight over-estimate of
  recompute cost (it biases towards fetching).

All hooks run on the scheduler thread. The queue object lives on the scheduler instance
(``scheduler._srkv_queue``), created on first use.
"""

from __future__ import annotations

import logging
import time

from sgl_remote_kv.sglang_glue import runtime
from sgl_remote_kv.types import FailureKind

logger = logging.getLogger(__name__)

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_ATTR = "_srkv_queue"


def _queue(scheduler):
    """The scheduler's WaitingForKV, or None when the tier is off on this process."""
    q = scheduler.__dict__.get(_ATTR, False)
    if q is not False:
        return q
    rt = runtime.get()
    q = None
    if rt is not None and getattr(scheduler, "disaggregation_mode", None) is not None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        if scheduler.disaggregation_mode == DisaggregationMode.NULL:
            from sgl_remote_kv.sglang_glue.waiting_queue import WaitingForKV

            q = WaitingForKV(scheduler, rt, release=lambda req: _enqueue_original(scheduler, req))
            logger.info("remote KV waiting_for_KV queue active")
    scheduler.__dict__[_ATTR] = q
    return q


_ORIGINAL_ENQUEUE = {}


def _enqueue_original(scheduler, req) -> None:
    _ORIGINAL_ENQUEUE["fn"](scheduler, req)


def around_add_request_to_queue(original, self, req, is_retracted: bool = False, *args, **kwargs):
    _ORIGINAL_ENQUEUE.setdefault("fn", original)
    q = _queue(self)
    if q is None or is_retracted or args or kwargs:
        return original(self, req, is_retracted, *args, **kwargs)
    try:
        parked = q.park(req)
    except Exception as e:  # boundary: the tier must never lose a request
        q.rt.metrics.failure(FailureKind.PARK)
        logger.warning("remote KV park failed for %s: %r", req.rid, e)
        parked = False
    if not parked:
        return original(self, req, is_retracted)
    return None


def before_process_hicache_events(self, *args, **kwargs):
    q = _queue(self)
    if q is not None:
        q.poll()


def after_is_fully_idle(result, self, *args, **kwargs):
    if result:
        q = self.__dict__.get(_ATTR)
        if q is not None and q.busy():
            return False
    return result


def before_on_idle(self, *args, **kwargs):
    q = self.__dict__.get(_ATTR)
    if q is not None and q.busy():
        q.wait(q.rt.settings.idle_wait_s)


def before_abort_request(self, recv_req, *args, **kwargs):
    q = self.__dict__.get(_ATTR)
    if q is not None:
        q.abort(recv_req.rid or "", bool(recv_req.abort_all))


def around_run_batch(original, self, batch, *args, **kwargs):
    """Time pure prefill batches to fit the policy's prefill-time model (the recompute estimate)."""
    q = self.__dict__.get(_ATTR)
    mode = getattr(batch, "forward_mode", None)
    if q is None or mode is None or not mode.is_extend():
        return original(self, batch, *args, **kwargs)
    t0 = time.perf_counter()
    result = original(self, batch, *args, **kwargs)
    tokens = int(getattr(batch, "extend_num_tokens", 0) or 0)
    q.rt.policy.observe_prefill(tokens, time.perf_counter() - t0)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_SCHED}._add_request_to_queue", around_add_request_to_queue, HookType.AROUND)
    HookRegistry.register(f"{_SCHED}._process_hicache_events", before_process_hicache_events, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.is_fully_idle", after_is_fully_idle, HookType.AFTER)
    HookRegistry.register(f"{_SCHED}.on_idle", before_on_idle, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.abort_request", before_abort_request, HookType.BEFORE)
    HookRegistry.register(f"{_SCHED}.run_batch", around_run_batch, HookType.AROUND)
