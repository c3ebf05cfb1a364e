"""Adaptive resolution on the serving path (issue 37): Alg. 1's choice on synthetic profiles, version keys,
the write side's versions (bit-identical KV at every resolution), the NVDEC fetcher picking, falling back
and missing, the profile measured on the real pool and cached, the policy using the same estimate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401
from sgl_remote_kv.nvdec import adapter as ad
from sgl_remote_kv.nvdec import profile as prof
from sgl_remote_kv.nvdec.hevc_codec import HevcCodec
from sgl_remote_kv.nvdec.pool import ChunkResult, DecoderPool
from sgl_remote_kv.nvdec.versions import ChunkVersions, version_codec

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.errors import ForeignChunk
from sgl_remote_kv.fetch.nvdec import NvdecFetchBackend, decoder_wait_s
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from tests.test_nvdec_fetch import DictClient, _pool

C = 64
RES = (ad.FULL, 16, 32)  # tokens per frame (64-token chunks, as the server tests)
# full decodes fastest and is largest; 16 is smallest and slowest (the paper's shape)
TABLE = ad.ProfileTable(
    resolutions=RES,
    loads=(1, 2),
    latency=((0.10, 0.12), (0.30, 0.36), (0.20, 0.24)),
    penalty=(0.0, 0.05, 0.03),
    size_bytes=(1_200_000, 800_000, 1_000_000),
    instances=2,
    key="t",
)


# ---- Alg. 1 on synthetic profiles -------------------------------------------------------------------


def test_adapter_picks_fast_decode_on_a_fast_link_and_small_videos_on_a_slow_one():
    a = ad.ResolutionAdapter(TABLE, initial_bps=1e9)
    assert a.ranking(1)[0].resolution == ad.FULL  # decode-bound: the fastest decode
    a.observe_transfer(ad.FULL, 1_200_000, 1.2)  # the last chunk came at 1 MB/s: link-bound
    assert a.bandwidth == pytest.approx(1e6)
    ranked = [c.resolution for c in a.ranking(1)]
    assert ranked[0] == 16 and sorted(ranked) == sorted(RES)  # every version stays a fallback
    a.observe_transfer(16, 800_000, 0.0008)  # the link recovered (the paper: the last chunk's rate)
    assert a.ranking(1)[0].resolution == ad.FULL


def test_fixed_resolution_is_tried_first_and_the_rest_stay_fallbacks():
    a = ad.ResolutionAdapter(TABLE, fixed=32, initial_bps=1e9)
    assert [c.resolution for c in a.ranking(1)][0] == 32 and len(a.ranking(1)) == 3
    with pytest.raises(ValueError):
        ad.ResolutionAdapter(TABLE, fixed=64)


def test_live_decodes_correct_the_profile():
    a = ad.ResolutionAdapter(TABLE, initial_bps=1e9)
    for _ in range(10):  # full decodes 10x slower here than profiled
        a.observe_decode(ad.FULL, 1, 1.0)
    assert a.ranking(1)[0].resolution == 32


def test_switch_penalty_keeps_the_active_resolution():
    sizes = {16: 900_000, 32: 1_000_000}
    table = ad.ProfileTable((16, 32), (1,), ((0.30,), (0.31,)), (0.05, 0.0), (1, 1), 1)
    assert ad.choose(sizes, 3e6, table, load=1, active=32).resolution == 32
    assert ad.choose(sizes, 3e6, table, load=1, active=16).resolution == 16


def test_policy_estimate_pipelines_transfer_and_decode():
    a = ad.ResolutionAdapter(TABLE, chunk_bytes=1000)
    fast, fast_dec = a.estimate(0, 4000, 0, 1e-12)  # 4 chunks, link ~free: decode-bound at full
    assert fast == pytest.approx(0.12 + 3 * 0.12 / 2, rel=1e-4) and fast_dec == pytest.approx(fast, rel=1e-3)
    slow, _ = a.estimate(0, 4000, 0, 1e-6)  # 1 MB/s: link-bound, at the smallest version (0.8 s/chunk)
    assert slow == pytest.approx(4 * 0.8 + 0.36 * (1.0), rel=0.05)
    assert a.estimate(0, 4000, 2, 1e-12)[0] > fast  # fetches queued ahead slow the decode
    p = Policy(PolicyConfig(mode="nvdec"), available=("nvdec",), estimators={"nvdec": a.estimate})
    p.prefill.observe(1000, 100.0)
    d = p.decide(1000, 123, 4000, {"nvdec": 0})
    assert d.path == "nvdec" and d.est_fetch_s == pytest.approx(a.estimate(123, 4000, 0, p.link_spb.value)[0])


def test_resolution_labels_and_parsing():
    assert ad.parse_resolution("full") == ad.FULL and ad.parse_resolution("64") == 64
    assert ad.label(ad.FULL) == "full" and set(map(ad.label, ad.POWERS)) < set(ad.LABELS)
    with pytest.raises(ValueError):
        ad.parse_resolution("48")
    assert ad.check_resolutions([64, 16], 256) == (0, 16, 64)
    with pytest.raises(ValueError):
        ad.check_resolutions([256], 256)


def test_version_keys_name_the_resolution():
    k = bytes(range(32))
    keys = {r: ad.version_key(k, r) for r in (ad.FULL, 16, 32, 64)}
    assert keys[ad.FULL] == k and len(set(keys.values())) == 4 and all(len(x) == 32 for x in keys.values())
    assert ad.version_key(k, 16) == keys[16] and ad.version_key(bytes(32), 16) != keys[16]


def test_decoder_wait_counts_time_no_chunk_was_decoding():
    r = [ChunkResult(0, 1, 1, 1, 0.0, 1.0, 1.0), ChunkResult(1, 1, 1, 1, 0.0, 1.0, 1.0)]
    assert decoder_wait_s([0.0, 1.5], r) == pytest.approx(0.5)  # idle from 1.0 until the second arrived
    assert decoder_wait_s([0.0, 0.5], r) == pytest.approx(0.0)


# ---- versions: write side, lossless across resolutions ----------------------------------------------


def _chunks(n: int, layers: int = 4):
    fp = synthetic.fingerprint(num_layers=layers)
    k, v = synthetic.kv(fp.layout, n * C, seed=11)
    return fp, [
        (np.ascontiguousarray(k[:, i * C : (i + 1) * C]), np.ascontiguousarray(v[:, i * C : (i + 1) * C]))
        for i in range(n)
    ]


def _store(fp, chunks, resolutions=RES):
    """A dict store holding every chunk at every resolution, as the write-back leaves it."""
    anchor = HevcCodec(min_side=16)
    written: list[tuple[int, str]] = []
    versions = ChunkVersions(anchor, resolutions, fp, C, lambda n, lab: written.append((n, lab)))
    data, keys = {}, []
    for i, (k, v) in enumerate(chunks):
        key = bytes([i]) * 32
        keys.append(key)
        blob = anchor.encode(k, v, fp)
        extra = versions.encode(key, k, v)
        versions.written(extra, [blob])
        data[key] = blob
        data.update({vk: b for vk, b, _ in extra})
    return anchor, data, keys, written


def test_every_version_decodes_to_the_same_kv_and_its_size_is_reported():
    fp, chunks = _chunks(1)
    anchor, data, keys, written = _store(fp, chunks)
    assert sorted(lab for _, lab in written) == ["16", "32", "full"] and all(n > 0 for n, _ in written)
    ref = anchor.decode(data[keys[0]], fp)
    for r in (16, 32):
        blob = data[ad.version_key(keys[0], r)]
        got = version_codec(anchor, r).decode(blob, fp)
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))
        # the anchor codec decodes a version too (the layer-wise in-process fallback does)
        hdr = version_codec(anchor, r).parse(blob, fp)
        k = np.empty_like(ref[0][0])
        v = np.empty_like(ref[1][0])
        anchor.decode_layer_into(blob, hdr, 1, np.empty(anchor.scratch_bytes(hdr, 1), np.uint8), k, v)
        assert np.array_equal(k, ref[0][1]) and np.array_equal(v, ref[1][1])
    other = HevcCodec(min_side=16, k_bins="16")  # another quantization is never decoded as ours
    hdr = version_codec(anchor, 16).parse(data[ad.version_key(keys[0], 16)], fp)
    with pytest.raises(ForeignChunk):
        other.decode_layer_into(data[ad.version_key(keys[0], 16)], hdr, 0, np.empty(1 << 20, np.uint8), k, v)
    assert ChunkVersions(anchor, RES, fp, C).encode(keys[0], chunks[0][0][:, :32], chunks[0][1][:, :32]) == []


# ---- the fetcher ---------------------------------------------------------------------------------------


class CountingClient(DictClient):
    def __init__(self, data):
        super().__init__(data)
        self.gets: list[bytes] = []

    def get_many(self, keys):
        self.gets += list(keys)
        return super().get_many(keys)


def _fetch(fp, anchor, data, keys, adapter, instances=2):
    writer, slots = _pool(fp, slots=len(keys) * C)
    client, metrics = CountingClient(data), RemoteKVMetrics()
    with DecoderPool(instances=instances) as pool:
        be = NvdecFetchBackend(client, pool, anchor, fp, C, writer, adapter=adapter, metrics=metrics)
        h = be.submit("r", keys, 0, slots)
        assert h.wait(120)
        be.close()
    k, v = writer.read(slots[: h.ok_chunks * C])
    return h, client, metrics.snapshot(), k, v


def _reference(fp, anchor, data, keys):
    parts = [anchor.decode(data[k], fp) for k in keys]
    return np.concatenate([p[0] for p in parts], 1), np.concatenate([p[1] for p in parts], 1)


def test_adaptive_fetch_picks_per_chunk_and_writes_the_same_kv():
    fp, chunks = _chunks(3)
    anchor, data, keys, _ = _store(fp, chunks)
    rk, rv = _reference(fp, anchor, data, keys)
    a = ad.ResolutionAdapter(TABLE, initial_bps=1e9)
    h, client, m, k, v = _fetch(fp, anchor, data, keys, a)
    assert h.failure is None and h.ok_chunks == 3 and h.layers_ready == fp.layout.num_layers
    assert np.array_equal(k, rk) and np.array_equal(v, rv)
    assert len(h.resolutions) == 3 and len(client.gets) == 3  # one GET per chunk, no fallback needed
    assert sum(v for key, v in m.items() if key.startswith("nvdec_chunks|")) == 3
    assert h.fetched_bytes == sum(v for key, v in m.items() if key.startswith("nvdec_bytes|"))
    assert h.fetch_s > 0 and len(h.bubbles) == 2 and min(h.bubbles) >= 0
    # a link that is slow for the smallest version: later chunks move to it (the paper's Fig. 17)
    slow = ad.ResolutionAdapter(TABLE, initial_bps=1e3)
    h2, _, m2, k2, _ = _fetch(fp, anchor, data, keys, slow)
    assert h2.resolutions[0] == 16 and np.array_equal(k2, rk) and m2.get("nvdec_chunks|resolution=16") >= 1


def test_a_missing_version_falls_back_to_another_resolution():
    fp, chunks = _chunks(2)
    anchor, data, keys, _ = _store(fp, chunks)
    rk, rv = _reference(fp, anchor, data, keys)
    del data[ad.version_key(keys[1], 32)]
    a = ad.ResolutionAdapter(TABLE, fixed=32)
    h, client, m, k, v = _fetch(fp, anchor, data, keys, a)
    assert h.failure is None and h.resolutions[0] == 32 and h.resolutions[1] != 32
    assert m["nvdec_fallbacks|resolution=32"] == 1 and len(client.gets) == 3
    assert np.array_equal(k, rk) and np.array_equal(v, rv)


def test_no_version_of_a_chunk_is_a_miss_from_there():
    fp, chunks = _chunks(2)
    anchor, data, keys, _ = _store(fp, chunks)
    rk, _ = _reference(fp, anchor, data, keys)
    for r in RES:
        del data[ad.version_key(keys[1], r)]
    h, client, m, k, _ = _fetch(fp, anchor, data, keys, ad.ResolutionAdapter(TABLE))
    assert h.ok_chunks == 1 and h.failure == "store_miss" and len(client.gets) == 1 + 3
    assert (
        np.array_equal(k, rk[:, :C])
        and m.get("nvdec_chunks|resolution=full", 0)
        + m.get("nvdec_chunks|resolution=16", 0)
        + m.get("nvdec_chunks|resolution=32", 0)
        == 1
    )


@pytest.mark.parametrize("damage", ["corrupt", "foreign"])
def test_a_corrupt_or_foreign_version_is_a_miss_never_a_fallback(damage):
    fp, chunks = _chunks(2)
    anchor, data, keys, _ = _store(fp, chunks)
    vk = ad.version_key(keys[1], 32)
    if damage == "corrupt":
        bad = bytearray(data[vk])
        bad[-5] ^= 1  # the blob CRC catches it
        data[vk] = bytes(bad)
    else:  # another resolution's (valid) blob under this version's key
        data[vk] = data[ad.version_key(keys[1], 16)]
    client_fixed = ad.ResolutionAdapter(TABLE, fixed=32)
    h, client, _, _, _ = _fetch(fp, anchor, data, keys, client_fixed)
    assert h.ok_chunks == 1 and h.failure.startswith("decode:")
    assert client.gets[-1] == vk  # no other resolution was tried for the damaged chunk
    assert client.corrupt == ([vk] if damage == "corrupt" else [])


# ---- the profile: measured on the real pool, cached per decoder and device ---------------------------


def test_serving_profile_is_measured_on_the_pool_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path))
    fp = synthetic.fingerprint(num_layers=5)
    anchor = HevcCodec(min_side=16)
    calls = []
    real = prof.profile

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prof, "profile", counting)
    with DecoderPool(instances=2) as pool:
        t1 = prof.serving_table(pool, anchor, (0, 16), fp, C, samples=1, repeats=1)
        t2 = prof.serving_table(pool, anchor, (0, 16), fp, C, samples=1, repeats=1)
        t3 = prof.serving_table(pool, anchor, (0, 16), fp, C, samples=1, repeats=1, device="cpu:other")
    assert len(calls) == 2 and t1 == t2 and t3.key != t1.key  # cached per key; another device profiles
    assert t1.resolutions == (0, 16) and t1.loads == (1, 2) and t1.instances == 2
    assert all(x > 0 for row in t1.latency for x in row) and min(t1.penalty) >= 0
    path = prof.default_path(t1.key)
    assert path.is_relative_to(tmp_path) and ad.ProfileTable.from_json(path.read_text()) == t1
    saved = json.loads(path.read_text())
    assert saved["size_bytes"][0] > 0
    broken = {"resolutions": [0], "loads": [1], "latency": [[-1]], "penalty": [0], "size_bytes": [1]}
    path.write_text(json.dumps({**broken, "instances": 1, "key": t1.key}))
    with DecoderPool(instances=1) as pool:  # a hostile/broken cache file is re-measured, not trusted
        t4 = prof.serving_table(pool, anchor, (0, 16), fp, C, samples=1, repeats=1, device="x")
    assert t4.key != t1.key and len(calls) == 3


def test_writeback_stores_every_version_under_its_key(tmp_path):
    """The write-back path (``WriteBack`` with ``ChunkVersions``) on a real store: anchor + versions, each
    decoding to the pool's KV; the bytes of every version counted per resolution."""
    import types

    import torch

    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from sgl_remote_kv.runtime import KeySpace
    from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
    from sgl_remote_kv.store.client import open_client
    from sgl_remote_kv.writeback.worker import WriteBack

    fp = synthetic.fingerprint(num_layers=4, dtype="float32")
    lay = fp.layout
    pool = [torch.randn(256, lay.num_kv_heads, lay.head_dim) for _ in range(2 * lay.num_layers)]
    writer = writer_for(PoolTensors(pool[: lay.num_layers], pool[lay.num_layers :]), lay)
    n_tok = 2 * C + 5
    slots = torch.randperm(256)[:n_tok]
    request = types.SimpleNamespace(
        rid="r",
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=list(range(n_tok)),
    )
    anchor, metrics = HevcCodec(min_side=16), RemoteKVMetrics()
    keys, client = KeySpace(fp, anchor, C), open_client(f"file://{tmp_path}/s")
    versions = ChunkVersions(anchor, RES, fp, C, metrics.nvdec_written)
    r2t = types.SimpleNamespace(req_to_token=slots[None, :].clone())
    wb = WriteBack(
        anchor, fp, client, keys, metrics, writer, WriteBackRequests(r2t), 1 << 30, versions=versions
    )
    wb.offer(request, n_tok, final=True)
    assert wb.flush(120)
    wb.close()
    full = keys.keys_for(request.full_untruncated_fill_ids, 2, None)
    m = metrics.snapshot()
    for r in RES:
        blobs = client.get_many([ad.version_key(k, r) for k in full])
        assert m[f"nvdec_written_chunks|resolution={ad.label(r)}"] == 2
        assert m[f"nvdec_written_bytes|resolution={ad.label(r)}"] == sum(map(len, blobs))
        for i, blob in enumerate(blobs):
            k, v = version_codec(anchor, r).decode(blob, fp)
            ref = anchor.decode(client.get_many([full[i]])[0], fp)
            assert np.array_equal(k, ref[0]) and np.array_equal(v, ref[1])
    assert m["written_chunks"] == 2 and m["written_bytes"] == sum(
        m[f"nvdec_written_bytes|resolution={ad.label(r)}"] for r in RES
    )
