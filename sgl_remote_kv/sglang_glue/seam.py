"""The one place that touches SGLang internals (SGLang 0.5.23).

The tier reaches SGLang through public APIs first: the plugin entry point, ``HookRegistry`` hooks
(``plugin.py``, ``scheduler_hooks.py``) and the ``UnifiedCacheLinker`` API (``linker.py``). Every other read
or write of SGLang's objects goes through the accessors here, so an upgrade is checked against one file;
``check_version()`` refuses other SGLang versions when the tier is on (``SRKV_ALLOW_SGLANG_VERSION=1``
overrides, at the operator's risk). Internals used, and why:

- ``Scheduler``: ``waiting_queue`` (an aborted parked request must sit where ``abort_request`` looks),
  ``tree_cache``, ``dp_tp_cpu_group`` (the TP group the agreement all-reduces over), ``disaggregation_mode``
  (the queue runs only without PD disaggregation), ``_add_request_to_queue`` (hooked: how a request is
  parked and released; ``SchedulerHost.releasing`` lets a release through). ``AbortReq.rid``/``abort_all``.
- ``Req``: ``rid``, ``origin_input_ids``, ``cache_salt``, ``extra_key`` (radix key and tenant namespace; an
  EXACT request's gets ``EXACT_SUFFIX``), ``sampling_params.custom_params`` (``KVFidelity``),
  ``input_embeds``/``session`` (not eligible), ``storage_hit_length``/``storage_hit_start`` (the hit SGLang
  reports), ``finished()``, ``full_untruncated_fill_ids``, ``kv.req_pool_idx`` (the write-back's reads).
- Radix tree (``UnifiedRadixCache``), read only: ``match_prefix`` (``MatchPrefixParams``, ``RadixKey``),
  ``lock``/``unlock`` (the device prefix a parked request builds on), ``tree_core.is_eagle``, ``page_size``;
  ``mem_cache.utils.get_storage_hash_str`` (the linker wrapper's page hashes, which staged pages must
  match). The queue never allocates, inserts or evicts.
- KV pool: ``k_buffer``/``v_buffer`` (the KV writer's targets), ``dtype``/``store_dtype``, ``size``;
  ``ReqToTokenPool.req_to_token`` (a request's slots, for the write-back).
- ``SamplingParams.verify`` (hooked: ``check_sampling_params``); ``ScheduleBatch.forward_mode.is_extend()``,
  ``extend_num_tokens`` (prefill timing for the policy).
- The linker's constructor arguments (public API, read here): ``CacheInitParams``
  (``token_to_kv_pool_allocator.get_kvcache()``, ``req_to_token_pool``, ``page_size``, ``tp_cache_group``),
  ``server_args.model_path``/``trust_remote_code``.
- The offline Engine: ``server_args_class`` (wrapped: ``Engine(remote_kv=...)``); ``shutdown`` (hooked)
  stops the schedulers first via ``tokenizer_manager._subprocess_watchdog``/``_dispatch_to_scheduler``
  (``ShutdownReq``), ``_attached``, ``_scheduler_init_result``, ``get_all_child_pids()`` and the
  ``sglang::scheduler`` process title (``stop_engine_schedulers``).

Threads: scheduler thread only (the linker's load thread uses the KV writer, not this module).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass

import torch

from sgl_remote_kv import env
from sgl_remote_kv.admission.ports import LocalMatch
from sgl_remote_kv.kvpool import KVWriter, PoolTensors, writer_for
from sgl_remote_kv.model import model_identity
from sgl_remote_kv.store.keys import tenant_salt
from sgl_remote_kv.types import KVFidelity, KVLayout, ModelFingerprint, RopeSpec

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not the version this seam was written for."""


def check_version() -> None:
    import sglang

    found = getattr(sglang, "__version__", "unknown")
    if found == SGLANG_VERSION:
        return
    msg = (
        f"sgl-remote-kv was written against SGLang {SGLANG_VERSION} internals "
        f"(sgl_remote_kv/sglang_glue/seam.py); found SGLang {found}"
    )
    if env.allow_other_sglang():
        logger.warning("%s; continuing because SRKV_ALLOW_SGLANG_VERSION=1", msg)
        return
    raise UnsupportedSGLang(
        msg + ". Install sglang==" + SGLANG_VERSION + " or set SRKV_ALLOW_SGLANG_VERSION=1."
    )


# -- requests -----------------------------------------------------------------------------------------
# An EXACT request gets its own local radix namespace: this suffix on ``Req.extra_key`` (folded into every
# radix key and page hash), so it never matches KV loaded from quantized chunks. The tenant salt of the
# remote keys is taken without it: the store is shared by both kinds of request.
EXACT_SUFFIX = "\x1fsrkv:exact"


def req_salt(req) -> str | None:
    key = req.extra_key
    if key is not None and key.endswith(EXACT_SUFFIX):
        key = key[: -len(EXACT_SUFFIX)] or None
    return tenant_salt(req.cache_salt, key)


def req_fidelity(req) -> KVFidelity:
    """The request's ``custom_params["remote_kv"]`` (validated at the API by ``check_sampling_params``;
    a value that slipped past it counts as EXACT: the safe reading)."""
    try:
        return KVFidelity.of_params(getattr(req.sampling_params, "custom_params", None))
    except ValueError:
        return KVFidelity.EXACT


def isolate_exact(req) -> None:
    """Give an EXACT request its own local radix namespace (idempotent: retracted requests come back)."""
    key = req.extra_key or ""
    if not key.endswith(EXACT_SUFFIX):
        req.extra_key = key + EXACT_SUFFIX


def check_sampling_params(sampling_params) -> None:
    """``SamplingParams.verify`` (tokenizer process): refuse a ``remote_kv`` value we do not know with
    SGLang's own error path for bad sampling parameters (``ValueError`` -> HTTP 400)."""
    KVFidelity.of_params(getattr(sampling_params, "custom_params", None))


def req_finished(req) -> bool:
    return req.finished()


def req_fill_ids(req) -> list[int]:
    return req.full_untruncated_fill_ids


def req_kv_indices(req_to_token_pool, req, lo: int, hi: int) -> torch.Tensor | None:
    """KV slots of the request's tokens ``[lo, hi)`` (None once the request left its pool row)."""
    if req.kv.req_pool_idx is None:
        return None
    return req_to_token_pool.req_to_token[req.kv.req_pool_idx, lo:hi]


# -- the radix tree (the device prefix under ``admission.staged_tree.StagedTree``) ---------------------
class DeviceTree:
    """The device prefix of a request and a lock on it (scheduler thread only). The queue never writes
    SGLang's tree or pool: fetched chunks are staged (``StagedTree``) and SGLang's linker wrapper loads
    them into slots it allocates."""

    def __init__(self, tree) -> None:
        self.tree = tree

    @staticmethod
    def supported(tree, chunk_size: int) -> str | None:
        """Why remote reads cannot run on this tree, or None."""
        if getattr(tree.tree_core, "is_eagle", False):
            return "EAGLE bigram radix keys are not supported"
        if chunk_size % max(1, tree.page_size):
            return "chunk size not a multiple of page size"
        return None

    def match(self, req, end: int) -> LocalMatch:
        """Local (device) match of the first ``end`` prompt tokens; no I/O."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        m = self.tree.match_prefix(MatchPrefixParams(key=_radix_key(req, end)))
        return LocalMatch(m.device_prefix_len, m.last_device_node)

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock) -> None:
        if lock is not None:
            self.tree.unlock(lock)


def _radix_key(req, end: int):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", req.origin_input_ids[:end]), req.extra_key, cache_salt=req.cache_salt)


# -- the scheduler (admission.ports.HostOps) ------------------------------------------------------------
class SchedulerHost:
    """Requests and queues of one ``Scheduler``. ``release`` calls the scheduler's (hooked)
    ``_add_request_to_queue`` with ``releasing`` set, so the park hook passes the request through."""

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.releasing = False

    salt, fidelity, isolate_exact = (
        staticmethod(req_salt),
        staticmethod(req_fidelity),
        staticmethod(isolate_exact),
    )

    @staticmethod
    def rid(req) -> str:
        return req.rid

    def prompt(self, req) -> list[int]:
        return req.origin_input_ids

    def eligible(self, req) -> bool:
        # embeddings have no token keys; streaming sessions own their KV row
        return getattr(req, "input_embeds", None) is None and getattr(req, "session", None) is None

    def mark_hit(self, req, start: int, tokens: int) -> None:
        req.storage_hit_length = tokens
        req.storage_hit_start = start

    def release(self, req) -> None:
        self.releasing = True
        try:
            self.s._add_request_to_queue(req)
        finally:
            self.releasing = False

    def hand_to_abort(self, req) -> None:
        self.s.waiting_queue.append(req)

    def waiting(self) -> set[int]:
        return {id(r) for r in self.s.waiting_queue}


def scheduler_tree(scheduler):
    return scheduler.tree_cache


def tp_cpu_group(scheduler):
    """The group of ranks sharing this scheduler's batches (``dp_tp_cpu_group``: the attention-TP group
    with DP attention, else the whole TP group), or None."""
    return getattr(scheduler, "dp_tp_cpu_group", None)


def plain_scheduler(scheduler) -> bool:
    """True for a scheduler without PD disaggregation (the only kind the queue runs in)."""
    mode = getattr(scheduler, "disaggregation_mode", None)
    if mode is None:
        return False
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return mode == DisaggregationMode.NULL


def abort_target(recv_req) -> tuple[str, bool]:
    """(rid prefix, abort all) of an ``AbortReq``."""
    return recv_req.rid or "", bool(recv_req.abort_all)


def prefill_tokens(batch) -> int | None:
    """Tokens a pure prefill (extend) batch computes, or None for other batches."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return None
    return int(getattr(batch, "extend_num_tokens", 0) or 0)


# -- the KV pool ------------------------------------------------------------------------------------------
_TORCH_TO_KV = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class UnsupportedPool(Exception):
    """The KV pool is not a plain MHA pool we can address per layer (MLA, fp8, hybrid...)."""


def pool_layout(kvcache) -> KVLayout:
    """KV layout of a plain MHA pool (``k_buffer``/``v_buffer`` lists of ``[slots, heads, dim]``)."""
    k_buf = getattr(kvcache, "k_buffer", None)
    if not isinstance(k_buf, list) or not k_buf:
        raise UnsupportedPool(f"{type(kvcache).__name__} has no per-layer k_buffer list")
    if getattr(kvcache, "store_dtype", kvcache.dtype) != kvcache.dtype:
        raise UnsupportedPool("quantized KV cache storage is not supported")
    dtype = _TORCH_TO_KV.get(kvcache.dtype)
    if dtype is None:
        raise UnsupportedPool(f"KV dtype {kvcache.dtype} is not supported")
    _, heads, dim = k_buf[0].shape
    return KVLayout(num_layers=len(k_buf), num_kv_heads=int(heads), head_dim=int(dim), dtype=dtype)


def pool_writer(kvcache, layout: KVLayout, ops=None) -> KVWriter:
    """The pool's one ``KVWriter`` (``kvpool``): every write of fetched KV and every read of the
    write-back goes through it; the only code that names ``k_buffer``/``v_buffer``."""
    return writer_for(PoolTensors(kvcache.k_buffer, kvcache.v_buffer), layout, ops=ops)


# -- the linker's build context -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildContext:
    """What the tier needs from the linker's constructor arguments (``linker_build_context``)."""

    kvcache: object
    req_to_token_pool: object
    fingerprint: ModelFingerprint
    rope: RopeSpec | None = None  # the model's RoPE (``rope_of``)
    page_size: int = 1


def rope_of(hf_config) -> RopeSpec | None:
    """The model's RoPE (None, logged, when ``RopeSpec`` cannot describe it: no transform codec then)."""
    try:
        return RopeSpec.from_hf_config(hf_config)
    except ValueError as e:
        logger.info("model RoPE not usable by the transform codec: %s", e)
        return None


def linker_build_context(server_args, params) -> BuildContext:
    """The tier's view of the linker's constructor arguments (``CacheInitParams`` has no model config: it
    is read from ``server_args.model_path``; the TP rank from ``params.tp_cache_group``). Raises
    ``UnsupportedPool`` for pools the tier cannot address."""
    from transformers import AutoConfig

    if getattr(params, "token_to_kv_pool_allocator", None) is None:
        raise UnsupportedPool("the cache has no KV allocator")
    hf = AutoConfig.from_pretrained(server_args.model_path, trust_remote_code=server_args.trust_remote_code)
    group = params.tp_cache_group
    dist = torch.distributed.is_initialized() and group is not None
    rank, size = (
        (torch.distributed.get_rank(group), torch.distributed.get_world_size(group)) if dist else (0, 1)
    )
    return _context(params, server_args.model_path, hf, rank, size)


def _context(params, model_path: str, hf_config, tp_rank: int, tp_size: int) -> BuildContext:
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    archs = getattr(hf_config, "architectures", None) or ["unknown"]
    layout = pool_layout(kvcache)
    fp = ModelFingerprint(archs[0], layout, model_identity(model_path, hf_config), tp_rank, tp_size)
    return BuildContext(kvcache, params.req_to_token_pool, fp, rope_of(hf_config), params.page_size)


def page_hashes(req, end: int, page_size: int) -> list[str]:
    """SGLang's chained storage hashes of the full pages of the first ``end`` prompt tokens: what the
    linker wrapper computes for a request's uncached tail (``mem_cache.utils.get_storage_hash_str``)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = end // page_size * page_size
    return get_storage_hash_str(_radix_key(req, n), None, page_size=page_size) if n else []


# -- the offline Engine -----------------------------------------------------------------------------------
_ENGINE_MODULE = "sglang.srt.entrypoints.engine"
_SCHEDULER_TITLE = "sglang::scheduler"  # the scheduler processes' title (setproctitle)


def wrap_engine_server_args(make) -> bool:
    """Route ``sglang.Engine(**kwargs)``'s ``ServerArgs`` (``self.server_args_class(**kwargs)``, a class
    attribute SGLang declares for overriding them) through ``make(original, **kwargs)``. No HookRegistry
    target reaches that call (a msgspec Struct ignores a replaced ``__init__``; a hook on ``Engine.__init__``
    is applied too late for the first Engine; a REPLACE of the attribute reaches every ``ServerArgs``
    name), so the attribute is wrapped, once, where the Engine is imported. False: nothing to wrap."""
    import sys

    module = sys.modules.get(_ENGINE_MODULE)
    if module is None:
        return False
    engine = module.Engine
    current = engine.__dict__.get("server_args_class")
    if current is None or getattr(current, "_srkv_make", None) is not None:
        return False
    original = current.__func__ if isinstance(current, staticmethod) else current

    def server_args_class(*args, **kwargs):
        return make(original, *args, **kwargs)

    server_args_class._srkv_make = make
    engine.server_args_class = staticmethod(server_args_class)
    return True


def engine_module_loaded() -> bool:
    import sys

    return _ENGINE_MODULE in sys.modules


def stop_engine_schedulers(engine, timeout_s: float) -> bool | None:
    """Stop an ``sglang.Engine``'s schedulers the way a server's SIGTERM does (``Engine.shutdown`` SIGKILLs
    them): stop the subprocess watchdog (an exiting scheduler is expected now; it would SIGQUIT this
    process), send ``ShutdownReq`` through the tokenizer manager (the scheduler's loop ends and
    ``release_host_resources()`` drains the write-back), and give the Engine's ``sglang::scheduler``
    processes ``timeout_s`` to exit. True: all exited; False: timeout; None: nothing to stop (an attached
    tokenizer worker, an Engine that never started or already shut down)."""
    import psutil
    from sglang.srt.managers.io_struct import ShutdownReq

    tm = getattr(engine, "tokenizer_manager", None)
    if (
        getattr(engine, "_attached", False)
        or tm is None
        or getattr(engine, "_scheduler_init_result", None) is None
    ):
        return None
    schedulers = []
    for pid in engine.get_all_child_pids():
        try:
            proc = psutil.Process(pid)
            if " ".join(proc.cmdline()).startswith(_SCHEDULER_TITLE):
                schedulers.append(proc)
        except (psutil.Error, OSError):
            continue
    if not schedulers:
        return None
    if tm._subprocess_watchdog is not None:
        tm._subprocess_watchdog.stop()
    tm._dispatch_to_scheduler(ShutdownReq())
    _, alive = psutil.wait_procs(schedulers, timeout=timeout_s)
    return not alive
