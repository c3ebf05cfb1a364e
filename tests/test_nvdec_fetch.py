"""NVDEC fetch backend: store -> pool -> staging, layer-group progress, misses and corrupt chunks."""

from __future__ import annotations

import numpy as np
import sgl_remote_kv.nvdec  # noqa: F401
from sgl_remote_kv.nvdec.fetch_nvdec import NvdecFetchBackend
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec
from sgl_remote_kv.nvdec.pool import DecoderPool

from benchmarks import synthetic_kv as synthetic

C = 8


class DictClient:
    def __init__(self, data: dict[bytes, bytes]):
        self.data = data

    def get_many(self, keys):
        return [self.data.get(k) for k in keys]


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


def test_fetch_restores_every_chunk_and_reports_all_layers():
    fp, codec, data, rk, rv = _setup()
    with DecoderPool(instances=2) as pool:
        be = NvdecFetchBackend(DictClient(data), pool, codec, fp, C)
        h = be.submit("r1", [b"key0", b"key1", b"key2"], 0)
        assert h.wait(60)
        be.close()
    assert h.failure is None and h.ok_chunks == 3 and h.layers_ready == 4 and h.layer_ready(3)
    assert np.array_equal(h.k, rk) and np.array_equal(h.v, rv) and be.queue_depth() == 0


def test_fetch_stops_at_first_miss_or_corrupt_chunk():
    fp, codec, data, rk, _ = _setup()
    bad = bytearray(data[b"key1"])
    bad[-5] ^= 1
    data[b"bad"] = bytes(bad)
    with DecoderPool(instances=1) as pool:
        be = NvdecFetchBackend(DictClient(data), pool, codec, fp, C)
        miss = be.submit("r2", [b"key0", b"nope", b"key2"], 0)
        corrupt = be.submit("r3", [b"key0", b"bad", b"key2"], 0)
        assert miss.wait(60) and corrupt.wait(60)
        be.close()
    assert miss.ok_chunks == 1 and miss.failure == "store_miss"
    assert np.array_equal(miss.k[:, :C], rk[:, :C])
    assert corrupt.ok_chunks == 1 and corrupt.failure.startswith("decode:CorruptChunk")
