"""Issue 39 spike: the remote KV tier as an out-of-tree ``UnifiedCacheLinker`` (SGLang 0.5.23).

Not product code (nothing in ``sgl_remote_kv`` imports it). Loaded by SGLang's stock flags::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "RemoteKVSpikeLinker",
        "linker_module_path": "linker_spike", "linker_extra_config": {"store": "file:///tmp/s"}}'

with this folder on ``PYTHONPATH`` and ``--page-size`` equal to the chunk size (one SGLang page = one
stored chunk; see docs/INTEGRATION.md, "Linker API spike").

- Fetch path: the in-process one (``InProcessFetchBackend``: store ``get_many`` + codec decode into numpy
  staging on a worker thread). The DPU path is *direct* (it writes into pool slots reserved at submit);
  the linker only gets slots at ``load``, after ``lookup``, so it would need a staging destination first.
- Parking: the linker API has no "not ready yet" answer, so a request is parked *before* SGLang sees it
  (the scheduler's ``_add_request_to_queue``, patched here; the product does it with HookRegistry hooks)
  until its pages are fetched and staged; ``lookup`` then answers from the staging dict alone.
- ``load``: queued; ``start_layer_wise_loading`` copies staged layers into the slots on a thread and
  completes SGLang's ``LayerWiseLoadCounter`` layer by layer (the forward waits per layer).
- ``offload``: copies the pages out of the pool (scheduler thread) and encodes + stores them on a thread.
- Store keys: ``sha256(our namespace || SGLang's page hash)``. ``offload`` gets page hashes and slots but no
  token ids or positions, so keys cannot be our token-chained chunk keys.

TP=1, MHA pool, FULL component only; no abort handling for parked requests; exact requests not handled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from array import array
from pathlib import Path

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.model import model_identity
from sgl_remote_kv.sglang_glue import seam
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import ClientConfig, open_client
from sgl_remote_kv.types import ModelFingerprint

logger = logging.getLogger(__name__)
_LINKER: RemoteKVSpikeLinker | None = None  # the process's linker, for the scheduler patches


class RemoteKVSpikeLinker(UnifiedCacheLinker):
    def __init__(self, server_args, params, *, components, extra_config, forward_stream):
        global _LINKER
        self.forward_stream = forward_stream
        self.page = params.page_size
        self.kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = {PoolName.KV: self.kvcache}
        layout = seam.pool_layout(self.kvcache)
        hf = json.loads((Path(server_args.model_path) / "config.json").read_text())
        self.fp = ModelFingerprint(hf["architectures"][0], layout, model_identity(server_args.model_path))
        self.codec = get_codec(extra_config.get("codec", "lossless"))
        self.client = open_client(extra_config["store"], ClientConfig())
        # tenant: SGLang seeds its page hashes with extra_key/cache_salt already
        self.ns = keys_mod.namespace(self.fp, self.codec.name, self.codec.params_bytes())
        self.fetch = InProcessFetchBackend(self.client, self.codec, self.fp, self.page, workers=1)
        self.layer_done_counter = LayerWiseLoadCounter(layout.num_layers)
        self.staged: dict[str, tuple[object, int]] = {}  # page hash -> (fetch handle, chunk index)
        self.known: set[str] = set()  # page hashes this process fetched or stored (offload dedup)
        self.parked: list[tuple[object, object, list[str]]] = []  # (req, handle, fetched hashes)
        self.pending_loads: dict[str, tuple[list[tuple[object, int]], torch.Tensor]] = {}
        self.offload_results: queue.Queue[bool] = queue.Queue()
        self.offload_q: queue.Queue = queue.Queue()
        self.load_q: queue.Queue = queue.Queue()
        self.stats = {
            "parked": 0,
            "staged_pages": 0,
            "lookup_hit_pages": 0,
            "loaded_pages": 0,
            "offloaded": 0,
            "offload_skipped": 0,
        }
        for target in (self._load_loop, self._offload_loop):
            threading.Thread(target=target, daemon=True).start()
        _LINKER = self
        _patch_scheduler()
        logger.info("spike linker: page %d, codec %s, layout %s", self.page, self.codec.name, layout)

    def key(self, page_hash: str) -> bytes:
        return hashlib.sha256(self.ns + bytes.fromhex(page_hash)).digest()

    # -- parking (scheduler thread, before SGLang's match_prefix) -----------------------------------
    def page_hashes(self, req) -> list[str]:
        ids = req.origin_input_ids
        n = len(ids) // self.page * self.page
        if n == 0:
            return []
        key = RadixKey(array("q", ids[:n]), req.extra_key, cache_salt=req.cache_salt)
        return get_storage_hash_str(key, None, page_size=self.page)

    def park(self, req) -> bool:
        hashes = self.page_hashes(req)
        first = next((i for i, h in enumerate(hashes) if h not in self.staged), len(hashes))
        if first == len(hashes):
            return False
        rest = hashes[first:]
        handle = self.fetch.submit(req.rid, [self.key(h) for h in rest], first * self.page)
        self.parked.append((req, handle, rest))
        self.stats["parked"] += 1
        return True

    def poll(self) -> list:
        """Parked requests whose fetch finished; their fetched pages join the staging dict."""
        ready, still = [], []
        for req, handle, rest in self.parked:
            if not handle.done():
                still.append((req, handle, rest))
                continue
            for i in range(handle.ok_chunks):
                self.staged[rest[i]] = (handle, i)
                self.known.add(rest[i])
            self.stats["staged_pages"] += handle.ok_chunks
            ready.append(req)
        self.parked = still
        return ready

    # -- UnifiedCacheLinker -------------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = next(t for t in transfers if t.name == PoolName.KV)
        n = 0
        while n < len(kv.keys) and kv.keys[n] in self.staged:
            n += 1
        self.stats["lookup_hit_pages"] += n
        return list(range(1, n + 1))  # every restorable length: the wrapper intersects them across ranks

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = next(t for t in transfers if t.name == PoolName.KV)
        sources = [self.staged.get(h) for h in kv.keys]
        if any(s is None for s in sources):  # staging dropped since lookup: a miss, SGLang recomputes
            return False
        self.pending_loads[rid] = (sources, kv.device_indices)
        return True

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        index = self.layer_done_counter.update_producer()
        self.load_q.put((index, list(self.pending_loads.values())))
        self.pending_loads = {}
        return index

    def _load_loop(self) -> None:
        while True:
            index, batch = self.load_q.get()
            try:
                for layer in range(self.fp.layout.num_layers):
                    for sources, slots in batch:
                        k = np.concatenate([h.k[layer, h.span(i)] for h, i in sources])
                        v = np.concatenate([h.v[layer, h.span(i)] for h, i in sources])
                        self.kvcache.k_buffer[layer].index_copy_(0, slots, torch.from_numpy(k))
                        self.kvcache.v_buffer[layer].index_copy_(0, slots, torch.from_numpy(v))
                    self.layer_done_counter.complete(index, layer)
                self.stats["loaded_pages"] += sum(len(s) for s, _ in batch)
            except Exception as e:  # thread boundary: SGLang aborts the batch's loading requests
                logger.exception("spike load failed")
                self.layer_done_counter.fail(index, e)
            finally:
                self.load_q.task_done()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        # SGLang 0.5.23 offloads a loaded tail again once it is inserted (nothing calls
        # ``mark_external_cache_stored_path``): pages we fetched or stored are skipped here.
        kv = next(t for t in transfers if t.name == PoolName.KV)
        p = self.page
        todo = [i for i, h in enumerate(kv.keys) if h not in self.known]
        self.stats["offload_skipped"] += len(kv.keys) - len(todo)
        if not todo:
            self.offload_results.put(True)
            return True
        slots = torch.cat([kv.device_indices[i * p : (i + 1) * p] for i in todo])
        n_layers = self.fp.layout.num_layers
        k = np.stack([self.kvcache.k_buffer[i][slots].numpy() for i in range(n_layers)])
        v = np.stack([self.kvcache.v_buffer[i][slots].numpy() for i in range(n_layers)])
        self.offload_q.put(([kv.keys[i] for i in todo], k, v))
        return True

    def _offload_loop(self) -> None:
        while True:
            keys, k, v = self.offload_q.get()
            try:
                p = self.page
                items = [
                    (
                        self.key(h),
                        self.codec.encode(k[:, i * p : (i + 1) * p], v[:, i * p : (i + 1) * p], self.fp),
                    )
                    for i, h in enumerate(keys)
                ]
                ok = self.client.put_many(items) == len(items)
                if ok:
                    self.known.update(keys)
                self.stats["offloaded"] += len(items) if ok else 0
                self.offload_results.put(ok)
            except Exception:  # thread boundary: a failed offload leaves the node unpublished
                logger.exception("spike offload failed")
                self.offload_results.put(False)
            finally:
                self.offload_q.task_done()

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.offload_results.get_nowait()

    def reset(self) -> None:
        self.load_q.join()
        self.offload_q.join()
        while not self.offload_results.empty():
            self.offload_results.get_nowait()
        self.pending_loads.clear()
        self.staged.clear()
        self.known.clear()  # a flush may mean "forget": the next offload writes again
        self.layer_done_counter.reset()
        logger.info("spike linker reset; stats %s", self.stats)

    def close(self) -> None:
        logger.info("spike linker stats %s", self.stats)
        self.fetch.close()
        self.client.close()


def _patch_scheduler() -> None:
    """Park new requests until their pages are staged (the waiting_for_KV queue, reduced to its core)."""
    from sglang.srt.managers.scheduler import Scheduler

    if getattr(Scheduler, "_spike_patched", False):
        return
    add, events, idle = (
        Scheduler._add_request_to_queue,
        Scheduler._process_hicache_events,
        Scheduler.is_fully_idle,
    )

    def add_request(self, req, is_retracted=False):
        if not is_retracted and getattr(req, "input_embeds", None) is None and _LINKER.park(req):
            return
        add(self, req, is_retracted)

    def process_events(self, *args, **kwargs):
        for req in _LINKER.poll():
            add(self, req)
        return events(self, *args, **kwargs)

    def fully_idle(self, *args, **kwargs):
        if _LINKER.parked:
            time.sleep(0.002)  # the parked fetch runs on a worker thread
            return False
        return idle(self, *args, **kwargs)

    Scheduler._add_request_to_queue = add_request
    Scheduler._process_hicache_events = process_events
    Scheduler.is_fully_idle = fully_idle
    Scheduler._spike_patched = True
