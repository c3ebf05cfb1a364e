"""NVDEC fetch backend (direct): store -> pool -> frames restored and written into the reserved KV slots
through the pool's KVWriter group by group; layer-group progress, misses, corrupt chunks, failed writes
(CPU pools and the strict CUDA double)."""

from __future__ import annotations

import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401
import torch
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec
from sgl_remote_kv.nvdec.pool import DecoderPool

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.fetch.nvdec import NvdecFetchBackend

C = 8


class DictClient:
    def __init__(self, data: dict[bytes, bytes]):
        self.data = data
        self.corrupt: list[bytes] = []  # keys reported corrupt (StoreClient.report_corrupt)

    def get_many(self, keys):
        return [self.data.get(k) for k in keys]

    def report_corrupt(self, key: bytes, where: str, why: str) -> None:
        self.corrupt.append(key)


def _setup(n_chunks=3, layers=4):
    fp = synthetic.fingerprint(num_layers=layers)
    codec = HevcCodec(tokens_per_frame=4, min_side=16)
    k, v = synthetic.kv(fp.layout, n_chunks * C, seed=4)
    data, ref_k, ref_v = {}, [], []
    for i in range(n_chunks):
        ck, cv = (
            np.ascontiguousarray(k[:, i * C : (i + 1) * C]),
            np.ascontiguousarray(v[:, i * C : (i + 1) * C]),
        )
        blob = codec.encode(ck, cv, fp)
        data[b"key%d" % i] = blob
        dk, dv = codec.decode(blob, fp)
        ref_k.append(dk)
        ref_v.append(dv)
    return fp, codec, data, np.concatenate(ref_k, 1), np.concatenate(ref_v, 1)


def _pool(fp, ops=None, slots=64):
    """A KV pool (CPU, or planes of the strict device double) behind its writer, and shuffled slots."""
    from sgl_remote_kv.kvpool import PoolTensors, writer_for

    lay = fp.layout
    shape = (slots, lay.num_kv_heads, lay.head_dim)
    dt = torch.float32 if lay.dtype == "float32" else getattr(torch, lay.dtype)
    make = (lambda: torch.zeros(shape, dtype=dt)) if ops is None else (lambda: ops.plane(shape, dt))
    writer = writer_for(
        PoolTensors([make() for _ in range(lay.num_layers)], [make() for _ in range(lay.num_layers)]),
        lay,
        ops=ops,
    )
    return writer, torch.randperm(slots, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("device", ["cpu", "strict-cuda"])
def test_fetch_writes_every_chunk_into_its_slots_and_reports_all_layers(device):
    from strict_device import StrictDevice

    fp, codec, data, rk, rv = _setup()
    dev = StrictDevice() if device != "cpu" else None
    try:
        writer, slots = _pool(fp, dev)
        with DecoderPool(instances=2) as pool:
            be = NvdecFetchBackend(DictClient(data), pool, codec, fp, C, writer)
            assert be.direct
            h = be.submit("r1", [b"key0", b"key1", b"key2"], 0, slots[: 3 * C])
            assert h.wait(60)
            be.close()
        assert h.failure is None and h.ok_chunks == 3 and h.layers_ready == 4 and h.layer_ready(3)
        assert h.k is None  # no whole-request staging: frames went into the pool group by group
        k, v = writer.read(slots[: 3 * C])
        assert np.array_equal(k, rk) and np.array_equal(v, rv) and be.queue_depth() == 0
    finally:
        if dev is not None:
            dev.close()


def test_fetch_stops_at_first_miss_or_corrupt_chunk():
    fp, codec, data, rk, _ = _setup()
    bad = bytearray(data[b"key1"])
    bad[-5] ^= 1
    data[b"bad"] = bytes(bad)
    writer, slots = _pool(fp)
    client = DictClient(data)
    with DecoderPool(instances=1) as pool:
        be = NvdecFetchBackend(client, pool, codec, fp, C, writer)
        miss = be.submit("r2", [b"key0", b"nope", b"key2"], 0, slots[: 3 * C])
        corrupt = be.submit("r3", [b"key0", b"bad", b"key2"], 0, slots[3 * C : 6 * C])
        assert miss.wait(60) and corrupt.wait(60)
        be.close()
    assert miss.ok_chunks == 1 and miss.failure == "store_miss"
    assert np.array_equal(writer.read(slots[:C])[0], rk[:, :C])
    assert corrupt.ok_chunks == 1 and corrupt.failure.startswith("decode:CorruptChunk")
    assert client.corrupt == [b"bad"]  # counted once as a corrupt store value (store_errors_total)


def test_a_failed_write_fails_the_chunk_never_a_hit():
    from strict_device import StrictDevice

    fp, codec, data, _, _ = _setup()
    dev = StrictDevice()
    try:
        writer, slots = _pool(fp, dev)
        dev.error = RuntimeError("an illegal memory access was encountered")
        with DecoderPool(instances=1) as pool:
            be = NvdecFetchBackend(DictClient(data), pool, codec, fp, C, writer)
            h = be.submit("r4", [b"key0", b"key1"], 0, slots[: 2 * C])
            assert h.wait(60)
            be.close()
        assert h.ok_chunks == 0 and h.failure == "write"
    finally:
        dev.close()


def test_layerwise_install_of_a_direct_nvdec_fetch_reads_the_written_slots():
    """Layer-wise admission of an NVDEC fetch: the handle is direct (its frames are already in the slots),
    so the layer-transfer counter only waits for each layer and never re-writes it."""
    from pool_fake import FakeKVPool, attach_installs

    from sgl_remote_kv.metrics import RemoteKVMetrics

    fp, codec, data, rk, rv = _setup()
    kv = FakeKVPool(fp.layout, 64, getattr(torch, fp.layout.dtype))
    slots = torch.randperm(64)[: 3 * C]
    counter = attach_installs(kv, kv.writer, fp, RemoteKVMetrics())
    with DecoderPool(instances=2) as pool:
        be = NvdecFetchBackend(DictClient(data), pool, codec, fp, C, kv.writer)
        h = be.submit("lw", [b"key0", b"key1", b"key2"], 0, slots)
        assert h.verified.wait(60) and h.direct
        counter.add(h, slots, codec)
        kv.get_key_buffer(fp.layout.num_layers - 1)  # waits layer by layer for the decoder's writes
        assert h.wait(60)
        be.close()
    counter.finish_all()
    k, v = kv.writer.read(slots)
    assert np.array_equal(k, rk) and np.array_equal(v, rv)
