"""``TreeOps`` for the linker integration: fetched chunks are staged, not inserted into the tree.

The queue's steps (``ports.TreeOps``) run on host staging rows; SGLang's KV slots never reach the queue:

- ``match``: the device prefix (the tree, no I/O) extended by the pages already staged after it, so a
  dedup follower or a repeated prompt does not fetch staged pages again.
- ``lock``: the device prefix node *and* a pin on those staged pages (``StagedPages.pin``).
- ``alloc``/``free``/``capacity``/``write``: staging rows (``StagedPages``), written through its writer.
- ``insert``: ``stage`` the written rows under SGLang's page hashes of ``[start, end)``; the lock it
  returns holds the device prefix and every staged page up to ``end`` until the request was admitted.
  SGLang's ``lookup`` then reports them and its ``load`` copies them into the slots it allocated.

Page hashes (``page_hashes(req, end)``) are SGLang's own chained per-page hashes of the first ``end``
tokens (full pages only), so they match what the linker wrapper computes for the uncached tail wherever
the device prefix ends. Scheduler thread only (``StagedPages`` is thread-safe for the load thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sgl_remote_kv.admission.ports import TreeOps
from sgl_remote_kv.kvpool.staged import Pin, StagedPages


@dataclass(frozen=True)
class StagedMatch:
    prefix_len: int  # device prefix + staged pages after it
    node: StagedNode


@dataclass(frozen=True)
class StagedNode:
    device: object  # the device tree's node ending the device prefix
    pages: tuple[str, ...]  # staged page hashes after it


@dataclass(frozen=True)
class StagedLock:
    device: object
    pins: tuple[Pin | None, ...]


class StagedTree:
    def __init__(
        self, device: TreeOps, staged: StagedPages, page_hashes: Callable[[object, int], list[str]]
    ) -> None:
        self.device, self.staged, self.page_hashes = device, staged, page_hashes
        self.page = staged.page

    def match(self, req, end: int) -> StagedMatch:
        m = self.device.match(req, end)
        first = m.prefix_len // self.page
        hashes = self.page_hashes(req, end)[first:]
        n = self.staged.leading(hashes)
        return StagedMatch(m.prefix_len + n * self.page, StagedNode(m.node, tuple(hashes[:n])))

    def lock(self, node: StagedNode) -> StagedLock:
        # a page released since ``match`` (its last load finished) shortens the hit SGLang sees: a miss
        # for the rest, never a wrong page
        return StagedLock(self.device.lock(node.device), (self._pin(node),))

    def _pin(self, node: StagedNode) -> Pin | None:
        return self.staged.pin(list(node.pages)) if node.pages else None

    def unlock(self, lock: StagedLock | None) -> None:
        if lock is not None:
            for pin in lock.pins:
                self.staged.release(pin)
            self.device.unlock(lock.device)

    def capacity(self) -> int:
        return self.staged.capacity

    def alloc(self, n: int):
        return self.staged.alloc(n)

    def free(self, rows) -> None:
        self.staged.free(rows)

    def write(self, rows, handle) -> None:
        handle.write_staged(self.staged.writer, rows, len(rows))

    def insert(self, req, prefix_node: StagedNode, start: int, rows) -> StagedLock:
        """Stage ``rows`` as the pages of ``[start, start + len(rows))`` (``start`` on a page boundary)."""
        if start % self.page:
            raise ValueError(f"staged insert at {start}, not a page boundary ({self.page})")
        hashes = self.page_hashes(req, start + len(rows))[start // self.page :]
        entry = self.staged.stage(hashes, rows)
        return StagedLock(self.device.lock(prefix_node.device), (entry, self._pin(prefix_node)))
