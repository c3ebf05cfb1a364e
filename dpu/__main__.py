"""``python -m sgl_remote_kv.dpu``: run the data plane (spawned by one host client, or a service).

Spawned (the default): the host passes where to serve (``--endpoint``/``--store``/``--parent-pid``,
``--client-timeout 0``), what to warm up (``--warm``: its codec and model) and every tunable as one
``--settings-json`` (``settings.DataPlaneSettings``). As a long-lived service (``--endpoint
ipc:///run/srkv/dpu.sock`` or ``tcp://...`` with ``--auth-key-file``) the same tunables come as flags;
host clients attach with ``--remote-kv-dpu-endpoint`` and register their regions over the protocol.
Parsed here, once, into a frozen ``DataPlaneConfig``; nothing below reads the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sgl_remote_kv.contract.protocol import decode_warmup
from sgl_remote_kv.contract.settings import SERVICE_LOG_LEVEL, DataPlaneSettings, add_flags, from_namespace
from sgl_remote_kv.store.credentials import url_password_warning

from .config import DataPlaneConfig
from .server import DataPlaneServer
from .store_proxy import StoreProxy, StoreProxyConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_remote_kv.dpu",
        description="sgl-remote-kv data plane: fetch -> inflate -> dequantize -> copy into a shared "
        "destination region, driven over ZeroMQ by the host's DPU client.",
    )
    p.add_argument(
        "--endpoint", required=True, help="ZeroMQ endpoint to bind (ipc:///path or tcp://host:port)"
    )
    p.add_argument(
        "--store",
        required=True,
        help="store URL (file:///dir, redis://host:port/db, ...); '-' reads it from the first line of stdin "
        "(the host's way). Keep a password out of the command line (ps shows it): the URL option "
        "password_file=PATH, the environment variable SRKV_STORE_PASSWORD, or '-'",
    )
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the host) goes away")
    p.add_argument(
        "--auth-key-file",
        default="",
        help="shared secret (the serving side's --remote-kv-auth-key-file): the endpoint speaks "
        "ZeroMQ CURVE with keys derived from it; required for tcp://",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=10.0,
        help="drop a registered client (cancel its jobs, release its regions) that sent nothing "
        "for this many seconds (clients heartbeat every 0.5 s); 0: never",
    )
    p.add_argument(
        "--allow-fingerprint",
        action="append",
        default=[],
        metavar="HEX",
        help="serve only models with this fingerprint digest (64 hex digits; repeatable; default: any model)",
    )
    p.add_argument(
        "--store-endpoint",
        default="",
        help="also serve the store to hosts that cannot reach it (lookups, write-backs; they use "
        "--remote-kv-store dpu+ipc:///path): ZeroMQ endpoint of the store proxy; tcp:// needs "
        "--auth-key-file",
    )
    p.add_argument("--settings-json", help="every tunable as DataPlaneSettings JSON (the host's way)")
    p.add_argument(
        "--region-fd",
        action="append",
        default=[],
        metavar="NAME=FD",
        help="a destination region the host passed down as a descriptor (anonymous memory; the host's way)",
    )
    p.add_argument(
        "--warm",
        help="protocol.Warmup JSON: decode one synthetic chunk of this codec and model "
        "before serving (the host's way; first jobs then do not load kernels)",
    )
    add_flags(p)
    return p


def config_from_args(ns: argparse.Namespace) -> DataPlaneConfig:
    try:
        if ns.settings_json:
            settings = DataPlaneSettings.from_json(ns.settings_json)
        else:  # a service: its start line and its clients' attaches are logged unless told otherwise
            settings = from_namespace(ns, log_level=ns.log_level or SERVICE_LOG_LEVEL)
    except (ValueError, TypeError, KeyError) as e:
        raise SystemExit(f"bad data-plane settings: {e}") from None
    try:
        warm = decode_warmup(ns.warm) if ns.warm else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    store_url = sys.stdin.readline().strip() if ns.store == "-" else ns.store
    if not store_url:
        raise SystemExit("--store -: no store URL on stdin")
    key = b""
    if ns.auth_key_file:
        from sgl_remote_kv.store.security import load_auth_key

        try:
            key = load_auth_key(ns.auth_key_file)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    try:
        allowed = tuple(bytes.fromhex(h) for h in ns.allow_fingerprint)
        return DataPlaneConfig(
            endpoint=ns.endpoint,
            store_url=store_url,
            settings=settings,
            parent_pid=ns.parent_pid,
            warm=warm,
            auth_key=key,
            client_timeout_s=ns.client_timeout,
            allowed_fingerprints=allowed,
            inherited_regions=tuple(_region_fd(r) for r in ns.region_fd),
        )
    except ValueError as e:
        raise SystemExit(f"data plane: {e}") from None


def _region_fd(text: str) -> tuple[str, int]:
    name, sep, fd = text.rpartition("=")
    if not sep or not name or not fd.isdigit():
        raise ValueError(f"--region-fd {text!r}: NAME=FD expected")
    return name, int(fd)


def proxy_config_from_args(ns: argparse.Namespace, cfg: DataPlaneConfig) -> StoreProxyConfig | None:
    if not ns.store_endpoint:
        return None
    try:
        return StoreProxyConfig(ns.store_endpoint, cfg.store_url, cfg.auth_key)
    except ValueError as e:
        raise SystemExit(f"store proxy: {e}") from None


def main(argv: list[str] | None = None) -> int:
    # The transform codec's GEMM (torch, loaded with the first transform chunk or warm-up) must run on one
    # thread per pipeline worker: set before anything loads torch's OpenMP runtime.
    os.environ["OMP_NUM_THREADS"] = "1"
    ns = build_parser().parse_args(argv)
    cfg = config_from_args(ns)
    proxy_cfg = proxy_config_from_args(ns, cfg)
    logging.basicConfig(
        level=cfg.settings.log_level.upper(),
        format="%(asctime)s dpu[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    password_warning = url_password_warning(ns.store) if ns.store != "-" else None
    if password_warning:  # a service started by hand with the password in --store
        logging.getLogger(__name__).warning(password_warning)
    proxy = StoreProxy(proxy_cfg) if proxy_cfg else None
    if proxy is not None:
        proxy.start()
    try:
        DataPlaneServer(cfg).run((f"store proxy on {proxy_cfg.endpoint}",) if proxy is not None else ())
    finally:
        if proxy is not None:
            proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
