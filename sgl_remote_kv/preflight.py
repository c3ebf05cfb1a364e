"""Start-up checks of the remote KV flags: one clear error before the server loads anything.

``check_store_url`` validates a ``--remote-kv-store`` URL's *syntax* (known scheme, host and port,
absolute path, numeric db) without opening it: reachability is not a start-up error, since the
promise is that a store outage costs time, never the server. An unreachable store is reported once
at start by ``probe_store_async`` (a background probe from the launcher process) and is a miss
until it answers. A store that refuses the credentials is reachable: the probe does not call it
unreachable and does not report it either (DEBUG only), since each serving process's store client asks
the store at start and logs that refusal once, at ERROR (``store.auth_gate``): one line, not two.

Errors are ``ValueError`` with one line naming the URL and the problem; ``config.py`` turns them
into ``argparse.ArgumentTypeError`` so argparse prints ``argument --remote-kv-store: ...`` and exits.

``check_chunk_fits`` runs later, in the scheduler process (``assemble.build_runtime``), the first place
that knows the KV pool's size and the model's KV layout: a ``--remote-kv-chunk-size`` larger than the
pool or than the DPU data plane's staging slot could never be used, so it raises ``StartupError``
(one line naming the flag, the limit and the largest chunk size that fits). The scheduler process
then fails its start-up, and SGLang takes the whole server down (exit != 0) instead of serving with a
tier that can never hit.
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import urlsplit

from sgl_remote_kv.store import base
from sgl_remote_kv.store.base import redact_url

logger = logging.getLogger(__name__)


def _unwrap(url: str) -> str:
    """Strip ``auth+``/``faulty+`` prefixes (checking the auth one is complete)."""
    while True:
        low = url.lower()
        if low.startswith("auth+"):
            from sgl_remote_kv.store.security import split_auth_url

            url, _ = split_auth_url(url)
        elif low.startswith("faulty+"):
            url = url[len("faulty+") :]
        else:
            return url


def check_store_url(url: str) -> str:
    """Return ``url`` unchanged if it is syntactically usable; ``ValueError`` otherwise."""
    text = url.strip()
    if not text:
        return url  # empty -> the embedded default store
    inner = _unwrap(text)
    if "://" not in inner:
        if inner.startswith(("-", "?")):
            raise ValueError(f"store URL {redact_url(url)!r}: not a URL or a path")
        return url  # a plain filesystem path
    scheme = inner.split("://", 1)[0].lower()
    if scheme not in base._REGISTRY or scheme in ("auth", "faulty"):
        known = ", ".join(
            f"{s}://"
            for s in ("file", "redis", "rediss", "redis+cluster", "rediss+cluster", "dpu+ipc", "dpu+tcp")
        )
        raise ValueError(
            f"store URL {redact_url(url)!r}: unknown scheme {scheme!r} (known: {known}, or a plain path)"
        )
    try:
        parts = urlsplit(inner)
    except ValueError as e:
        raise ValueError(f"store URL {redact_url(url)!r}: {e}") from None
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"store URL {redact_url(url)!r}: file URLs need an absolute path (file:///dir)")
        if not parts.path.startswith("/"):
            raise ValueError(f"store URL {redact_url(url)!r}: file URLs need an absolute path (file:///dir)")
        return url
    if scheme == "dpu+ipc":  # a data-plane service's store proxy on this host (a socket file)
        if parts.netloc or not parts.path.startswith("/"):
            raise ValueError(
                f"store URL {redact_url(url)!r}: dpu+ipc URLs need an absolute path (dpu+ipc:///path)"
            )
        return url
    if not parts.netloc:
        raise ValueError(f"store URL {redact_url(url)!r}: missing host")
    base.parse_host_ports(parts.netloc, url)  # ValueError on a missing host or a bad port
    db = parts.path.strip("/")
    if scheme in ("redis", "rediss") and db and not db.isdigit():
        raise ValueError(f"store URL {redact_url(url)!r}: database must be a number, got {db!r}")
    return url


class StartupError(ValueError):
    """An impossible remote-KV configuration, found once the model and the KV pool are known."""


def check_chunk_fits(chunk_size: int, pool_tokens: int, layout, data_plane: bool) -> None:
    """Raise ``StartupError`` unless one chunk fits the KV pool (``pool_tokens``) and, with
    ``data_plane``, one staging slot of the DPU data plane (``layout``: the model's ``KVLayout``)."""
    flag = f"--remote-kv-chunk-size {chunk_size}"
    if chunk_size > pool_tokens:
        raise StartupError(
            f"{flag} is larger than the KV pool ({pool_tokens} tokens; --max-total-tokens / "
            f"--mem-fraction-static): no remote chunk could ever be installed. Use at most "
            f"{_fit16(pool_tokens)} tokens."
        )
    if not data_plane:
        return
    from sgl_remote_kv.contract.settings import DataPlaneSettings
    from sgl_remote_kv.contract.sizing import DEST_SLOT_BYTES, chunk_bytes, plan_rounds

    process = DataPlaneSettings()  # the defaults the DPU client starts its data plane with
    slot = min(DEST_SLOT_BYTES, process.slot_bytes)
    try:
        plan_rounds([chunk_size], layout, slot, process.inflate_ratio)
    except ValueError:
        fit = max((t for t in range(16, chunk_size, 16) if chunk_bytes(layout, t) <= slot), default=0)
        raise StartupError(
            f"{flag}: one chunk is {chunk_bytes(layout, chunk_size) / 2**20:.0f} MiB of KV "
            f"({layout.num_layers} layers x {layout.num_kv_heads} heads x {layout.head_dim} {layout.dtype}), "
            f"larger than the DPU data plane's {slot >> 20} MiB staging slot. Use at most {fit} tokens."
        ) from None


def _fit16(tokens: int) -> int:
    return max(16, tokens // 16 * 16)


def probe_store_async(url: str, timeout_s: float = 3.0) -> threading.Thread:
    """Check in the background that the store answers; log ONE clear warning if it does not.

    Never raises and never delays start-up: an unreachable store is a miss until it answers.
    """
    t = threading.Thread(target=_probe, args=(url, timeout_s), name="srkv-store-probe", daemon=True)
    t.start()
    return t


def _probe(url: str, timeout_s: float) -> None:
    done = threading.Event()
    error: list[BaseException] = []

    def run() -> None:
        try:
            store = base.open_store(url)
            try:
                store.count_prefix([bytes(base.KEY_BYTES)])
            finally:
                store.close()
        except Exception as e:  # reported below; a probe must never take the server down
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="srkv-store-probe-call", daemon=True).start()
    if not done.wait(timeout_s):
        error.append(TimeoutError(f"no answer in {timeout_s:.0f} s"))
    if error and isinstance(error[0], base.StoreAuthError):
        # reachable; the serving process's store client reports the refusal once, at ERROR (auth_gate)
        logger.debug(
            "remote KV store %s reachable; it refused our credentials (%s)", redact_url(url), error[0]
        )
    elif error:
        logger.warning(
            "remote KV store %s is unreachable at start (%s: %s); serving continues, every lookup is a "
            "miss until the store answers",
            redact_url(url),
            type(error[0]).__name__,
            error[0],
        )
    else:
        logger.info("remote KV store %s reachable", redact_url(url))
