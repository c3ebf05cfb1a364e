"""SGLang general plugin (entry point group ``sglang.srt.plugins``).

``load()`` runs early in every SGLang process (launcher and each scheduler subprocess). It registers
HookRegistry hooks; SGLang applies them right after all plugins ran.

- Launcher: an AFTER hook on ``ServerArgs.add_cli_args`` adds our flags; an AFTER hook on
  ``ServerArgs.from_cli_args`` parses them into ``RemoteKVConfig`` once and exports it as JSON so every
  child process sees the same config.
- Offline engine: ``sgl_remote_kv.configure(remote_kv="dpu", ...)`` before ``sglang.Engine(...)``
  parses the options with the CLI's rules and exports the config the same way (``configure``).
- Both: a BEFORE hook on ``ServerArgs.resolve_once`` sets SGLang's linker flags to
  ``linker.RemoteKVLinker`` when the tier is on.
- Scheduler processes: ``RemoteKVConfig.current()`` reads it back.
- Offline engine, in the process that builds it: ``sglang.Engine(remote_kv="dpu", ...)`` keywords, and
  ``Engine.shutdown`` stops the schedulers gracefully first so the write-back drains (``engine_api``).
- Tokenizer process: an AFTER hook on ``SamplingParams.verify`` refuses unknown per-request
  ``custom_params["remote_kv"]`` values (``types.KVFidelity``) with SGLang's HTTP 400.
"""

from __future__ import annotations

import logging

from sgl_remote_kv import env
from sgl_remote_kv.config import RemoteKVConfig

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_ENGINE = "sglang.srt.entrypoints.engine.Engine"
_VERIFY = "sglang.srt.sampling.sampling_params.SamplingParams.verify"


def _after_add_cli_args(result, parser, *args, **kwargs):
    RemoteKVConfig.add_cli_args(parser)
    return result


def _after_from_cli_args(server_args, *args, **kwargs):
    ns = args[-1] if args else kwargs.get("args")
    if ns is None or not hasattr(ns, "remote_kv"):
        return server_args  # built from a namespace without our flags (e.g. Engine(**kwargs))
    RemoteKVConfig.from_namespace(ns).publish()
    return server_args


def _before_resolve(server_args, *args, **kwargs):
    """``ServerArgs.resolve_once`` (launch_server and ``sglang.Engine`` alike), when the tier is on: set
    SGLang's linker flags to our linker (a user who set them to our linker themselves gets the same). The
    tier stays off, with one warning, where the linker cannot run: another linker, or an option SGLang
    refuses next to it (``_LINKER_CONFLICTS``: a disabled or other radix cache, HiCache, LMCache...)."""
    cfg = RemoteKVConfig.current()
    if not cfg.enabled:
        return None
    from sgl_remote_kv.sglang_glue.linker import LINKER_MODULE, linker_config

    if getattr(server_args, "enable_unified_cache_external_linker", False):
        theirs = getattr(server_args, "unified_cache_external_linker_config", None) or {}
        if theirs.get("linker_module_path") != LINKER_MODULE:
            logger.warning("--remote-kv is off: another unified-cache linker is configured (%s)", theirs)
        return None
    why = _linker_conflict(server_args)
    if why is not None:  # a configuration SGLang accepts without the linker: it runs, without the tier
        logger.warning("--remote-kv is off: %s (SGLang's unified-cache linker cannot run with it)", why)
        return None
    server_args.enable_unified_cache_external_linker = True
    server_args.unified_cache_external_linker_backend = "dynamic"
    server_args.unified_cache_external_linker_config = linker_config()
    return None


# server options SGLang refuses next to its linker flags (0.5.23, ``arg_groups/*_hook.py``): (field, flag)
_LINKER_CONFLICTS = (
    ("disable_radix_cache", "--disable-radix-cache"),
    ("radix_cache_backend", "--radix-cache-backend"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache"),
    ("hicache_storage_backend", "--hicache-storage-backend"),
    ("enable_lmcache", "--enable-lmcache"),
    ("enable_unified_memory", "--enable-unified-memory"),
    ("enable_kv_cache_sharding", "--enable-kv-cache-sharding"),
)


def _linker_conflict(server_args) -> str | None:
    """The first option set that SGLang refuses together with the linker, or None."""
    for field, flag in _LINKER_CONFLICTS:
        value = getattr(server_args, field, None)
        if value:
            return flag if value is True else f"{flag} {value}"
    return None


def _after_verify(result, sampling_params, *args, **kwargs):
    """``SamplingParams.verify`` (tokenizer process): a request's ``custom_params["remote_kv"]`` must be a
    ``KVFidelity`` value (``ValueError``: SGLang answers HTTP 400 with the message)."""
    from sgl_remote_kv.sglang_glue import seam

    seam.check_sampling_params(sampling_params)
    return result


def _register_remote_kv() -> None:
    """The linker flags, the request check and the scheduler hooks (waiting_for_KV queue, write-back)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_remote_kv.sglang_glue import scheduler_hooks

    HookRegistry.register(f"{_SERVER_ARGS}.resolve_once", _before_resolve, HookType.BEFORE)
    HookRegistry.register(_VERIFY, _after_verify, HookType.AFTER)
    scheduler_hooks.register()


def _register_engine() -> None:
    """The offline Engine (``engine_api``): ``sglang.Engine(remote_kv=...)`` keywords, and a BEFORE hook on
    ``Engine.shutdown`` that lets the schedulers drain the write-back. Only in a process that has imported
    the Engine (``Engine.__init__`` calls ``load_plugins()`` first thing); SGLang's subprocesses do not."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_remote_kv.sglang_glue import engine_api, seam

    if seam.engine_module_loaded():
        engine_api.install()
        HookRegistry.register(f"{_ENGINE}.shutdown", engine_api.before_shutdown, HookType.BEFORE)


def load() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", _after_from_cli_args, HookType.AFTER)
    _register_remote_kv()
    _register_engine()
    if env.cpu_platform_enabled():
        from sgl_remote_kv.sglang_glue import cpu_attention

        cpu_attention.register()  # --attention-backend cpu_prefix (CPU dev platform's default)
    cfg = RemoteKVConfig.current()
    if cfg.enabled:
        logger.info("sgl-remote-kv active in this process: mode=%s", cfg.mode)
