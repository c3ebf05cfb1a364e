"""The write-back's backpressure (issue 51 item 3), without a server: while the worker is stuck on a slow
store, new requests' chunks keep arriving; the queue holds at most ``max_bytes`` of KV, drops the
*oldest* queued jobs past it (never blocking ``offer``, which runs on the scheduler thread), counts the
dropped chunks in ``writeback_skipped{reason="queue_full"}``, shows its bytes in ``writeback_queue_bytes``
and logs once a minute, not once a drop. What is written after the store recovers is the newest work."""

from __future__ import annotations

import logging
import threading
import time
import types

import torch
from dpu_helpers import FP, LAYOUT, codecs

from sgl_remote_kv import runtime
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.writeback.worker import WriteBack

CH = 32
CHUNK_BYTES = CH * LAYOUT.bytes_per_token()


class _GatedStore:
    """The store client, whose ``count_prefix`` (the worker's first call per job) waits for a gate."""

    def __init__(self, client) -> None:
        self.client, self.gate, self.entered = client, threading.Event(), threading.Event()

    def count_prefix(self, keys):
        self.entered.set()
        self.gate.wait(30)
        return self.client.count_prefix(keys)

    def __getattr__(self, name):
        return getattr(self.client, name)


def _request(rid: str, n: int, base: int):
    return types.SimpleNamespace(
        rid=rid,
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=list(range(base, base + n)),
    )


def test_a_full_queue_drops_the_oldest_counts_and_logs_once_and_never_blocks(tmp_path, caplog):
    codec = codecs()["lossless"]
    pool = [torch.randn(512, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16) for _ in range(8)]
    writer = writer_for(PoolTensors(pool[:4], pool[4:]), LAYOUT)
    store = _GatedStore(open_client(f"file://{tmp_path / 'store'}"))
    keys = runtime.KeySpace(FP, codec, CH)
    r2t = types.SimpleNamespace(req_to_token=torch.arange(2 * CH)[None, :].clone())
    metrics = RemoteKVMetrics()
    wb = WriteBack(
        codec, FP, store, keys, metrics, writer, WriteBackRequests(r2t), 3 * 2 * CHUNK_BYTES
    )  # 3 requests of 2 chunks
    caplog.set_level(logging.WARNING, logger="sgl_remote_kv.writeback.worker")

    reqs = [_request(f"r{i}", 2 * CH, 1000 * i) for i in range(10)]
    wb.offer(reqs[0], 2 * CH)
    assert store.entered.wait(10)  # the worker holds r0 (being written: not counted as queued)
    t0 = time.monotonic()
    for r in reqs[1:]:
        wb.offer(r, 2 * CH)
    assert time.monotonic() - t0 < 2.0  # offer never waited for the stuck worker
    snap = metrics.snapshot()
    assert snap["writeback_skipped|reason=queue_full"] == 6 * 2  # r1..r6 dropped, 2 chunks each
    assert snap["writeback_queue_bytes"] == 3 * 2 * CHUNK_BYTES  # r7, r8, r9 queued
    assert wb.pending() == 4  # r0 being written + 3 queued
    drops = [r for r in caplog.records if "write-back behind" in r.getMessage()]
    assert len(drops) == 1 and drops[0].levelno == logging.WARNING  # once a minute, not once a drop

    store.gate.set()
    assert wb.flush(30)
    written = [store.client.count_prefix(keys.keys_for(r.full_untruncated_fill_ids, 2, None)) for r in reqs]
    assert written == [2, 0, 0, 0, 0, 0, 0, 2, 2, 2]  # the oldest unwritten were dropped, the newest kept
    assert metrics.snapshot()["writeback_queue_bytes"] == 0
    wb.close()
    store.client.close()


def test_one_job_larger_than_the_bound_is_kept(tmp_path):
    """The newest job is always kept: a bound smaller than one request only drops what came before."""
    codec = codecs()["lossless"]
    pool = [torch.randn(512, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16) for _ in range(8)]
    writer = writer_for(PoolTensors(pool[:4], pool[4:]), LAYOUT)
    client = open_client(f"file://{tmp_path / 'store'}")
    keys = runtime.KeySpace(FP, codec, CH)
    r2t = types.SimpleNamespace(req_to_token=torch.arange(2 * CH)[None, :].clone())
    wb = WriteBack(codec, FP, client, keys, RemoteKVMetrics(), writer, WriteBackRequests(r2t), 1)
    req = _request("big", 2 * CH, 7)
    wb.offer(req, 2 * CH)
    assert wb.flush(30)
    assert client.count_prefix(keys.keys_for(req.full_untruncated_fill_ids, 2, None)) == 2
    wb.close()
    client.close()
