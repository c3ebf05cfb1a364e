"""Tail sub-chunks (issue 21): the last, partial chunk of a prompt is stored and fetched in sub-chunks of
``tail_granule`` tokens, chained after the full chunk before it, so a prompt that ends mid-chunk does not
recompute up to a whole chunk.

Covered here without a server: the key chain; the in-process backend and the real DPU data plane
fetching full chunks and sub-chunks in one job (bit-exact into a pool); the admission queue planning
full chunks + sub-chunks from the store's answers; the write-back writing a finished request's tail.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from dpu_helpers import FP, LAYOUT, codecs, make_pool, pool_tokens, random_chunks

from sgl_remote_kv.admission import Phase
from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.runtime import KeySpace
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store import keys as keys_mod
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.writeback.worker import WriteBack
from tests.admission_fakes import C, make_queue, req

CH, G = 32, 8  # chunk and sub-chunk tokens of the fetch tests (dpu_helpers' layout)


def test_tail_keys_chain_after_the_previous_chunk_and_never_collide_with_chunk_keys():
    ns = keys_mod.namespace(FP, "lossless", b"{}")
    ids = list(range(3 * CH))
    full = keys_mod.chunk_keys(ns, ids, CH)
    tail = keys_mod.tail_keys(full[1], ids[2 * CH : 2 * CH + 3 * G], G)
    assert len(tail) == 3 and not set(tail) & set(full)
    assert keys_mod.tail_keys(full[1], ids[2 * CH : 2 * CH + 2 * G], G) == tail[:2]  # a prefix chain
    assert keys_mod.tail_keys(full[0], ids[2 * CH : 2 * CH + 3 * G], G) != tail  # bound to the prefix
    assert keys_mod.tail_keys(full[1], ids[2 * CH : 2 * CH + 3 * G], 2 * G)[0] != tail[1]  # and the granule


def _store_mixed(url: str, codec, tokens: list[int]):
    """Chunks of the given token counts in the store; returns (keys, (k, v) per chunk)."""
    client = open_client(url)
    kv = [random_chunks(1, seed=40 + i, tokens=t)[0] for i, t in enumerate(tokens)]
    keys = [(b"m" + bytes([i])).ljust(32, b"\0") for i in range(len(tokens))]
    client.put_many([(key, codec.encode(k, v, FP)) for key, (k, v) in zip(keys, kv, strict=True)])
    client.close()
    return keys, kv


@pytest.mark.parametrize("codec_name", ["lossless", "quant"])
def test_in_process_backend_fetches_full_and_tail_chunks_in_one_handle(tmp_path, codec_name):
    codec = codecs()[codec_name]
    url = f"file://{tmp_path}/s"
    tokens = [CH, CH, G, G, G]
    keys, kv = _store_mixed(url, codec, tokens)
    be = InProcessFetchBackend(open_client(url), codec, FP, CH)
    h = be.submit("r", keys, 0, None, tokens)
    assert h.wait(30) and h.failure is None and h.ok_tokens == 2 * CH + 3 * G
    for i, chunk in enumerate(kv):
        ref, _ = decode(codec.encode(*chunk, FP), FP)
        assert np.array_equal(h.k[:, h.span(i)], ref), f"chunk {i}"
    short = be.submit("r2", keys[:2] + keys[3:4], 0, None, [CH, CH, CH])  # a sub-chunk where a chunk belongs
    assert short.wait(30) and short.ok_chunks == 2 and short.failure == "decode:chunk_size"
    be.close()


def test_dpu_data_plane_fetches_full_and_tail_chunks_in_one_job_bit_exact(tmp_path):
    from sgl_remote_kv.contract.settings import DataPlaneSettings
    from sgl_remote_kv.contract.sizing import chunk_bytes
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

    codec = codecs()["quant"]
    url = f"file://{tmp_path}/s"
    tokens = [CH, CH, G, G]
    keys, kv = _store_mixed(url, codec, tokens)
    cb = chunk_bytes(LAYOUT, CH)
    spec = DataPlaneSettings(
        workers=(1, 1, 1, 1), layer_group=2, slots=2, slot_bytes=2 * cb, store_timeout_s=2.0
    )
    c = DpuClient(DpuClientConfig(url, dest_slots=2, dest_slot_bytes=2 * cb, process=spec), FP, codec)
    c.start()
    try:
        target = make_pool(LAYOUT, 512, sum(tokens))
        res = c.fetch("mixed", keys, tokens, target, timeout=60)
        assert res.hit_chunks == 4 and not res.failures
        lo = 0
        for i, t in enumerate(tokens):
            k, v = decode(codec.encode(*kv[i], FP), FP)
            pk, pv = pool_tokens(target, LAYOUT, lo, lo + t)
            assert np.array_equal(k, pk) and np.array_equal(v, pv), f"chunk {i}"
            lo += t
    finally:
        c.close()


# -- admission: the plan ------------------------------------------------------------------------------
def _settle(w, r) -> None:
    assert w.q.park(r)
    w.q.parked[r.rid].lookup.result(timeout=10)
    w.q.poll()


def test_a_prompt_ending_mid_chunk_fetches_its_tail_sub_chunks():
    w = make_queue(tail=4)  # C = 16: up to 3 sub-chunks of 4 tokens per region
    r = req("a", 2 * C + 14)  # 45 usable tokens: 2 chunks + 3 sub-chunks (44)
    w.stored(r, 2, subs=3)
    _settle(w, r)
    p = w.q.parked["a"]
    assert p.phase is Phase.FETCH and p.fetch_tokens == [C, C, 4, 4, 4] and len(p.rows) == 2 * C + 12
    w.be.finish("a")
    w.q.poll()
    assert w.host.hits["a"] == (0, 2 * C + 12)


def test_tail_of_the_first_missing_chunk_and_of_a_short_prompt():
    w = make_queue(tail=4)
    longer = req("long", 5 * C + 1)  # the store has 2 chunks + 2 sub-chunks of region 2 (an earlier turn)
    w.stored(longer, 2, subs=2)
    _settle(w, longer)
    assert w.q.parked["long"].fetch_tokens == [C, C, 4, 4]
    short = req("short", 13, base=9000)  # shorter than a chunk: sub-chunks of region 0 only
    w.stored(short, 0, subs=3)
    _settle(w, short)
    assert w.q.parked["short"].fetch_tokens == [4, 4, 4]


def test_without_tails_the_same_store_gives_full_chunks_only():
    w = make_queue(tail=0)
    r = req("a", 2 * C + 14)
    w.stored(r, 2)
    _settle(w, r)
    assert w.q.parked["a"].fetch_tokens == [C, C]
    assert not w.q.park(req("short", 13, base=9000))  # nothing a store without tails could have


def test_a_failed_sub_chunk_installs_the_leading_tokens():
    w = make_queue(tail=4)
    r = req("a", 2 * C + 14)
    w.stored(r, 2, subs=3)
    _settle(w, r)
    w.be.finish("a", ok_chunks=3)  # the second sub-chunk failed
    w.q.poll()
    assert w.host.hits["a"] == (0, 2 * C + 4) and len(w.tree.free_slots) == w.tree.cap - (2 * C + 4)


# -- write-back of a finished request's tail ----------------------------------------------------------
def test_writeback_writes_the_tail_of_a_finished_request(tmp_path):
    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/s"
    pool_k = [torch.randn(256, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16) for _ in range(4)]
    pool_v = [torch.randn(256, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16) for _ in range(4)]
    writer = writer_for(PoolTensors(pool_k, pool_v), LAYOUT)
    n_tok = 2 * CH + 3 * G + 5  # 2 chunks, 3 sub-chunks, 5 tokens left over
    slots = torch.randperm(256)[:n_tok]
    r2t = types.SimpleNamespace(req_to_token=slots[None, :].clone())
    request = types.SimpleNamespace(
        rid="r",
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=list(range(n_tok)),
    )
    keys = KeySpace(FP, codec, CH)
    client = open_client(url)
    wb = WriteBack(
        codec, FP, client, keys, RemoteKVMetrics(), writer, WriteBackRequests(r2t), 1 << 30, tail_granule=G
    )
    wb.offer(request, n_tok)  # a checkpoint mid-request: full chunks only
    assert wb.flush(30)
    full = keys.keys_for(request.full_untruncated_fill_ids, 2, None)
    tail = keys.tail_keys(request.full_untruncated_fill_ids, 2, full[-1], None, None, G)
    assert client.count_prefix(full) == 2 and client.count_prefix(tail) == 0
    wb.offer(request, n_tok, final=True)  # the request's last checkpoint
    assert wb.flush(30)
    assert client.count_prefix(tail) == 3
    for j, blob in enumerate(client.get_many(tail)):
        k, _ = decode(blob, FP)
        lo = 2 * CH + j * G
        ref, _ = writer.read(slots[lo : lo + G])
        assert k.shape[1] == G and np.array_equal(k, ref)
    wb.close()
