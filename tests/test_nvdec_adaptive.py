"""Adaptive resolution (Alg. 1) on synthetic tables; profile store/refresh; a real (tiny) profile."""

from __future__ import annotations

import pytest
import sgl_remote_kv.nvdec  # noqa: F401
from sgl_remote_kv.nvdec.pool import DecoderPool

from benchmarks import nvdec_adaptive as ad
from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec

# resolution (tokens/frame) -> bytes: small frames compress better but decode slower (the paper's shape)
TABLE = ad.ProfileTable(
    resolutions=(16, 64, 256),
    loads=(1, 2),
    latency=((0.30, 0.36), (0.20, 0.24), (0.15, 0.18)),
    penalty=(0.05, 0.03, 0.0),
    size_bytes=(800, 1000, 1200),
    instances=2,
    key="t",
)
SIZES = {16: 800_000, 64: 1_000_000, 256: 1_200_000}


def test_fast_link_picks_fastest_decode():
    c = ad.choose(SIZES, bandwidth=1e9, table=TABLE, load=1)
    assert c.resolution == 256 and c.trans_s == pytest.approx(1.2e-3)


def test_slow_link_picks_smallest_video():
    assert ad.choose(SIZES, bandwidth=1e6, table=TABLE, load=1).resolution == 16


def test_bubble_objective_balances_transmission_and_decoding():
    # at 5 MB/s: trans = 0.16 / 0.20 / 0.24 s; decode = 0.30 / 0.20 / 0.15 s -> 64 tokens/frame balances
    c = ad.choose(SIZES, bandwidth=5e6, table=TABLE, load=1, objective="bubble")
    assert c.resolution == 64 and c.bubble_s == pytest.approx(0.0, abs=1e-9)


def test_paper_objective_grows_chunks_on_a_slow_link_stage_does_not():
    # link-bound: the paper's |trans - dec| prefers the resolution whose decode is slow enough to "match"
    table = ad.ProfileTable((16, 256), (1,), ((0.01,), (2.0,)), (0.0, 0.0), (1, 2), 1)
    sizes = {16: 10_000_000, 256: 11_000_000}
    assert ad.choose(sizes, 1e6, table, 1, objective="bubble").resolution == 256
    assert ad.choose(sizes, 1e6, table, 1, objective="stage").resolution == 16


def test_switching_penalty_and_load():
    # without the penalty 16 wins at this bandwidth; the 0.05 s switch cost keeps the active 64
    sizes = {16: 900_000, 64: 1_000_000}
    assert ad.choose(sizes, 3e6, TABLE, load=1, active=16).resolution == 16
    table = ad.ProfileTable((16, 64), (1,), ((0.30,), (0.31,)), (0.05, 0.0), (1, 1), 1)
    assert ad.choose(sizes, 3e6, table, load=1, active=64).resolution == 64
    assert ad.choose(sizes, 3e6, table, load=1, active=16).resolution == 16
    assert TABLE.lookup(64, 9) == (0.24, 0.03)  # load clamped to the profiled range


def test_bandwidth_estimator():
    est = ad.BandwidthEstimator(1e6)
    assert est.update(2_000_000, 1.0) == 2e6
    ew = ad.BandwidthEstimator(1e6, alpha=0.5)
    assert ew.update(3_000_000, 1.0) == 2e6


def test_table_store_and_refresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path))
    built = []

    def build():
        built.append(1)
        return TABLE

    key = ad.table_key({"a": 1}, "cpu", 2)
    t1 = ad.load_or_profile(key, build)
    t2 = ad.load_or_profile(key, build)
    assert t1 == t2 and t1.key == key and t1.latency == TABLE.latency and len(built) == 1
    assert ad.default_path(key).is_relative_to(tmp_path) and ad.default_path(key).exists()
    ad.load_or_profile(key, build, refresh=True)
    assert len(built) == 2
    ad.default_path(key).write_text("{not json")
    assert ad.load_or_profile(key, build) == t1 and len(built) == 3


def test_profile_with_the_real_pool():
    fp = synthetic.fingerprint(num_layers=3)
    k, v = synthetic.kv(fp.layout, 16, seed=1)
    blobs = {n: [get_codec("hevc", tokens_per_frame=n, min_side=16).encode(k, v, fp)] for n in (4, 16)}
    with DecoderPool(instances=2) as pool:
        table = ad.profile(pool, fp, blobs, lambda: lambda fc: None, repeats=1, key="x")
    assert table.resolutions == (4, 16) and table.loads == (1, 2)
    assert all(x > 0 for row in table.latency for x in row) and min(table.penalty) >= 0
    assert table.size_bytes == tuple(len(blobs[n][0]) for n in (4, 16))
    assert ad.ProfileTable.from_json(table.to_json()) == table
    assert ad.choose({4: 100, 16: 100}, 1e9, table, 1).resolution in (4, 16)


def test_simulated_link_integrates_the_bandwidth_trace():
    from benchmarks.nvdec_sim import transmit_time

    trace = [(0.0, 100.0), (2.0, 10.0)]
    assert transmit_time(50, 0.0, trace) == pytest.approx(0.5)
    # 100 B in the first second at 100 B/s, then 50 B at 10 B/s
    assert transmit_time(150, 1.0, trace) == pytest.approx(1.0 + 5.0)
    assert transmit_time(20, 3.0, trace) == pytest.approx(2.0)
