"""``python -m sgl_remote_kv.dpu``: run the data plane (started by the host control plane, or standalone).

The host passes where to serve (``--endpoint``/``--store``/``--dest-shm``/``--parent-pid``), what to warm up
(``--warm``: its codec and model) and every tunable as one ``--settings-json`` (``settings.DataPlaneSettings``); a standalone run may give the same
tunables as flags instead. Parsed here, once, into a frozen ``DataPlaneConfig``; nothing below reads the
environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .protocol import decode_warmup
from .server import DataPlaneConfig, DataPlaneServer
from .settings import DataPlaneSettings, add_flags, from_namespace


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_remote_kv.dpu",
        description="sgl-remote-kv data plane: fetch -> inflate -> dequantize -> copy into a shared "
        "destination region, driven over ZeroMQ by the host control plane.",
    )
    p.add_argument(
        "--endpoint", required=True, help="ZeroMQ endpoint to bind (ipc:///path or tcp://host:port)"
    )
    p.add_argument(
        "--store",
        required=True,
        help="store URL (file:///dir, redis://host:port/db, ...); '-' reads it from the first line of stdin, "
        "so a password in it never shows in the process list (the host's way)",
    )
    p.add_argument("--dest-shm", required=True, help="name of the host's shared-memory destination region")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the host) goes away")
    p.add_argument("--settings-json", help="every tunable as DataPlaneSettings JSON (the host's way)")
    p.add_argument("--warm", help="protocol.Warmup JSON: decode one synthetic chunk of this codec and model "
                   "before serving (the host's way; first jobs then do not load kernels)")  # fmt: skip
    add_flags(p)
    return p


def config_from_args(ns: argparse.Namespace) -> DataPlaneConfig:
    try:
        settings = DataPlaneSettings.from_json(ns.settings_json) if ns.settings_json else from_namespace(ns)
    except (ValueError, TypeError, KeyError) as e:
        raise SystemExit(f"bad data-plane settings: {e}") from None
    try:
        warm = decode_warmup(ns.warm) if ns.warm else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    store_url = sys.stdin.readline().strip() if ns.store == "-" else ns.store
    if not store_url:
        raise SystemExit("--store -: no store URL on stdin")
    return DataPlaneConfig(
        endpoint=ns.endpoint,
        store_url=store_url,
        dest_name=ns.dest_shm,
        settings=settings,
        parent_pid=ns.parent_pid,
        warm=warm,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(build_parser().parse_args(argv))
    logging.basicConfig(
        level=cfg.settings.log_level.upper(),
        format="%(asctime)s dpu[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    DataPlaneServer(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
