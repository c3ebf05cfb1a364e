"""``python -m sgl_remote_kv.dpu``: run the data plane (started by the host control plane, or standalone).

Every flag is parsed here, once, into a frozen ``DataPlaneConfig``; nothing below reads the environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sgl_remote_kv.config import cpu_list_arg

from .server import DataPlaneConfig, DataPlaneServer
from .tasks import STAGES, PipelineConfig


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_remote_kv.dpu",
        description="sgl-remote-kv data plane: fetch -> inflate -> dequantize -> copy into a shared "
        "destination region, driven over ZeroMQ by the host control plane.",
    )
    p.add_argument(
        "--endpoint", required=True, help="ZeroMQ endpoint to bind (ipc:///path or tcp://host:port)"
    )
    p.add_argument("--store", required=True, help="store URL (file:///dir, redis://host:port/db, ...)")
    p.add_argument("--dest-shm", required=True, help="name of the host's shared-memory destination region")
    for stage in STAGES:
        default = 2 if stage == "fetch" else 1  # fetch threads mostly wait on the store
        p.add_argument(
            f"--{stage}-workers", type=int, default=default, help=f"worker threads of the {stage} stage"
        )
    p.add_argument("--layer-group", type=int, default=6, help="layers per pipeline work item (slab)")
    p.add_argument("--queue-depth", type=int, default=64, help="items per inter-stage queue")
    p.add_argument("--slots", type=int, default=2, help="round slots in the staging buffers")
    p.add_argument("--slot-bytes", type=_size, default=64 << 20, help="DMA-source bytes per slot (e.g. 64M)")
    p.add_argument("--inflate-ratio", type=float, default=1.0, help="inflate region size / DMA-source size")
    p.add_argument("--cpus", type=cpu_list_arg, default=(), help="pin the process to these cores (e.g. 2-3)")
    p.add_argument(
        "--pin-stages",
        action="store_true",
        help="pin each stage's threads to one core of --cpus, round robin",
    )
    p.add_argument("--ablation-serial", action="store_true", help="benchmark ablation: no pipelining")
    p.add_argument(
        "--ablation-no-prealloc", action="store_true", help="benchmark ablation: staging buffers per chunk"
    )
    p.add_argument(
        "--dma-delay-s", type=float, default=0.0, help="fault injection: sleep this long per DMA'd slab"
    )
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the host) goes away")
    p.add_argument("--store-timeout", type=float, default=5.0, help="seconds per store call")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(ns: argparse.Namespace) -> DataPlaneConfig:
    counts = [getattr(ns, f"{s}_workers") for s in STAGES]
    if any(c < 1 for c in counts) or ns.layer_group < 1 or ns.queue_depth < 1 or ns.slots < 1:
        raise SystemExit("worker counts, --layer-group, --queue-depth and --slots must be >= 1")
    if not 0 <= ns.dma_delay_s <= 60:
        raise SystemExit("--dma-delay-s must be in [0, 60]")
    stage_cpus: tuple[tuple[int, ...], ...] = ()
    if ns.pin_stages and ns.cpus:
        stage_cpus = tuple((ns.cpus[i % len(ns.cpus)],) for i in range(len(STAGES)))
    pipe = PipelineConfig(
        *counts,
        layer_group=ns.layer_group,
        queue_depth=ns.queue_depth,
        stage_cpus=stage_cpus,
        serial=ns.ablation_serial,
        prealloc=not ns.ablation_no_prealloc,
        dma_delay_s=ns.dma_delay_s,
    )
    return DataPlaneConfig(
        endpoint=ns.endpoint,
        store_url=ns.store,
        dest_name=ns.dest_shm,
        pipeline=pipe,
        slots=ns.slots,
        slot_bytes=ns.slot_bytes,
        inflate_ratio=ns.inflate_ratio,
        cpus=ns.cpus,
        store_timeout_s=ns.store_timeout,
        parent_pid=ns.parent_pid,
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s dpu[%(process)d] %(levelname)s %(name)s: %(message)s"
    )
    DataPlaneServer(config_from_args(ns)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
