"""The data plane's settings, defined once.

``DataPlaneSettings`` is the one type for every tunable of the data plane. The host builds it
(``DpuClientConfig.process``; ``--remote-kv-dpu-args`` flags are parsed into it by ``from_flags``) and
hands it to the child process as one JSON argument (``--settings-json``); a standalone
``python -m sgl_remote_kv.dpu`` run parses the same flags (``add_flags``/``from_namespace``) into the same
type. Benchmark ablations and fault injection are grouped in ``Debug``. The pipeline's own view
(``PipelineConfig``) is derived here and has no defaults of its own. Shared by the host (which builds and
sends it) and the data plane (which runs with it), so it lives in the contract.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

STAGES = ("fetch", "inflate", "dequant", "dma")


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline's view of ``settings.DataPlaneSettings`` (built only by its ``pipeline()``)."""

    fetch_workers: int
    inflate_workers: int
    dequant_workers: int
    dma_workers: int
    layer_group: int  # layers per slab
    queue_depth: int  # items per stage queue
    stage_cpus: tuple[tuple[int, ...], ...]  # per stage (STAGES order): cores to pin to, or ()
    adaptive_fetch: bool  # fetch concurrency 1 or fetch_workers, from the link (``fetch_gate``)
    stream_piece: int  # bytes per piece of a streamed store read; 0: whole-value gets
    # Ablations (benchmarks only): run a chunk's four stages back to back on the fetch worker, and/or
    # allocate a chunk's staging buffers per chunk instead of using the pre-allocated slot regions.
    serial: bool
    prealloc: bool
    # Ablation (benchmarks only): a round's slabs start only once every chunk of the round was fetched.
    round_barrier: bool
    # Fault injection / emulation (tests, benchmarks): the DMA stage sleeps this long per slab.
    dma_delay_s: float


FETCH_CONCURRENCY = ("adaptive", "fixed")
SERVICE_LOG_LEVEL = "INFO"
MAX_CPUS = 4096
AUTO_WORKERS_MAX = 16  # a worker count of 0 resolves to min(cores, this)
HOST_FLAGS = frozenset(
    {
        "--endpoint",
        "--store",
        "--parent-pid",
        "--settings-json",
        "--auth-key-file",
        "--client-timeout",
        "--warm",
        "--region-fd",
    }
)


@dataclass(frozen=True)
class Debug:
    """Benchmark ablations and fault injection; all off in production."""

    serial: bool = False  # run a chunk's four stages back to back on the fetch worker (no pipelining)
    no_prealloc: bool = False  # allocate a chunk's staging buffers per chunk
    round_barrier: bool = False  # a round's slabs start only after the round's last fetch (old ordering)
    dma_delay_s: float = 0.0  # the DMA stage sleeps this long per slab (a slow or stalled data plane)

    def __post_init__(self) -> None:
        if not 0 <= self.dma_delay_s <= 60:
            raise ValueError("dma_delay_s must be in [0, 60]")


@dataclass(frozen=True)
class DataPlaneSettings:
    # worker threads per stage: fetch, inflate, dequant, dma; two fetch workers hide store latency; 0: one
    # per core of the data plane (``cores()``, at most AUTO_WORKERS_MAX): inflate and dequant are the
    # stages that scale with cores (zlib, zstd and the numpy dequant release the GIL)
    workers: tuple[int, int, int, int] = (2, 0, 0, 1)
    layer_group: int = 6  # layers per pipeline work item (slab)
    queue_depth: int = 64  # items per inter-stage queue
    slots: int = 2  # round slots in the staging buffers
    slot_bytes: int = 64 << 20  # DMA-source bytes per slot
    inflate_ratio: float = 1.0  # inflate region size / DMA-source size
    cpus: tuple[int, ...] | None = None  # process affinity; None: the host picks (``auto_cpus``), () none
    pin_stages: bool = False  # pin each stage's threads to one core of ``cpus``, round robin
    store_timeout_s: float = 5.0  # per store call
    # "adaptive": the fetch workers admit 1 or all of them at once, measured from the link (``fetch_gate``);
    # "fixed": always all of them
    fetch_concurrency: str = "adaptive"
    # read store values in pieces of this many KiB and decode each layer group once its bytes are in
    # (``StoreClient.stream_get``; Redis only, else whole gets); 0: always whole-value gets
    stream_piece_kib: int = 256
    # a server's own data plane; a standalone service logs at SERVICE_LOG_LEVEL unless told otherwise
    log_level: str = "WARNING"
    debug: Debug = field(default_factory=Debug)

    def __post_init__(self) -> None:
        if len(self.workers) != len(STAGES) or any(w < 0 for w in self.workers):
            raise ValueError(
                f"workers must be {len(STAGES)} counts >= 0 (0: one per core), got {self.workers}"
            )
        if self.layer_group < 1 or self.queue_depth < 1 or self.slots < 1 or self.slot_bytes < 1:
            raise ValueError("layer_group, queue_depth, slots and slot_bytes must be >= 1")
        if not 0 < self.inflate_ratio <= 64 or not 0 < self.store_timeout_s <= 600:
            raise ValueError("inflate_ratio must be in (0, 64], store_timeout_s in (0, 600]")
        if not 0 <= self.stream_piece_kib <= 1 << 20:
            raise ValueError("stream_piece_kib must be in [0, 1048576]")
        if self.fetch_concurrency not in FETCH_CONCURRENCY:
            raise ValueError(f"fetch_concurrency must be one of {FETCH_CONCURRENCY}")

    def cores(self) -> int:
        """The cores the data plane runs on: ``cpus``, else those this process may use."""
        return len(self.cpus) if self.cpus else len(os.sched_getaffinity(0))

    def stage_workers(self) -> tuple[int, int, int, int]:
        """``workers`` with each 0 resolved to one per core (``cores()``, at most ``AUTO_WORKERS_MAX``)."""
        auto = max(1, min(AUTO_WORKERS_MAX, self.cores()))
        return tuple(w or auto for w in self.workers)  # type: ignore[return-value]

    def describe_workers(self) -> str:
        """e.g. ``workers fetch 2, inflate 4, dequant 4, dma 1 (4 cores)``, for start lines."""
        counts = ", ".join(f"{s} {n}" for s, n in zip(STAGES, self.stage_workers(), strict=True))
        return f"workers {counts} ({self.cores()} cores)"

    def pipeline(self) -> PipelineConfig:
        cpus = self.cpus or ()
        stage_cpus = (
            tuple((cpus[i % len(cpus)],) for i in range(len(STAGES))) if self.pin_stages and cpus else ()
        )
        return PipelineConfig(
            *self.stage_workers(),
            layer_group=self.layer_group,
            queue_depth=self.queue_depth,
            stage_cpus=stage_cpus,
            adaptive_fetch=self.fetch_concurrency == "adaptive",
            stream_piece=self.stream_piece_kib * 1024,
            serial=self.debug.serial,
            prealloc=not self.debug.no_prealloc,
            round_barrier=self.debug.round_barrier,
            dma_delay_s=self.debug.dma_delay_s,
        )

    # ---- the wire to the child: one JSON argument ------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> DataPlaneSettings:
        d = json.loads(text)
        d["workers"] = tuple(d["workers"])
        d["cpus"] = None if d["cpus"] is None else tuple(d["cpus"])
        d["debug"] = Debug(**d["debug"])
        return cls(**d)

    # ---- flags: standalone runs and --remote-kv-dpu-args ----------------------------------------
    @classmethod
    def from_flags(cls, argv: list[str], **overrides) -> DataPlaneSettings:
        """Settings from data-plane flags only (``--remote-kv-dpu-args``); raises ``ValueError`` for an
        unknown flag or one the host owns."""
        if any(a.split("=")[0] in HOST_FLAGS for a in argv):
            raise ValueError(f"the host sets {sorted(HOST_FLAGS)} itself")
        parser = _Parser(prog="data-plane flags", add_help=False)
        add_flags(parser)
        ns = parser.parse_args(argv)
        return from_namespace(ns, **overrides)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> (0, 2, 3): sorted, unique, each in [0, MAX_CPUS). Raises ``ValueError``."""
    out: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad cpu list {text!r}") from None
        if not 0 <= first <= last < MAX_CPUS:
            raise ValueError(f"bad cpu list {text!r} (core ids in [0, {MAX_CPUS}))")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


def cpu_list_arg(text: str) -> tuple[int, ...]:
    """argparse type for core lists (``--remote-kv-dpu-cpus``, the data plane's ``--cpus``)."""
    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a ValueError for the caller, not SystemExit
        raise ValueError(message)


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


def add_flags(p: argparse.ArgumentParser) -> None:
    """The settings as command-line flags (defaults from ``DataPlaneSettings``)."""

    d = DataPlaneSettings()
    for i, stage in enumerate(STAGES):
        p.add_argument(
            f"--{stage}-workers",
            type=int,
            default=d.workers[i],
            help=f"threads of the {stage} stage (0: one per core of the data plane; default {d.workers[i]})",
        )
    p.add_argument("--layer-group", type=int, default=d.layer_group, help="layers per pipeline work item")
    p.add_argument("--queue-depth", type=int, default=d.queue_depth, help="items per inter-stage queue")
    p.add_argument("--slots", type=int, default=d.slots, help="round slots in the staging buffers")
    p.add_argument("--slot-bytes", type=_size, default=d.slot_bytes, help="DMA-source bytes per slot (64M)")
    p.add_argument("--inflate-ratio", type=float, default=d.inflate_ratio, help="inflate / DMA-source size")
    p.add_argument("--cpus", type=cpu_list_arg, default=(), help="pin the process to these cores (e.g. 2-3)")
    p.add_argument("--pin-stages", action="store_true", help="pin each stage to one core of --cpus")
    p.add_argument("--store-timeout", type=float, default=d.store_timeout_s, help="seconds per store call")
    p.add_argument(
        "--fetch-concurrency",
        choices=FETCH_CONCURRENCY,
        default=d.fetch_concurrency,
        help="adaptive: one fetch at a time where concurrent fetches only share the link's "
        "bandwidth, all --fetch-workers where they add throughput (measured); fixed: always all",
    )
    p.add_argument(
        "--stream-piece-kib",
        type=int,
        default=d.stream_piece_kib,
        help="read store values in pieces of this many KiB, decoding layers as they arrive "
        "(Redis stores); 0: whole-value gets",
    )
    p.add_argument(
        "--log-level",
        default=None,
        help=f"default: {SERVICE_LOG_LEVEL} for a service (its start line, attaches, detaches), "
        f"{d.log_level} for a server's own data plane (--remote-kv-dpu-args)",
    )
    p.add_argument("--ablation-serial", action="store_true", help="benchmark ablation: no pipelining")
    p.add_argument("--ablation-no-prealloc", action="store_true", help="benchmark ablation: no prealloc")
    p.add_argument(
        "--ablation-round-barrier",
        action="store_true",
        help="benchmark ablation: decode a round only after its last fetch",
    )
    p.add_argument("--dma-delay-s", type=float, default=0.0, help="fault injection: sleep per DMA'd slab")


def from_namespace(ns: argparse.Namespace, **overrides) -> DataPlaneSettings:
    debug = Debug(
        serial=ns.ablation_serial,
        no_prealloc=ns.ablation_no_prealloc,
        round_barrier=ns.ablation_round_barrier,
        dma_delay_s=ns.dma_delay_s,
    )
    fields = dict(
        workers=tuple(getattr(ns, f"{s}_workers") for s in STAGES),
        layer_group=ns.layer_group,
        queue_depth=ns.queue_depth,
        slots=ns.slots,
        slot_bytes=ns.slot_bytes,
        inflate_ratio=ns.inflate_ratio,
        cpus=tuple(ns.cpus),
        pin_stages=ns.pin_stages,
        store_timeout_s=ns.store_timeout,
        fetch_concurrency=ns.fetch_concurrency,
        stream_piece_kib=ns.stream_piece_kib,
        log_level=ns.log_level or DataPlaneSettings.log_level,
        debug=debug,
    )
    fields.update(overrides)
    return DataPlaneSettings(**fields)
