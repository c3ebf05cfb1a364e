"""``RemoteKVLinker``: the tier through SGLang's public ``UnifiedCacheLinker`` API (docs/INTEGRATION.md,
"The linker integration").

SGLang loads it with its own flags (the plugin sets them: ``--enable-unified-cache-external-linker
--unified-cache-external-linker-backend dynamic --unified-cache-external-linker-config
'{"linker": "RemoteKVLinker", "linker_module_path": "sgl_remote_kv.sglang_glue.linker"}'``) and constructs
it in each scheduler process with the KV pool and TP group, where it builds the process's runtime
(``assemble.build_runtime``).

Reads: the waiting_for_KV queue (scheduler hooks) parks a request, fetches, verifies and decodes its
chunks into host staging (``kvpool.staged.StagedPages`` via ``admission.staged_tree.StagedTree``) and only
then releases it to SGLang. So:

- ``lookup`` answers from staging alone (no I/O: it runs inside ``match_prefix``);
- ``load`` pins the staged pages for the slots SGLang allocated (a page gone: False, SGLang recomputes);
- ``start_layer_wise_loading`` copies them layer by layer on the load thread through the pool's
  ``KVWriter`` and completes SGLang's ``LayerWiseLoadCounter``, which the forward waits on per layer.

Nothing fallible but that deterministic copy runs after ``lookup``; a failed copy is reported to SGLang
(``LayerWiseLoadCounter.fail``), which aborts the loading requests with a 503 on every rank.

``--remote-kv-layerwise``: the queue stages a request's rows once every chunk is fetched and *verified*
(``Installer.admit_early``), before the fetch path has decoded every layer into them; the rows are then
filled by ``layerwise.LayerwiseInstalls`` (not attached to the pool here), and the load thread waits for
each layer there (its in-process fallback decode included) before copying it. A verified chunk that then
fails to decode (a codec bug) fails the load: a 503, never wrong KV.

Writes stay on the checkpoint write-back (``scheduler_hooks``: token ids, positions and the request's
fidelity are there; ``offload`` gets page hashes and slots only): ``offload`` takes every node and
completes it at once, so SGLang does not offer it again.

Every method catches at its boundary (an exception here would stop the scheduler) and answers "miss".
Threads: the linker methods run on the scheduler thread; the copy on the load thread, which only reads
the pinned rows: pins are taken and released on the scheduler thread (``finish_layer_wise_loading``).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from sgl_remote_kv import metrics as metrics_mod
from sgl_remote_kv import runtime
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.kvpool.staged import StagedPages
from sgl_remote_kv.sglang_glue import seam
from sgl_remote_kv.types import FailureKind

logger = logging.getLogger(__name__)

LINKER_CLASS = "RemoteKVLinker"
LINKER_MODULE = __name__


def linker_config() -> dict:
    """``--unified-cache-external-linker-config`` for this linker."""
    return {"linker": LINKER_CLASS, "linker_module_path": LINKER_MODULE, "linker_extra_config": {}}


def _kv(transfers: list[PoolTransfer]) -> PoolTransfer:
    return next(t for t in transfers if t.name == PoolName.KV)


class FencedCounter(LayerWiseLoadCounter):
    """SGLang's layer counter whose ``wait_until(layer)`` (the forward thread, before attention reads the
    layer) also makes the reading stream wait on the KV writer's event for that layer: on a device pool
    the copy ran on the writer's side stream (``KVWriter.wait_layer``; a no-op on host pools)."""

    def __init__(self, num_layers: int, writer) -> None:
        super().__init__(num_layers)
        self.writer = writer

    def wait_until(self, threshold: int) -> None:
        super().wait_until(threshold)
        self.writer.wait_layer(threshold)

    def finish(self, index: int) -> bool:
        """SGLang's ``finish`` (the scheduler thread, after the forward); for a batch that did not land, the
        reading stream also waits for every write issued so far (``KVWriter.fence``): a write that timed out
        may still land, and the batch's slots are freed for reuse next."""
        landed = super().finish(index)
        if not landed:
            self.writer.fence()
        return landed


class RemoteKVLinker(UnifiedCacheLinker):
    def __init__(self, server_args, params, *, components, extra_config, forward_stream) -> None:
        from sgl_remote_kv.sglang_glue import assemble

        cfg = RemoteKVConfig.current()
        if not cfg.enabled:
            raise ValueError("RemoteKVLinker needs --remote-kv dpu|nvdec|inproc|auto")
        seam.check_version()
        self.pools = {PoolName.KV: None}  # the wrapper reads only which pools a linker serves
        self.staged: StagedPages | None = None  # None: the tier is off on this pool (every lookup misses)
        self._pending: dict[str, tuple] = {}  # rid -> (pin, device slots), until the batch starts
        self._inflight: dict[int, list] = {}  # counter index -> the pins its copy reads, until finished
        self._offloaded = 0  # offloads taken and not yet popped
        try:
            b = seam.linker_build_context(server_args, params)
        except seam.UnsupportedPool as e:
            logger.warning("remote KV tier disabled: %s", e)
            self.layer_done_counter = LayerWiseLoadCounter(1)
            return
        self.pools = {PoolName.KV: b.kvcache}
        rt = assemble.build_runtime(b, cfg)
        self._serve(rt.staged, rt)
        runtime.publish(self.rt)
        logger.info(
            "remote KV tier through the linker API: %d staging rows, page %d", rt.staged.capacity, b.page_size
        )

    def _serve(self, staged: StagedPages, rt: runtime.RemoteKVRuntime) -> None:
        """Serve loads from ``staged`` into ``rt``'s pool: the layer counter and the load thread."""
        self.staged, self.rt = staged, rt
        self.layer_done_counter = FencedCounter(staged.layout.num_layers, rt.kv_writer)
        self._copies: queue.Queue = queue.Queue()
        threading.Thread(target=self._copy_loop, name="srkv-linker-load", daemon=True).start()

    # -- reads --------------------------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        if self.staged is None:
            return []
        try:
            n = self.staged.leading(_kv(transfers).keys)
        except Exception as e:  # boundary: a miss
            self._failed("lookup", e)
            return []
        return list(range(1, n + 1))  # every length is restorable; the wrapper intersects the ranks' sets

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if self.staged is None:
            return False
        try:
            kv = _kv(transfers)
            pin = self.staged.pin(kv.keys)
            if pin is None:  # released since lookup: SGLang frees the slots and recomputes
                return False
            if len(pin.rows) != len(kv.device_indices):
                self.staged.release(pin)
                return False
            self._pending[rid] = (pin, kv.device_indices)
            return True
        except Exception as e:  # boundary: a miss
            self._failed("load", e)
            return False

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        index = self.layer_done_counter.update_producer()
        batch = list(self._pending.values())
        self._inflight[index] = [pin for pin, _ in batch]
        self._copies.put((index, batch))
        self._pending = {}
        return index

    def _copy_loop(self) -> None:
        while True:
            index, batch = self._copies.get()
            try:
                done = functools.partial(self.layer_done_counter.complete, index)
                ready = self.rt.layerwise.wait_until if self.rt.layerwise is not None else None
                self.staged.copy_out(batch, self.rt.kv_writer, done, ready)
            except Exception as e:  # thread boundary: SGLang aborts this batch's loading requests (503)
                metrics_mod.get().failure(FailureKind.WRITE)
                logger.error("remote KV linker load failed: %r", e)
                self.layer_done_counter.fail(index, e)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """After the batch's forward (scheduler thread): wait for its copy, then release its pins here,
        not on the load thread, so staging frees rows at the same point of the schedule on every TP rank
        (the queue's reservations, which are not agreed row by row, then see the same free rows)."""
        landed = self.layer_done_counter.finish(counter_index)
        for pin in self._inflight.pop(counter_index, ()):
            self.staged.release(pin)
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        got = self._pending.pop(rid, None)
        if got is not None:
            self.staged.release(got[0])
        return got is not None

    # -- writes: the checkpoint write-back stores; offload only completes -----------------------------
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        self._offloaded += 1
        return True

    def num_completed_offloads(self) -> int:
        return self._offloaded

    def pop_completed_offload(self) -> bool:
        self._offloaded -= 1
        return True

    # -- lifecycle --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """``/flush_cache``: staged pages are forgotten (pinned ones stay until released), then the tier's
        flush scope (``RemoteKVRuntime.on_flush``)."""
        self._offloaded = 0
        self.layer_done_counter.reset()
        if self.staged is None:
            return
        try:
            self.staged.forget()
            self.rt.on_flush()
        except Exception as e:  # boundary: SGLang's flush must go on
            self._failed("reset", e)

    def close(self) -> None:
        """SGLang's graceful scheduler exit: the write-back drains first."""
        if self.staged is None:
            return
        try:
            self.rt.on_shutdown()
        except Exception as e:  # boundary: SGLang's own release must still run
            metrics_mod.get().failure(FailureKind.WRITEBACK)
            logger.warning("remote-kv write-back drain at shutdown failed: %r", e)

    def _failed(self, what: str, e: Exception) -> None:
        metrics_mod.get().failure(FailureKind.INTERNAL)
        logger.warning("remote KV linker %s failed: %r", what, e)
