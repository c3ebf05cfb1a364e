"""The projection model (benchmarks/projection.py): monotonicity, crossovers, the papers' shapes."""

from __future__ import annotations

import json

import pytest

from benchmarks import projection as pj

M = pj.Model()
LINKS = [0.5 * 1.3**k for k in range(30)]


def test_kv_size_llama8b():
    assert M.kv_bytes_per_token == 128 * 1024  # 32 layers x 2 x 8 heads x 128 x 2 B


@pytest.mark.parametrize("path", [p for p in pj.PATHS if p != "recompute"])
@pytest.mark.parametrize("n", [2000, 14000])
def test_fetch_paths_never_slower_on_faster_links(path, n):
    times = [pj.path_ttft(path, n, g, M, pj.HW) for g in LINKS]
    assert all(b <= a + 1e-12 for a, b in zip(times[:-1], times[1:], strict=True))


def test_recompute_ignores_link_and_grows_superlinearly():
    assert pj.path_ttft("recompute", 8000, 1, M, pj.HW) == pj.path_ttft("recompute", 8000, 100, M, pj.HW)
    t1, t2 = pj.prefill_s(8000, M, pj.HW), pj.prefill_s(16000, M, pj.HW)
    assert t2 > 2 * t1


def test_every_path_grows_with_context():
    for p in pj.PATHS:
        assert pj.path_ttft(p, 16000, 10, M, pj.HW) > pj.path_ttft(p, 4000, 10, M, pj.HW)


def test_recompute_wins_on_slow_links_raw_wins_on_fast_links():
    assert pj.best_path(14000, 0.5, M, pj.HW, ("recompute", "raw", "dpu"))[0] == "recompute"
    assert pj.best_path(14000, 400, M, pj.HW)[0] == "raw"


def test_crossover_is_where_the_winner_changes():
    g = pj.crossover_gbps("raw", "recompute", 14000, M, pj.HW)
    assert g is not None
    assert pj.path_ttft("raw", 14000, g * 1.01, M, pj.HW) <= pj.path_ttft("recompute", 14000, g, M, pj.HW)
    assert pj.path_ttft("raw", 14000, g * 0.95, M, pj.HW) > pj.path_ttft("recompute", 14000, g, M, pj.HW)
    # compression lowers the rate at which fetching beats recomputing
    assert pj.crossover_gbps("dpu", "recompute", 14000, M, pj.HW) < g


def test_shadowserve_fig10_shape_with_paper_ratios():
    """DPU beats CacheGen-Async below ~20 Gbps and loses above (the SoC caps its network)."""
    low = pj.path_ttft("inproc", 14000, 10, M, pj.HW) / pj.path_ttft("dpu", 14000, 10, M, pj.HW)
    high = pj.path_ttft("inproc", 14000, 40, M, pj.HW) / pj.path_ttft("dpu", 14000, 40, M, pj.HW)
    assert low > 1.0 > high
    assert 15 < pj.crossover_gbps("inproc", "dpu", 14000, M, pj.HW) < 40


def test_kvfetcher_gain_shrinks_with_bandwidth():
    """Fig. 21: the NVDEC path's gain over CacheGen diminishes as bandwidth grows."""
    gains = [
        pj.path_ttft("inproc", 14000, g, M, pj.HW) / pj.path_ttft("nvdec", 14000, g, M, pj.HW)
        for g in (1, 5, 10, 40)
    ]
    assert gains[0] > 1.5
    assert all(b <= a for a, b in zip(gains[:-1], gains[1:], strict=True))


def test_more_nvdecs_help_at_high_bandwidth():
    from dataclasses import replace

    a100x2 = replace(pj.HW, nvdec_per_gpu=10)
    assert pj.path_ttft("nvdec", 14000, 40, M, a100x2) < pj.path_ttft("nvdec", 14000, 40, M, pj.HW)


def test_main_writes_json_and_png(tmp_path):
    pj.main(["--contexts", "2000", "--links", "1", "40", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "projection.json").read_text())
    assert set(data["scenarios"]) == {"our measured codec ratios", "papers' ratios"}
    rows = data["scenarios"]["papers' ratios"]["rows"]
    assert {r["best"] for r in rows} <= set(pj.PATHS)
    assert (tmp_path / "projection.png").stat().st_size > 1000
