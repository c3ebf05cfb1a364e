"""What the admission queue needs from the outside, as small interfaces passed in explicitly.

In the server, ``staged_tree.StagedTree`` implements ``TreeOps`` (SGLang's device prefix through
``sglang_glue.seam.DeviceTree``, plus host staging rows that SGLang's linker loads from) and
``sglang_glue.seam.SchedulerHost`` implements ``HostOps``; the tests implement them on plain Python
objects. The queue's rows are whatever ``TreeOps.alloc`` hands out: host staging rows in the server (never
SGLang's KV slots). Nothing in this package imports SGLang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sgl_remote_kv.types import KVFidelity, PathName


@dataclass(frozen=True)
class AdmissionSettings:
    chunk_size: int
    tail_granule: int = 0  # tokens per tail sub-chunk (0: full chunks only)
    lookup_timeout_s: float = 2.0  # a lookup slower than this is a miss (the request is released)
    # Upper cap of a fetch's life (and of a dedup follower's wait). Fetches are normally cancelled much
    # earlier by the policy: when they lose against recompute, or past a byte-scaled hang guard.
    fetch_timeout_s: float = 120.0
    # A request that chose to fetch waits at most this long for rows (FIFO), then recomputes. (The name
    # predates staging rows; kept.)
    slot_wait_s: float = 5.0
    # Rows this queue may hold at once (reserved for fetches + staged hits not yet admitted), as a
    # fraction of ``TreeOps.capacity()`` (the server: 1, the whole staging area). The name is kept.
    max_pool_fraction: float = 0.5
    idle_wait_s: float = 0.005  # how long an otherwise idle scheduler waits for a fetch to finish

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        g = self.tail_granule
        if g < 0 or (g and (g >= self.chunk_size or self.chunk_size % g)):
            raise ValueError(f"tail_granule must be 0 or divide a larger chunk size, got {g}")
        if not 0.0 < self.max_pool_fraction <= 1.0:
            raise ValueError(f"max_pool_fraction must be in (0, 1], got {self.max_pool_fraction}")
        for name in ("lookup_timeout_s", "fetch_timeout_s", "slot_wait_s", "idle_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class LocalMatch:
    """What ``TreeOps.match`` returns (the one definition: the glue's ``DeviceTree`` builds it)."""

    prefix_len: int  # tokens of the prompt the tree holds on the device
    node: object  # the tree node that ends there


class TreeOps(Protocol):
    """The local prefix and the rows fetched KV is written into (scheduler thread only)."""

    def match(self, req, end: int) -> LocalMatch: ...

    def lock(self, node): ...

    def unlock(self, lock) -> None: ...

    def capacity(self) -> int: ...  # rows in all

    def alloc(self, n: int): ...  # n rows, or None

    def free(self, rows) -> None: ...  # after fencing every KV write

    def write(self, rows, handle) -> None: ...  # a fetch's decoded KV into the rows; raises KVWriteError

    def insert(self, req, prefix_node, start: int, rows): ...  # stage; -> a lock until admitted


class HostOps(Protocol):
    """The serving engine's requests and queue (scheduler thread only)."""

    def rid(self, req) -> str: ...

    def prompt(self, req) -> list[int]: ...

    def salt(self, req) -> str | None: ...  # tenant namespace (cache salt, LoRA / extra key)

    def eligible(self, req) -> bool: ...  # token prompts only (no embeddings, no streaming session)

    def fidelity(self, req) -> KVFidelity: ...  # what KV the request accepts (its custom_params)

    def isolate_exact(self, req) -> None: ...  # an EXACT request's own local radix namespace (idempotent)

    def mark_hit(self, req, start: int, tokens: int) -> None: ...  # what the request's metrics report

    def release(self, req) -> None: ...  # into the engine's waiting queue (scheduled normally)

    def hand_to_abort(self, req) -> None: ...  # where the engine's own abort path finds it

    def waiting(self) -> set[int]: ...  # ids of requests still in the engine's waiting queue


class FetchPathLike(Protocol):
    name: PathName
    backend: object  # FetchBackend: submit(rid, keys, start_token, rows) -> FetchHandle
    codec: object


@dataclass(frozen=True)
class Collaborators:
    """Everything the queue talks to. ``on_installed(rid, chunks)`` tells the write-back which leading
    chunks of a request are known good in the store (None: no write-back)."""

    tree: TreeOps
    host: HostOps
    paths: Mapping[PathName, FetchPathLike]
    policy: object  # policy.estimator.Policy
    metrics: object  # metrics.RemoteKVMetrics
    lookup: Callable[[list[bytes]], object]  # StoreClient.lookup_prefix
    delete: Callable[[list[bytes]], object]  # StoreClient.delete_many
    keys: Callable[[list[int], int, str | None, object], list[bytes]]  # (ids, chunks, salt, codec)
    # (ids, region, key of the chunk before it or None, salt, codec, granule) -> sub-chunk keys of the
    # region's tokens (``runtime.KeySpace.tail_keys``)
    tail_keys: Callable[..., list[bytes]]
    agreement: object  # admission.agreement.Agreement
    bytes_per_token: int  # decoded KV bytes of one token (the policy's size estimates)
    wakeup: threading.Event  # set by workers when something completes
    layerwise: object = None  # fetch.layerwise.LayerwiseInstalls, or None
    on_installed: Callable[[str, int], None] | None = None
    write_codec: object = None  # the codec the write-back writes (on_installed applies to it only)
