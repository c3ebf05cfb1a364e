"""The offline ``sglang.Engine`` with the tier: its keyword options and a shutdown that drains.

- Keywords: ``sglang.Engine(model_path=..., remote_kv="dpu", remote_kv_store="redis://...", ...)``. The
  ``remote_kv`` / ``remote_kv_*`` keywords (the flags' destinations) are taken out before SGLang builds its
  ``ServerArgs`` (``seam.wrap_engine_server_args``), parsed with the CLI's rules (``ValueError`` naming the
  flag; nothing is exported then) and, once SGLang accepted the rest, exported like
  ``sgl_remote_kv.configure(...)``: for this Engine and the later ones of the process. An Engine built
  without them keeps whatever ``configure()`` (or an earlier Engine) set.
- Shutdown: ``Engine.shutdown`` SIGKILLs the schedulers, which would drop the write-back's queued chunks
  (the tail of the last request). With the tier on, a BEFORE hook first stops them SGLang's graceful
  way (``ShutdownReq``, as a server's SIGTERM does; ``seam.stop_engine_schedulers``): each scheduler
  drains its write-back (at most ``runtime.WRITEBACK_DRAIN_S``, in ``RemoteKVLinker.close``, which SGLang's
  ``release_host_resources`` calls) and exits; ``ENGINE_STOP_S`` bounds the wait, then SGLang's shutdown runs as
  before.
"""

from __future__ import annotations

import logging
import time

from sgl_remote_kv.config import RemoteKVConfig, configure
from sgl_remote_kv.runtime import WRITEBACK_DRAIN_S
from sgl_remote_kv.sglang_glue import seam

logger = logging.getLogger(__name__)

ENGINE_STOP_S = WRITEBACK_DRAIN_S + 5.0  # the drain plus the scheduler's own exit (SGLang's server: 15 s)


def is_option(name: str) -> bool:
    return name == "remote_kv" or name.startswith("remote_kv_")


def make_server_args(original, *args, **kwargs):
    """``Engine.server_args_class(**kwargs)`` with our keywords taken out (see module docstring)."""
    ours = {k: kwargs.pop(k) for k in [k for k in kwargs if is_option(k)]}
    if not ours:
        return original(*args, **kwargs)
    RemoteKVConfig.from_kwargs(ours)  # ValueError, before SGLang sees anything
    server_args = original(*args, **kwargs)  # SGLang's own TypeError for its unknown keywords
    configure(**ours)  # exported only now that the Engine will start
    return server_args


def before_shutdown(engine, *args, **kwargs):
    """BEFORE ``Engine.shutdown`` (see module docstring); never keeps SGLang's shutdown from running."""
    if not RemoteKVConfig.current().enabled:
        return None
    t0 = time.monotonic()
    try:
        stopped = seam.stop_engine_schedulers(engine, ENGINE_STOP_S)
    except Exception as e:  # boundary: SGLang's shutdown must run whatever happened here
        logger.warning(
            "remote-kv: stopping the schedulers gracefully failed (%r); the write-back may be cut", e
        )
        return None
    if stopped is False:
        logger.warning(
            "remote-kv: schedulers still running %.0f s after ShutdownReq; the write-back may be cut",
            ENGINE_STOP_S,
        )
    elif stopped:
        logger.info("remote-kv: schedulers stopped gracefully in %.2f s", time.monotonic() - t0)
    return None


def install() -> None:
    """From the plugin's ``load()``, in a process that has imported the Engine (the user's; never in
    SGLang's subprocesses, which do not import it)."""
    seam.wrap_engine_server_args(make_server_args)
