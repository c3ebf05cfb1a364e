"""Staging that holds codes (``kvpool.rows.RowStore`` with ``keep_codes``): on a device pool, every fetch
path stages what it delivers before dequantization, and the linker's load (``StagedPages.copy_out``)
uploads it and decodes on the device, under the strict CUDA double's rules (``strict_device.py``).

What must hold: no host dequant or inverse transform anywhere on the read path (the host stages are
patched to fail; the writers' counters stay 0); the pool holds what the codec's own CPU decode gives
(bit for bit for the quantized and lossless codecs, one bf16 step for the transform codec's float
summation order); a load of pages that start or end inside a chunk decodes the chunk and scatters only
its window; records are uploaded from the pinned arena where they lie; arena bytes come back when the
rows are freed; an arena that is full is a failed write (a miss), never a partial hit.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from dpu_helpers import CHUNK as DPU_CHUNK
from dpu_helpers import FP as DPU_FP
from dpu_helpers import LAYOUT as DPU_LAYOUT
from dpu_helpers import codecs, dataplane_stage_items, put_chunks, random_chunks
from strict_device import StrictDevice, StrictKVPool
from test_inproc_device_decode import FP, LAY, C, N, _assert_decoded, _store
from test_staged import hashes

from sgl_remote_kv.codec import quant, transform, trellis
from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.kvpool import KVWriteError, PoolTensors, writer_for
from sgl_remote_kv.kvpool.staged import StagedPages, codes_bytes_per_token, staging_plan
from sgl_remote_kv.sglang_glue.linker import FencedCounter

PAGE = 8


@pytest.fixture
def dev():
    d = StrictDevice()
    yield d
    d.close()


def _no_host_dequant(monkeypatch) -> None:
    """Any host dequant stage (quantized codecs), host inverse transform or host trellis replay (transform
    codec) fails."""

    def refuse(*a, **k):
        raise AssertionError("host dequant on a device pool's read path")

    monkeypatch.setattr(quant.LayerView, "dequant_into", refuse)
    monkeypatch.setattr(transform.TransformView, "dequant_into", refuse)
    monkeypatch.setattr(transform.TransformView, "replayed", refuse)
    monkeypatch.setattr(trellis, "replay", refuse)


def _device(dev, layout=LAY, size=128):
    kv = StrictKVPool(dev, layout, size, torch.bfloat16)
    return kv, writer_for(PoolTensors(kv.k_buffer, kv.v_buffer), layout, ops=dev)


def _staging(writer, rows: int, layout=LAY, codec=None, nbytes=None) -> StagedPages:
    plan = staging_plan(layout, writer.device_dequant, codec, [])
    s = StagedPages(
        layout, rows, PAGE, keep_codes=plan.keep_codes, nbytes=nbytes or rows * plan.bytes_per_token
    )
    writer.register_host(s.writer.arena.array)
    return s


def _load(staged, pin, writer, kv, slots):
    """The linker's load: ``copy_out`` on this thread, the forward's per-layer wait and read after it."""
    counter = FencedCounter(staged.layout.num_layers, writer)
    index = counter.update_producer()
    counter.set_consumer(index)
    staged.copy_out([(pin, slots)], writer, functools.partial(counter.complete, index))
    for layer in range(staged.layout.num_layers):
        counter.wait_until(layer)
        kv.get_key_buffer(layer)  # the strict read rule: only after the layer's event
    assert counter.finish(index)


def _fetch(client, codec, staged, keys):
    """The in-process path's fetch of ``keys``, asking the staging what to deliver (codes or KV)."""
    be = InProcessFetchBackend(client, codec, FP, C, keep_codes=staged.writer.device_dequant)
    h = be.submit("r", keys, start_token=0)
    assert h.wait(30) and h.failure is None
    return be, h


def _stage(staged, h, ids):
    """``h``'s chunks into new staging rows, staged under the pages of ``ids``; the stager's pin."""
    rows = staged.alloc(N * C)
    h.write_staged(staged.writer, rows, N * C)
    return staged.stage(hashes(ids, N * C, PAGE), rows)


@pytest.mark.parametrize("kind", ["quant_deflate", "transform", "transform_trellis"])
def test_inproc_codes_are_staged_and_decoded_on_the_device(tmp_path, dev, monkeypatch, kind):
    client, codec, keys, k, v = _store(tmp_path, kind)
    kv, w = _device(dev)
    staged = _staging(w, 64, codec=codec)
    assert staged.writer.device_dequant  # the fetch paths' question: stage codes
    be, h = _fetch(client, codec, staged, keys)
    assert h.codes is not None
    _no_host_dequant(monkeypatch)
    ids = list(range(1000, 1000 + N * C))
    entry = _stage(staged, h, ids)
    # pages 1..4 of 6: tokens 8..40, from the middle of chunk 0 to the middle of chunk 2
    pin = staged.pin(hashes(ids, N * C, PAGE)[1:5])
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(5))[:32]
    uploads = []
    real = dev.upload
    monkeypatch.setattr(dev, "upload", lambda dst, src: (uploads.append(src.numel()), real(dst, src)))
    writes = w.stats["writes"]
    _load(staged, pin, w, kv, slots)
    if kind != "quant_deflate":  # per layer: the record's arrays in one run from the arena, the slots staged
        assert len(uploads) == 2 * (w.stats["writes"] - writes)
    rk, rv = w.read(slots)
    _assert_decoded(codec, rk, k[:, 8:40])
    _assert_decoded(codec, rv, v[:, 8:40])
    assert staged.writer.stats["host_dequant"] == 0 and w.host_dequant_tokens == 0
    assert staged.writer.stats["codes"] == N * C * LAY.num_layers and staged.writer.stats["kv"] == 0
    assert w.stats["device_dequant"] >= LAY.num_layers and w.stats["zero_copy_parts"] > 0  # from the arena
    used = staged.writer.arena.used
    assert 0 < used <= N * C * codes_bytes_per_token(LAY)  # within the plan's bound
    staged.release(entry)
    staged.release(pin)
    assert staged.writer.arena.used == 0 and not staged.writer._records  # every record's bytes back
    be.close()
    client.close()


def test_a_host_pool_keeps_the_host_decode_bit_for_bit(tmp_path):
    """The CPU platform: the same calls stage KV (decoded on the host), and the load is exact."""
    client, codec, keys, k, v = _store(tmp_path, "quant_deflate")
    from sgl_remote_kv.kvpool.writer import TORCH_DTYPES

    planes = [
        [torch.zeros(64, LAY.num_kv_heads, LAY.head_dim, dtype=TORCH_DTYPES[LAY.dtype]) for _ in range(3)]
        for _ in "kv"
    ]
    w = writer_for(PoolTensors(*planes), LAY)
    staged = _staging(w, 64, codec=codec)
    assert not staged.writer.device_dequant and staged.writer.bytes_per_token == LAY.bytes_per_token()
    be, h = _fetch(client, codec, staged, keys)
    assert h.codes is None
    ids = list(range(N * C))
    _stage(staged, h, ids)
    pin = staged.pin(hashes(ids, N * C, PAGE)[1:5])
    slots = torch.arange(32)
    staged.copy_out([(pin, slots)], w, lambda layer: None)
    rk, rv = w.read(slots)
    assert np.array_equal(rk, k[:, 8:40]) and np.array_equal(rv, v[:, 8:40])
    be.close()
    client.close()


def test_lossless_kv_is_staged_as_kv_and_uploaded_zero_copy_bit_exact(tmp_path, dev, monkeypatch):
    """A codec without a device stage delivers KV: staging keeps it as plain records (the plan says why,
    sized for KV), and the load uploads each run from the pinned arena, bit for bit."""
    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.store.client import open_client

    codec = get_codec("lossless")
    client = open_client(f"file://{tmp_path / 'store'}")
    keys = [bytes([i]) * 32 for i in range(N)]
    chunks = [synthetic.kv(LAY, C, seed=i) for i in range(N)]
    client.put_many([(key, codec.encode(*kv_, FP)) for key, kv_ in zip(keys, chunks, strict=True)])
    kv, w = _device(dev)
    plan = staging_plan(LAY, w.device_dequant, codec, [])
    assert not plan.keep_codes and plan.bytes_per_token == LAY.bytes_per_token()
    staged = _staging(w, 64, codec=codec)
    be, h = _fetch(client, codec, staged, keys)
    ids = list(range(N * C))
    _stage(staged, h, ids)
    pin = staged.pin(hashes(ids, N * C, PAGE))
    slots = torch.randperm(128)[: N * C]
    _no_host_dequant(monkeypatch)
    _load(staged, pin, w, kv, slots)
    rk, rv = w.read(slots)
    assert np.array_equal(rk, np.concatenate([c[0] for c in chunks], axis=1))
    assert np.array_equal(rv, np.concatenate([c[1] for c in chunks], axis=1))
    assert w.stats["zero_copy"] == LAY.num_layers and w.stats["staged"] == 0  # no pinned bounce copy
    be.close()
    client.close()


@pytest.mark.parametrize("workers", [(1, 1, 1, 1), (1, 3, 1, 1)])
def test_dpu_codes_output_is_staged_and_decoded_on_the_device(tmp_path, dev, monkeypatch, workers):
    """The data plane's ``auto`` output for staging that keeps codes: its lossless stage only (nothing
    dequantized on the data plane), codes copied into the arena, dequantized on the device at load,
    bit-identical to the CPU decode; also with three inflate workers writing codes concurrently."""
    from sgl_remote_kv.contract.settings import DataPlaneSettings
    from sgl_remote_kv.contract.sizing import chunk_bytes
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
    from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget

    codec = codecs()["quant"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(4, seed=8))
    cb = chunk_bytes(DPU_LAYOUT, DPU_CHUNK)
    spec = DataPlaneSettings(workers=workers, layer_group=2, slots=2, slot_bytes=2 * cb, store_timeout_s=2.0)
    c = DpuClient(DpuClientConfig(url, dest_slots=2, dest_slot_bytes=2 * cb, process=spec), DPU_FP, codec)
    c.start()
    try:
        kv, w = _device(dev, DPU_LAYOUT, 512)
        staged = _staging(w, 4 * DPU_CHUNK, DPU_LAYOUT, codec)
        rows = staged.alloc(4 * DPU_CHUNK)
        _no_host_dequant(monkeypatch)
        res = c.fetch("codes", keys, DPU_CHUNK, KVTarget(staged.writer, rows), timeout=60)
        assert res.hit_chunks == 4 and not res.failures
        assert dataplane_stage_items(c)["dequant"] == 0  # the data plane only inflated
        assert staged.writer.stats["codes"] > 0 and staged.writer.stats["kv"] == 0
        ids = list(range(4 * DPU_CHUNK))
        staged.stage(hashes(ids, 4 * DPU_CHUNK, PAGE), rows)
        pin = staged.pin(hashes(ids, 4 * DPU_CHUNK, PAGE))
        slots = torch.randperm(512)[: 4 * DPU_CHUNK]
        writes = w.stats["writes"]
        assert len(staged.writer._records) > DPU_LAYOUT.num_layers  # the rounds staged several per layer
        _load(staged, pin, w, kv, slots)
        assert w.stats["writes"] - writes == DPU_LAYOUT.num_layers  # joined: one device write per layer
        monkeypatch.undo()
        rk, rv = w.read(slots)
        for i in range(4):
            k, v = decode(blobs[i], DPU_FP)
            span = slice(i * DPU_CHUNK, (i + 1) * DPU_CHUNK)
            assert np.array_equal(rk[:, span], k) and np.array_equal(rv[:, span], v), f"chunk {i}"
        assert w.host_dequant_tokens == 0
    finally:
        c.close()


def test_a_full_arena_is_a_failed_write_and_freed_rows_give_bytes_back(tmp_path, dev):
    client, codec, keys, _, _ = _store(tmp_path, "transform")
    _, w = _device(dev)
    staged = _staging(w, 64, codec=codec, nbytes=4096)  # far less than 48 tokens of codes
    be = InProcessFetchBackend(client, codec, FP, C, keep_codes=True)
    h = be.submit("r", keys, start_token=0)
    assert h.wait(30)
    rows = staged.alloc(N * C)
    with pytest.raises(KVWriteError, match="arena full"):
        h.write_staged(staged.writer, rows, N * C)
    assert staged.writer.stats["full"] == 1
    staged.free(rows)  # the queue gives the reservation back after the failed write
    assert staged.writer.arena.used == 0 and not staged.writer._records
    be.close()
    client.close()


def test_a_row_written_again_supersedes_its_record_and_a_never_written_layer_fails_the_load(dev):
    from sgl_remote_kv.types import KVLayout

    lay = KVLayout(2, 1, 8, "bfloat16")
    staged = StagedPages(lay, rows=16, page_size=4)
    rows = staged.alloc(8)
    k = np.arange(2 * 8 * 8, dtype=np.uint16).reshape(2, 8, 1, 8)
    staged.writer.write(k, k, rows)
    staged.writer.write(k[:, :4] + 1, k[:, :4] + 1, rows[:4])  # the first 4 rows again
    assert len(staged.writer._records) == 2
    runs = staged.writer.windows(rows.numpy(), 0)
    assert [(a, b, i) for _, a, b, i in runs] == [(0, 4, 0), (4, 8, 4)]
    staged.writer.write(k[:, 4:] + 2, k[:, 4:] + 2, rows[4:])
    assert len(staged.writer._records) == 2  # the first record lost every cell: its bytes are back
    other = staged.alloc(4)
    staged.writer.write(k[:1, :4], k[:1, :4], other)  # layer 0 only
    with pytest.raises(KVWriteError, match="layer 1 of a staged row holds no KV"):
        staged.writer.windows(other.numpy(), 1)


def test_the_plan_says_why_a_path_stages_kv_and_sizes_the_arena_for_it():
    """Start-up's one line per path that cannot deliver codes (``assemble.plain_paths``), and the arena
    sized for KV whenever one can write KV (any mix then fits)."""
    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.sglang_glue.assemble import plain_paths

    quant = get_codec("quant_deflate")
    kv = LAY.bytes_per_token()
    assert plain_paths(RemoteKVConfig(mode="dpu"), quant) == []
    plan = staging_plan(LAY, True, quant, [])
    assert plan.keep_codes and plan.bytes_per_token == codes_bytes_per_token(LAY) <= 0.6 * kv
    why = plain_paths(RemoteKVConfig(mode="dpu", dpu_output="kv"), quant)
    assert len(why) == 1 and "--remote-kv-dpu-output kv" in why[0]
    assert staging_plan(LAY, True, quant, why) == type(plan)(True, kv, tuple(why))
    assert any("NVDEC" in w for w in plain_paths(RemoteKVConfig(mode="auto"), quant))
    lossless = get_codec("lossless")
    why = plain_paths(RemoteKVConfig(mode="inproc"), lossless)
    assert len(why) == 1 and "no device dequant stage" in why[0]
    assert not staging_plan(LAY, True, lossless, why).keep_codes
    host = staging_plan(LAY, False, quant, [])
    assert not host.keep_codes and host.bytes_per_token == kv and "host memory" in host.reasons[0]


def test_consecutive_codes_runs_join_into_one_write_and_only_those():
    from sgl_remote_kv.kvpool.rows import Record
    from sgl_remote_kv.kvpool.staged import _joined

    def codes(tokens):
        return Record(
            0,
            1,
            tokens,
            0,
            0,
            views=(quant.LayerView(1, 1, *([np.empty(0)] * 3), np.empty((tokens, 1)), None),),
        )

    r1, r2, r3 = codes(16), codes(16), codes(16)
    plain = Record(0, 1, 8, 0, 0, k=np.empty(0), v=np.empty(0))
    # from the middle of r1 to the middle of r2: one write, window 4..24 of their 32 tokens
    assert [(len(v), a, b, i) for v, a, b, i in _joined([(r1, 4, 16, 0), (r2, 0, 8, 12)])] == [(2, 4, 24, 0)]
    # r1 not run to its end, rows that do not follow on, or a plain record between: separate writes
    assert len(_joined([(r1, 0, 10, 0), (r2, 0, 16, 10)])) == 2
    assert len(_joined([(r1, 0, 16, 0), (r2, 0, 16, 20)])) == 2
    got = _joined([(r1, 0, 16, 0), (plain, 0, 8, 16), (r3, 0, 16, 24)])
    assert [type(g[0]) for g in got] == [list, Record, list]
