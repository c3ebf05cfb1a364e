"""The linker integration's host staging (``kvpool.staged.StagedPages``) and the queue's tree over it
(``admission.staged_tree.StagedTree``), without SGLang: rows reserved, written through the staging
writer, staged under page hashes, pinned by readers, freed only when the last pin is released."""

from __future__ import annotations

import functools
import hashlib
import time

import numpy as np
import pytest
import torch

from sgl_remote_kv.admission.staged_tree import StagedTree
from sgl_remote_kv.kvpool.staged import StagedPages
from sgl_remote_kv.types import KVLayout
from tests.admission_fakes import C, make_queue, req

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")


def _kv(tokens: int, seed: int, layout: KVLayout = LAYOUT):
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, tokens, layout.num_kv_heads, layout.head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    if layout.dtype == "bfloat16":  # storage: raw bf16 bits
        k, v = (
            torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) for a in (k, v)
        )
    return k, v


def load(s: StagedPages, pin) -> tuple[np.ndarray, np.ndarray]:
    """``pin``'s rows, every layer, through ``copy_out`` into a host pool: ``[L, T, H, D]`` K and V."""
    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from sgl_remote_kv.kvpool.writer import TORCH_DTYPES

    lay, t = s.layout, len(pin.rows)
    planes = [
        [
            torch.zeros(t, lay.num_kv_heads, lay.head_dim, dtype=TORCH_DTYPES[lay.dtype])
            for _ in range(lay.num_layers)
        ]
        for _ in "kv"
    ]
    w = writer_for(PoolTensors(*planes), lay)
    done = []
    s.copy_out([(pin, torch.arange(t))], w, done.append)
    assert done == list(range(lay.num_layers))
    return w.read(torch.arange(t))


def free_rows(s: StagedPages) -> int:
    return len(s._free)


def staged_pages(s: StagedPages) -> int:
    return len(s._index)


def hashes(ids: list[int], end: int, page: int = PAGE) -> list[str]:
    """Chained per-page hashes of the first ``end`` tokens (full pages), like SGLang's."""
    out, prev = [], b""
    for i in range(end // page):
        prev = hashlib.sha256(prev + bytes(str(ids[i * page : (i + 1) * page]), "ascii")).digest()
        out.append(prev.hex())
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_rows_round_trip_and_are_freed_by_the_last_pin(dtype):
    layout = KVLayout(2, 1, 8, dtype)
    s = StagedPages(layout, rows=32, page_size=PAGE)
    rows = s.alloc(10)  # 2 full pages + a partial one
    assert free_rows(s) == 22
    k, v = _kv(10, 1, layout)
    s.writer.write(k, v, rows)
    ids = list(range(100, 110))
    stager = s.stage(hashes(ids, 10), rows)
    assert s.leading(hashes(ids, 10)) == 2 and staged_pages(s) == 2
    assert s.leading(hashes(list(range(10)), 10)) == 0

    reader = s.pin(hashes(ids, 8)[1:])  # the second page only
    rk, rv = load(s, reader)
    assert rk.shape == (2, PAGE, 1, 8) and rk.dtype == s.writer.storage
    assert np.array_equal(rk, k[:, PAGE : 2 * PAGE]) and np.array_equal(rv, v[:, PAGE : 2 * PAGE])

    s.release(stager)
    assert free_rows(s) == 22 and s.leading(hashes(ids, 10)) == 2  # the reader still holds the entry
    s.release(reader)
    s.release(reader)  # idempotent
    assert free_rows(s) == 32 and s.leading(hashes(ids, 10)) == 0 and staged_pages(s) == 0
    assert s.pin(hashes(ids, 8)) is None


def test_staging_refuses_what_does_not_fit_and_keeps_the_first_copy_of_a_page():
    s = StagedPages(LAYOUT, rows=16, page_size=PAGE)
    assert s.alloc(17) is None
    a, b = s.alloc(8), s.alloc(8)
    assert s.alloc(1) is None
    ids = list(range(8))
    s.writer.write(*_kv(8, 1), a)
    s.writer.write(*_kv(8, 2), b)
    first = s.stage(hashes(ids, 8), a)
    second = s.stage(hashes(ids, 8), b)  # a concurrent fetch of the same pages
    pin = s.pin(hashes(ids, 8))
    assert torch.equal(pin.rows, a)
    s.release(second)
    assert free_rows(s) == 8  # the duplicate's rows are back; the first copy is untouched
    s.release(first)
    s.release(pin)
    assert free_rows(s) == 16
    with pytest.raises(ValueError):
        s.stage(hashes(ids, 8), s.alloc(4))


def test_forget_unindexes_but_keeps_pinned_rows_until_released():
    s = StagedPages(LAYOUT, rows=8, page_size=PAGE)
    rows = s.alloc(8)
    k, v = _kv(8, 3)
    s.writer.write(k, v, rows)
    ids = list(range(8))
    stager = s.stage(hashes(ids, 8), rows)
    reader = s.pin(hashes(ids, 8))
    s.forget()
    assert s.leading(hashes(ids, 8)) == 0 and s.pin(hashes(ids, 8)) is None
    assert np.array_equal(load(s, reader)[0], k)  # a running load still reads its pages
    s.release(stager)
    s.release(reader)
    assert free_rows(s) == 8


def _staged_queue(rows: int = 256):
    staged = StagedPages(LAYOUT, rows=rows, page_size=PAGE)
    ns = make_queue(
        fraction=1.0, wrap_tree=lambda t: StagedTree(t, staged, lambda r, end: hashes(r.ids, end))
    )
    return ns, staged


def test_queue_stages_a_fetched_hit_and_pins_it_until_admission():
    ns, staged = _staged_queue()
    r = req("a", 3 * C + 5)
    ns.stored(r, 3)
    assert ns.q.park(r)
    for _ in range(3):
        ns.q.poll()
    assert "a" in ns.be.handles, "fetch submitted"
    rows = ns.be.handles["a"].rows
    assert len(rows) == 3 * C and free_rows(staged) == 256 - 3 * C  # staging rows, not pool slots
    ns.be.finish("a")
    for _ in range(3):
        ns.q.poll()
    assert ns.host.released == ["a"]
    assert staged.leading(hashes(r.ids, 3 * C)) == 3 * C // PAGE  # what SGLang's lookup will report
    assert ns.tree.locks == 1  # the device prefix node, held with the staged pages until admission

    # a second request with the same prompt sees the staged pages as its local prefix: no second fetch
    r2 = req("b", 3 * C + 5)
    m = ns.c.tree.match(r2, len(r2.ids))
    assert m.prefix_len == 3 * C

    ns.host.waiting_reqs.clear()  # SGLang admitted the request: the queue drops its hold
    ns.q.poll()
    assert ns.tree.locks == 0 and free_rows(staged) == 256 and staged_pages(staged) == 0


# -- the linker's load into a device pool, under the strict CUDA double's rules ----------------------------
@pytest.fixture
def dev():
    from tests.strict_device import StrictDevice

    d = StrictDevice()
    yield d
    d.close()


def _device_load(dev, timeout_s: float = 10.0):
    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from sgl_remote_kv.sglang_glue.linker import FencedCounter
    from tests.strict_device import StrictKVPool

    lay = KVLayout(3, 2, 8, "bfloat16")
    kv = StrictKVPool(dev, lay, 64, torch.bfloat16)
    writer = writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), lay, timeout_s, ops=dev)
    staged = StagedPages(lay, rows=32, page_size=PAGE)
    rows, ids = staged.alloc(8), list(range(8))
    k, v = _kv(8, 5, lay)
    staged.writer.write(k, v, rows)
    staged.stage(hashes(ids, 8), rows)
    pin = staged.pin(hashes(ids, 8))
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:8].to(torch.int64)
    counter = FencedCounter(lay.num_layers, writer)
    index = counter.update_producer()
    counter.set_consumer(index)
    return kv, writer, staged, pin, slots, counter, index, k


def test_linker_load_into_a_strict_device_pool_is_bit_exact(dev):
    """The copy runs through the device writer (H2D + scatter on its side stream, a layer complete only
    once its event completed); the forward reads each layer after ``wait_until`` (``FencedCounter``:
    also a stream wait on the write's event), under the strict double's rules, bit for bit."""
    kv, writer, staged, pin, slots, counter, index, k = _device_load(dev)
    staged.copy_out([(pin, slots)], writer, functools.partial(counter.complete, index))
    for layer in range(3):
        counter.wait_until(layer)
        got = kv.get_key_buffer(layer)[slots].cpu()
        assert torch.equal(got, torch.from_numpy(k[layer].view(np.int16)).view(torch.bfloat16))
    assert counter.finish(index)


def test_a_hung_device_fails_the_load_and_sglang_is_told(dev):
    """A write that does not complete within the writer's timeout raises ``KVWriteError``; the linker then
    fails the counter, and ``finish`` reports the batch as not landed (SGLang aborts those requests and
    frees their slots): the reading stream waits for the late write first (no read of the pool before)."""
    from sgl_remote_kv.kvpool import KVWriteError
    from tests.strict_device import UnfencedRead

    kv, writer, staged, pin, slots, counter, index, _ = _device_load(dev, timeout_s=0.2)
    dev.hang()
    with pytest.raises(KVWriteError):
        staged.copy_out([(pin, slots)], writer, functools.partial(counter.complete, index))
    counter.fail(index, KVWriteError("hung"))
    with pytest.raises(UnfencedRead):  # the late write is pending: nothing may read (or reuse) its slots
        kv.get_key_buffer(0)
    dev.resume()
    assert not counter.finish(index)
    kv.get_key_buffer(0)  # finish fenced it


def test_linker_releases_a_loads_pins_at_finish_on_the_scheduler_thread():
    """``RemoteKVLinker``'s read side over a stand-in pool: ``lookup`` answers from staging, ``load`` pins,
    the load thread copies every layer, and the pages stay pinned until ``finish_layer_wise_loading`` (the
    scheduler thread, after the forward): the point where staging frees rows is the same on every TP
    rank, whatever the load thread's timing."""
    import types

    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from sgl_remote_kv.sglang_glue.linker import RemoteKVLinker
    from tests.pool_fake import FakeKVPool

    pool = FakeKVPool(LAYOUT, 64)
    staged = StagedPages(LAYOUT, rows=16, page_size=PAGE)
    ids = list(range(40, 48))
    rows = staged.alloc(8)
    k, v = _kv(8, 9)
    staged.writer.write(k, v, rows)
    queue_pin = staged.stage(hashes(ids, 8), rows)  # the queue's lock, held until SGLang admits
    ln = object.__new__(RemoteKVLinker)  # the constructor builds a runtime over a model; the read side only
    ln._pending, ln._inflight = {}, {}
    ln._serve(staged, types.SimpleNamespace(kv_writer=pool.writer, layerwise=None))
    assert ln.lookup("r", [PoolTransfer(name=PoolName.KV, keys=hashes(ids, 8))]) == [1, 2]
    slots = torch.tensor([5, 9, 11, 2, 40, 41, 42, 63])
    assert ln.load("r", [PoolTransfer(name=PoolName.KV, keys=hashes(ids, 8), device_indices=slots)])
    staged.release(queue_pin)  # admitted: only the load's pin holds the pages now
    index = ln.start_layer_wise_loading()
    ln.layer_done_counter.set_consumer(index)
    for layer in range(LAYOUT.num_layers):
        ln.layer_done_counter.wait_until(layer)
        assert np.array_equal(pool.k_buffer[layer][slots].numpy(), k[layer])
    time.sleep(0.05)  # the load thread is done with the batch; its pins must still hold the rows
    assert free_rows(staged) == 8
    assert ln.finish_layer_wise_loading(index)
    assert free_rows(staged) == 16


def test_prefaulting_the_arena_commits_its_pages_and_changes_no_byte():
    """``Arena.prefault`` (a host pool's staging, in the background at start-up): every page resident and
    writable afterwards (the process's RSS grows by the arena), the bytes already written unchanged."""
    import threading

    from sgl_remote_kv.kvpool.arena import Arena

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    a = Arena(64 << 20)
    start = a.alloc(1 << 20)
    a.array[start : start + (1 << 20)] = 7  # an extent in use while another thread prefaults
    before = rss()
    t = threading.Thread(target=lambda: setattr(t, "ok", a.prefault()))
    t.start()
    a.array[start : start + 16] = 9
    t.join()
    assert t.ok
    assert rss() - before >= 0.9 * (63 << 20)  # the untouched 63 MiB are resident now
    assert (a.array[start : start + 16] == 9).all() and (a.array[start + 16 : start + (1 << 20)] == 7).all()
    assert not a.array[start + (1 << 20) :].any()  # the rest still zero
