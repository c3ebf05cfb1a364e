"""How the DPU client writes a round's chunks into the pool (``fetch/dpu_client/rounds.py``): each chunk as soon as
its layers are in the destination region, not once every chunk of the round is (the last chunk's write is
then all that follows the last byte off the link); a chunk is a hit only once all its layers were written,
counted as a prefix in chunk order whatever order the writes ran in; a failed write fails its own chunks
and the later ones, not the chunks before it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from dpu_helpers import CHUNK, FP, LAYOUT, codecs, make_pool, pool_tokens, put_chunks, random_chunks

from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.fetch.dpu_client.jobs import ClientFetch, KVTarget
from sgl_remote_kv.kvpool import KVWriteError

CB = chunk_bytes(LAYOUT, CHUNK)
N = 3


def _client(url: str, eager: bool = True) -> DpuClient:
    spec = DataPlaneSettings(
        workers=(1, 1, 1, 1), layer_group=2, slots=2, slot_bytes=N * CB, store_timeout_s=5.0
    )
    c = DpuClient(
        DpuClientConfig(url, dest_slots=2, dest_slot_bytes=N * CB, process=spec, eager_writes=eager),
        FP,
        codecs()["quant"],
    )
    c.start()
    return c


class _Recording:
    """The target's writer, recording each write's first slot (which chunk it starts at) and, for
    ``fail_slot``, raising like a failed device write."""

    def __init__(self, inner, fail_slot: int | None = None) -> None:
        self.inner, self.fail_slot, self.starts = inner, fail_slot, []

    def write(self, k, v, slots, layer_lo=0):
        self.starts.append((int(slots[0]), len(slots), layer_lo, k.shape[0]))
        if self.fail_slot is not None and self.fail_slot in slots.tolist():
            raise KVWriteError("injected")
        self.inner.write(k, v, slots, layer_lo)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_each_chunk_is_written_when_it_arrived_not_when_the_round_did(tmp_path):
    """One fetch worker and a store 0.3 s away: chunk 0 is in the pool while chunk 2 is still in the
    store; the fetch is then an exact full hit."""
    keys, blobs = put_chunks(f"file://{tmp_path}/s", codecs()["quant"], random_chunks(N, seed=8))
    c = _client(f"faulty+file://{tmp_path}/s?latency_s=0.3")
    try:
        target = make_pool(LAYOUT, 256, N * CHUNK)
        h = c.submit("r", keys, CHUNK, target)
        deadline, early = time.monotonic() + 30, None
        while time.monotonic() < deadline and early is None:
            with c.cv:
                if all(h.written[0]):
                    early = (h.layers_seen[N - 1], h.finished)
            time.sleep(0.005)
        assert early == (0, False)  # chunk 0 written; nothing of the last chunk in the region yet
        assert h.wait(30).hit_chunks == N
    finally:
        c.close()
    for i in range(N):
        k, v = decode(blobs[i], FP)
        pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
        assert np.array_equal(k, pk) and np.array_equal(v, pv), i


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "per_round"])
def test_writes_are_per_chunk_run_and_per_round_without_eager(tmp_path, eager):
    keys, _ = put_chunks(f"file://{tmp_path}/s", codecs()["quant"], random_chunks(N, seed=9))
    c = _client(f"faulty+file://{tmp_path}/s?latency_s=0.05", eager)
    try:
        target = make_pool(LAYOUT, 256, N * CHUNK)
        rec = _Recording(target.writer)
        assert c.fetch("r", keys, CHUNK, KVTarget(rec, target.rows), timeout=30).hit_chunks == N
    finally:
        c.close()
    slots = target.rows.tolist()
    if eager:  # never more than one chunk's tokens at a time here (chunks arrive 50 ms apart)
        assert {(s, n) for s, n, _, _ in rec.starts} == {(slots[i * CHUNK], CHUNK) for i in range(N)}
        assert sum(layers for *_, layers in rec.starts) == N * LAYOUT.num_layers
    else:
        assert rec.starts == [(slots[0], N * CHUNK, 0, LAYOUT.num_layers)]


def test_a_failed_write_fails_its_chunk_and_the_later_ones_not_the_earlier(tmp_path):
    keys, blobs = put_chunks(f"file://{tmp_path}/s", codecs()["quant"], random_chunks(N, seed=10))
    c = _client(f"faulty+file://{tmp_path}/s?latency_s=0.05")
    try:
        target = make_pool(LAYOUT, 256, N * CHUNK)
        rec = _Recording(target.writer, fail_slot=int(target.rows[CHUNK]))  # chunk 1's first token
        res = c.fetch("r", keys, CHUNK, KVTarget(rec, target.rows), timeout=30)
    finally:
        c.close()
    assert res.hit_chunks == 1 and res.failures[1] == "write" and set(res.failures) <= {1, 2}
    k, v = decode(blobs[0], FP)
    pk, pv = pool_tokens(target, LAYOUT, 0, CHUNK)
    assert np.array_equal(k, pk) and np.array_equal(v, pv)


def test_chunks_count_as_in_the_pool_only_as_a_prefix():
    """Chunk 1 written before chunk 0 (two fetch workers can finish out of order): no layer is ready
    until chunk 0's is too; then both are."""
    h = ClientFetch(
        threading.Condition(), "r", [b"a" * 32, b"b" * 32], [CHUNK, CHUNK], LAYOUT.num_layers, None
    )
    h.mark_written(1, 2, 0, LAYOUT.num_layers)
    assert h.layer_ready == [0] * LAYOUT.num_layers and not h.layer_is_ready(0)
    h.mark_written(0, 1, 0, 2)
    assert h.layer_ready == [2, 2] + [0] * (LAYOUT.num_layers - 2)
    assert h.layer_is_ready(1) and not h.layer_is_ready(2)


def test_a_lost_round_ends_its_request_with_its_queued_rounds():
    """The data plane died with one round of a request in flight and two queued: the request ends at once
    (a miss from the lost round on), not when a later pump or its timeout notices."""
    from sgl_remote_kv.contract import protocol as P
    from sgl_remote_kv.fetch.dpu_client.rounds import RoundBook

    cv = threading.Condition()
    book = RoundBook(LAYOUT, None, 1, CB, lambda r: P.Cancel(r.job, 0), {}, None)
    h = ClientFetch(cv, "r", [b"a", b"b", b"c"], [CHUNK] * 3, LAYOUT.num_layers, None)
    book.add(h)
    assert len(book.inflight) == 1 and len(book.pending) == 2 and not h.finished
    assert book.lose_inflight("dataplane_lost") == 1
    assert h.finished and not book.pending and h.first_fail == 0
    assert h.failures[0] == "dataplane_lost"
