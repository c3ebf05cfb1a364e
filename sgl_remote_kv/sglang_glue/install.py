"""Putting fetched KV into SGLang's radix tree as ordinary device nodes (scheduler thread only).

``TreeInstaller`` wraps the few tree/pool operations the waiting_for_KV queue needs: match a prompt
prefix locally, lock/unlock tree nodes, reserve and free KV slots (evicting unlocked cache if needed),
write staged KV into slots (through the pool's ``KVWriter``; raises ``KVWriteError``), and insert
``prefix slots + fetched slots`` under the prompt's key, after fencing every write (a reader of the new
nodes is ordered behind the writes that filled them).

Insert semantics (SGLang's ``UnifiedRadixCache.insert``): tokens ``[0, prev_prefix_len)`` are the
caller's already-tree-owned prefix; slots of tokens past it that the tree already holds (someone
computed them meanwhile) are freed by the insert itself as duplicates; the rest become tree-owned.
After an insert we lock the new node until the request is admitted (its own match then locks it).
"""

from __future__ import annotations

import logging
from array import array

import torch

logger = logging.getLogger(__name__)


class TreeInstaller:
    def __init__(self, tree, kv_writer) -> None:
        self.tree = tree
        self.allocator = tree.token_to_kv_pool_allocator
        self.kvcache = self.allocator.get_kvcache()
        self.kv_writer = kv_writer

    def _key(self, req, end: int):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", req.origin_input_ids[:end]), req.extra_key, cache_salt=req.cache_salt)

    def match(self, req, end: int):
        """Local (device) match of the first ``end`` prompt tokens; no I/O."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.tree.match_prefix(MatchPrefixParams(key=self._key(req, end)))

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock) -> None:
        if lock is not None:
            self.tree.unlock(lock)

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
        ``prefix_node``) followed by ``slots``. Returns a lock on the new last node."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        self.kv_writer.fence()
        prefix = self.tree.path_device_indices(prefix_node)[:start].to(torch.int64)
        if len(prefix) != start:
            raise RuntimeError(f"prefix node holds {len(prefix)} tokens, expected {start}")
        value = torch.cat([prefix, slots.to(device=prefix.device, dtype=torch.int64)])
        end = start + len(slots)
        res = self.tree.insert(InsertParams(key=self._key(req, end), value=value, prev_prefix_len=start))
        return self.tree.lock(res.last_device_node)
