"""The one place that touches SGLang internals (SGLang 0.5.23).

Entry points (hooks and registries) live in ``plugin.py``, ``scheduler_hooks.py`` and ``radix_cache.py``;
every *read or write of SGLang's objects* goes through the named accessors here, so an SGLang upgrade is
checked against one file. ``check_version()`` refuses other SGLang versions with a clear error when the
tier is enabled (``SRKV_ALLOW_SGLANG_VERSION=1`` overrides, at the operator's risk).

Internals used, and why no public seam covers them (0.5.23):

- ``Scheduler``: ``waiting_queue`` (a request is *released* by SGLang's own ``_add_request_to_queue``,
  but an aborted parked request must sit in ``waiting_queue`` where ``abort_request`` looks);
  ``tree_cache``; ``dp_tp_cpu_group`` (the TP CPU group the agreement all-reduces over);
  ``disaggregation_mode`` (the queue runs only without PD disaggregation).
- ``Req``: ``rid``, ``origin_input_ids``, ``cache_salt``, ``extra_key`` (the radix key and the tenant
  namespace; an EXACT request's gets ``EXACT_SUFFIX``), ``sampling_params.custom_params``
  (``KVFidelity``), ``input_embeds``/``session`` (not eligible), ``storage_hit_length``/``storage_hit_start``
  (HiCache's storage-hit fields, which SGLang's metrics report as storage-cached tokens),
  ``full_untruncated_fill_ids`` and ``kv.req_pool_idx`` (the write-back reads computed KV).
- Radix tree (``UnifiedRadixCache``): ``match_prefix``/``insert`` with ``MatchPrefixParams``/``InsertParams``
  and ``RadixKey``, ``lock``/``unlock``, ``path_device_indices``, ``token_to_kv_pool_allocator``
  (``alloc``/``free``/``size``/``get_kvcache``), ``evict_from_tree_cache``, ``tree_core.is_eagle``, ``page_size``.
  SGLang's ``_prefetch_kvcache`` / HiCache storage path only loads into *host* memory and promises the
  hit inside ``match_prefix``; the tier needs device nodes installed *before* admission, so it uses the
  tree directly.
- ``Scheduler._add_request_to_queue`` is also how a released request joins SGLang's queue (hooked: the
  park hook passes it through while ``SchedulerHost.releasing`` is set). ``AbortReq.rid``/``abort_all``.
- KV pool: ``k_buffer``/``v_buffer`` (the KV writer's targets), ``dtype``/``store_dtype``, ``size``,
  ``register_layer_transfer_counter`` (layer-wise admission: HiCache's layer-done counter slot; SGLang
  reads the counter's ``consumer_index`` and ``num_layers``, e.g. the full prefill graph's pre-replay wait).
- ``ReqToTokenPool.req_to_token`` (the write-back's slot indices of a request).
- ``SamplingParams.verify`` (hooked: ``check_sampling_params`` refuses unknown ``remote_kv`` values).
- ``ScheduleBatch``: ``forward_mode.is_extend()``, ``extend_num_tokens`` (prefill timing for the policy).
- The radix-cache factory's ``TreeCacheBuildContext``: ``params.token_to_kv_pool_allocator``,
  ``params.req_to_token_pool``, ``model_config.hf_config`` (``architectures``, RoPE fields), ``server_args.model_path``,
  ``tp_rank``/``tp_size``.
- Graceful scheduler exit: ``BasePrefixCache.release_host_resources`` (our cache overrides it; SGLang calls
  it from ``run_scheduler_process``'s ``finally`` after a ``ShutdownReq`` ended the event loop).
- The offline Engine (``sglang.srt.entrypoints.engine.Engine``): ``server_args_class`` (wrapped so
  ``Engine(remote_kv=...)`` works: ``wrap_engine_server_args``); ``shutdown`` (hooked) stops the schedulers
  first through ``tokenizer_manager._subprocess_watchdog``/``_dispatch_to_scheduler(ShutdownReq())``,
  ``_attached``, ``_scheduler_init_result``, ``get_all_child_pids()`` and the ``sglang::scheduler`` process
  title (``stop_engine_schedulers``).

Threads: scheduler thread only, except the layer counter (forward thread; see ``layerwise.py``).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass

import torch

from sgl_remote_kv import env
from sgl_remote_kv.kvpool import KVWriter, PoolTensors, writer_for
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
# An EXACT request whose KV may come from a lossy codec gets its own local radix namespace: this suffix on
# ``Req.extra_key`` (SGLang folds ``extra_key`` into every radix key, as it does for LoRA ids and elastic
# EP namespaces), so it never matches tree nodes installed from quantized chunks. The tenant salt of the
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


# -- the radix tree and the KV allocator (admission.ports.TreeOps) ------------------------------------
@dataclass(frozen=True)
class LocalMatch:
    prefix_len: int
    node: object


class SGLangTree:
    """The few tree/pool operations the admission queue needs (scheduler thread only).

    Insert semantics (``UnifiedRadixCache.insert``): tokens ``[0, prev_prefix_len)`` are the caller's
    already-tree-owned prefix; slots of tokens past it that the tree already holds (someone computed them
    meanwhile) are freed by the insert itself as duplicates; the rest become tree-owned. The new node is
    locked until the request is admitted (its own match then locks it)."""

    def __init__(self, tree, kv_writer) -> None:
        self.tree = tree
        self.allocator = tree.token_to_kv_pool_allocator
        self.kv_writer = kv_writer

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

    def capacity(self) -> int:
        return int(self.allocator.size)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Reserve ``n`` KV slots, evicting unlocked cache if needed; ``None`` if the pool is full."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(self.tree, n)
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor | None) -> None:
        """Return slots to SGLang's allocator, after fencing every KV write (a late write to them is
        ordered before their next user)."""
        if slots is not None and slots.numel():
            self.kv_writer.fence()
            self.allocator.free(slots)

    def write(self, slots: torch.Tensor, handle) -> None:
        """A finished fetch's staged KV (its first ``len(slots)`` tokens) into ``slots``; raises
        ``KVWriteError`` (the slots hold garbage then)."""
        handle.write_staged(self.kv_writer, slots.to("cpu", torch.int64), len(slots))

    def insert(self, req, prefix_node, start: int, slots: torch.Tensor):
        """Insert tokens ``[0, start + len(slots))``: the tree's own ``[0, start)`` (path of the locked
        ``prefix_node``) followed by ``slots``, after fencing every KV write. Returns a lock on the new
        last node."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        self.kv_writer.fence()
        prefix = self.tree.path_device_indices(prefix_node)[:start].to(torch.int64)
        if len(prefix) != start:
            raise RuntimeError(f"prefix node holds {len(prefix)} tokens, expected {start}")
        value = torch.cat([prefix, slots.to(device=prefix.device, dtype=torch.int64)])
        end = start + len(slots)
        res = self.tree.insert(InsertParams(key=_radix_key(req, end), value=value, prev_prefix_len=start))
        return self.tree.lock(res.last_device_node)


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


def attach_layer_counter(kvcache, counter) -> str | None:
    """Register ``counter`` as the pool's layer-transfer counter (HiCache's slot, which attention's
    ``get_key_buffer``/``get_value_buffer`` wait on). Returns why it could not, or None."""
    if not hasattr(kvcache, "register_layer_transfer_counter"):
        return f"{type(kvcache).__name__} has no layer-transfer counter"
    if getattr(kvcache, "layer_transfer_counter", None) is not None:
        return "the pool's layer-transfer counter is taken (HiCache)"
    kvcache.register_layer_transfer_counter(counter)
    return None


# -- the radix-cache factory's build context --------------------------------------------------------------
@dataclass(frozen=True)
class BuildContext:
    """What the tier needs from SGLang's ``TreeCacheBuildContext``."""

    kvcache: object
    req_to_token_pool: object
    fingerprint: ModelFingerprint
    rope: RopeSpec | None = None  # the model's RoPE (``rope_of``)
    page_size: int = 1


def weights_id_for(model_path: str, hf_config=None) -> str:
    """``model.model_identity``: the weights' identity with the model's RoPE folded in."""
    from sgl_remote_kv.model import model_identity

    return model_identity(model_path, hf_config)


def rope_of(hf_config) -> RopeSpec | None:
    """The model's RoPE (None, logged, when ``RopeSpec`` cannot describe it: no transform codec then)."""
    try:
        return RopeSpec.from_hf_config(hf_config)
    except ValueError as e:
        logger.info("model RoPE not usable by the transform codec: %s", e)
        return None


def tier_unsupported(ctx) -> str | None:
    """Why the remote tier cannot run on the cache this factory context builds (None: it can). A cache
    SGLang builds disabled (``--disable-radix-cache``, or no KV allocator) has no tree to install into."""
    if getattr(ctx, "disable_radix_cache", False) or getattr(ctx.params, "disable", False):
        return "the radix cache is disabled"
    if getattr(ctx.params, "token_to_kv_pool_allocator", None) is None:
        return "the cache has no KV allocator"
    return None


def build_context(ctx) -> BuildContext:
    """Raises ``UnsupportedPool`` for pools the tier cannot address."""
    hf = ctx.model_config.hf_config
    return _context(ctx.params, ctx.server_args.model_path, hf, ctx.tp_rank, ctx.tp_size)


def linker_build_context(server_args, params) -> BuildContext:
    """``build_context`` from a linker's constructor arguments (``CacheInitParams`` has no model config:
    it is read from ``server_args.model_path``; the TP rank from ``params.tp_cache_group``)."""
    from transformers import AutoConfig

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
    fp = ModelFingerprint(archs[0], layout, weights_id_for(model_path, hf_config), tp_rank, tp_size)
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
    """Route ``sglang.Engine(**kwargs)``'s ``ServerArgs`` through ``make(original, **kwargs)``.

    ``Engine.__init__`` calls ``load_plugins()`` and then builds its record with
    ``self.server_args_class(**kwargs)``, a class attribute SGLang declares for overriding the server args.
    No HookRegistry target reaches that call: ``ServerArgs`` is a msgspec Struct whose constructor ignores
    a replaced ``__init__``/``__new__``; a hook on ``Engine.__init__`` is applied inside the first
    Engine's own ``load_plugins()`` call, too late for it; and a REPLACE of ``Engine.server_args_class``
    is propagated to every module's ``ServerArgs`` name. So the attribute itself is wrapped, once, in a
    process that has imported the Engine (never imports it). False when it had nothing to wrap."""
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
    """Stop an ``sglang.Engine``'s scheduler processes SGLang's graceful way and wait for them to exit.

    ``Engine.shutdown`` SIGKILLs its subprocesses (``kill_process_tree``): no code runs in the scheduler.
    A server's SIGTERM instead drains requests, then sends ``ShutdownReq`` to the schedulers and waits
    15 s for them to exit (``TokenizerManager.sigterm_watchdog``); the scheduler's event loop ends and
    ``run_scheduler_process`` calls ``tree_cache.release_host_resources()`` (where the write-back drains).
    This does the same for an Engine: the subprocess watchdog is stopped first (a scheduler exiting is
    expected now, not a crash: it would SIGQUIT this process), ``ShutdownReq`` goes through the
    tokenizer manager's scheduler socket, and the Engine's own scheduler processes
    (``Engine.get_all_child_pids()`` titled ``sglang::scheduler``) get ``timeout_s`` to exit.

    Returns True when they all exited, False on timeout, None when there was nothing to stop (an
    attached tokenizer worker, an Engine that never started, or one already shut down)."""
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
