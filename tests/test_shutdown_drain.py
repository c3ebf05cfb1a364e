"""The write-back drains at a graceful scheduler exit (issue 40), without a server: SGLang's
``release_host_resources`` (SGLang's ``UnifiedRadixCache`` over its own test-kit parameters, with our
linker attached: it calls ``RemoteKVLinker.close``) waits until a slow store (``faulty+file://`` with a latency: the fault) holds every queued
chunk and tail sub-chunk of a finished request, and gives up after ``WRITEBACK_DRAIN_S``, logging what
is lost. The server and Engine paths that reach it: ``tests/test_shutdown_drain_server.py``,
``tests/test_engine_api.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types

import pytest
import torch
from dpu_helpers import FP, LAYOUT, codecs

from sgl_remote_kv import runtime
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch.base import FetchPath
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import PathName
from sgl_remote_kv.writeback.worker import WriteBack

CH, G = 32, 8
N_TOK = 2 * CH + 3 * G + 5  # 2 chunks, 3 tail sub-chunks, 5 tokens left over


def _runtime(url: str) -> tuple[runtime.RemoteKVRuntime, types.SimpleNamespace]:
    """A runtime whose write-back holds a finished request's chunks and tail (queued, not yet written)."""
    codec = codecs()["lossless"]
    pool = [torch.randn(256, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16) for _ in range(8)]
    writer = writer_for(PoolTensors(pool[:4], pool[4:]), LAYOUT)
    slots = torch.randperm(256)[:N_TOK]
    request = types.SimpleNamespace(
        rid="r",
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=list(range(N_TOK)),
    )
    client = open_client(url)
    keys = runtime.KeySpace(FP, codec, CH)
    r2t = types.SimpleNamespace(req_to_token=slots[None, :].clone())
    wb = WriteBack(
        codec, FP, client, keys, RemoteKVMetrics(), writer, WriteBackRequests(r2t), 1 << 30, tail_granule=G
    )
    path = FetchPath(PathName.INPROC, InProcessFetchBackend(client, codec, FP, CH), codec)
    cfg = RemoteKVConfig(mode="inproc", chunk_size=CH)  # the write-back above has its own tail granule
    rt = runtime.build(
        cfg, FP, codec, client, [path], threading.Event(), kv_writer=writer, keys=keys, writeback=wb
    )
    wb.offer(request, N_TOK, final=True)  # the request's last checkpoint: 2 chunks + 3 sub-chunks queued
    full = keys.keys_for(request.full_untruncated_fill_ids, 2, None)
    tail = keys.tail_keys(request.full_untruncated_fill_ids, 2, full[-1], None, None, G)
    return rt, types.SimpleNamespace(full=full, tail=tail)


def _cache():
    """SGLang's own cache on its test-kit parameters with our linker attached (``init_cache_linker``, as
    ``registry.create_unified_radix_cache`` does). The test hands the linker its runtime (``linker.rt``;
    the constructor would build one over a model, which this test does not have)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.test.kits.unified_radix_cache.core import DisabledUnifiedRadixCacheFixtures

    from sgl_remote_kv.sglang_glue.linker import RemoteKVLinker

    params = DisabledUnifiedRadixCacheFixtures()._params(disable=False)
    cache = UnifiedRadixCache(dataclasses.replace(params, eviction_policy_config=None))
    linker = object.__new__(RemoteKVLinker)
    linker.pools, linker.staged = {}, object()
    cache.init_cache_linker(linker)
    return cache, linker


def test_graceful_exit_drains_the_write_back_tail_included(tmp_path, caplog):
    cache, linker = _cache()
    rt, keys = _runtime(f"faulty+file://{tmp_path}/s?latency_s=0.3")  # each store call takes 0.3 s
    linker.rt = rt
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger=runtime.__name__):
        cache.release_host_resources()
    took = time.monotonic() - t0
    assert rt.client.count_prefix(keys.full) == 2 and rt.client.count_prefix(keys.tail) == 3
    assert 1.0 < took < runtime.WRITEBACK_DRAIN_S  # it waited: two jobs, 4 store calls of 0.3 s at least
    assert any(r.getMessage().startswith("shutdown: write-back drained in") for r in caplog.records)
    rt.close()


def test_the_drain_is_bounded(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runtime, "WRITEBACK_DRAIN_S", 0.3)
    rt, _ = _runtime(f"faulty+file://{tmp_path}/s?latency_s=1")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=runtime.__name__):
        rt.on_shutdown()
    assert time.monotonic() - t0 == pytest.approx(0.3, abs=0.25)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("did not drain in 0.3 s" in m and "queued jobs are lost" in m for m in msgs), msgs
    assert rt.writeback.flush(30)  # let the worker finish before the client closes
    rt.close()
