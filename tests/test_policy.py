"""The bandwidth-aware fetch-vs-recompute policy (pure Python, no server)."""

from __future__ import annotations

import pytest

from sgl_remote_kv.policy.estimator import Ewma, Policy, PolicyConfig, PrefillModel

MB = 1 << 20


def test_ewma_first_sample_replaces_initial_then_smooths():
    e = Ewma(0.5, initial=100.0)
    e.update(10.0)
    assert e.value == 10.0
    e.update(20.0)
    assert e.value == 15.0


def test_prefill_model_recovers_quadratic_cost():
    m = PrefillModel()
    for n in (100, 400, 800, 1600, 3200):
        m.observe(n, 2e-3 * n + 1e-7 * n * n)
    assert m.predict(2000) == pytest.approx(2e-3 * 2000 + 1e-7 * 2000**2, rel=1e-6)


def test_prefill_model_never_predicts_free_prefill_from_noise():
    m = PrefillModel()
    m.observe(6, 9.0)  # warm-up: ignored (below min_tokens)
    m.observe(1, 14.0)
    for n, t in ((64, 5.0), (128, 1.0), (1500, 2.0)):  # noisy, even decreasing
        m.observe(n, t)
    assert m.predict(1472) > 0.5


def test_fast_link_fetches_and_slow_link_recomputes():
    p = Policy(PolicyConfig(mode="dpu"), available=("dpu",))
    for n in (256, 512, 1024, 2048):
        p.observe_prefill(n, n / 400.0)  # a CPU-like 400 tok/s prefill
    p.observe_fetch("dpu", nbytes=10 * MB, fetch_s=0.01, decoded_bytes=20 * MB, decode_s=0.02)
    assert p.decide(1024, nbytes=10 * MB, decoded_bytes=20 * MB, queue_depth={}).path == "dpu"

    p.observe_fetch("dpu", nbytes=10 * MB, fetch_s=100.0, decoded_bytes=20 * MB, decode_s=0.02)
    p.observe_fetch("dpu", nbytes=10 * MB, fetch_s=100.0, decoded_bytes=20 * MB, decode_s=0.02)
    d = p.decide(1024, nbytes=10 * MB, decoded_bytes=20 * MB, queue_depth={})
    assert d.path == "recompute" and d.est_fetch_s > d.est_recompute_s


def test_auto_picks_the_faster_decoder_and_counts_queueing():
    p = Policy(PolicyConfig(mode="auto"), available=("dpu", "nvdec"))
    p.observe_fetch("dpu", nbytes=MB, fetch_s=0.001, decoded_bytes=100 * MB, decode_s=1.0)
    p.observe_fetch("nvdec", nbytes=MB, fetch_s=0.001, decoded_bytes=100 * MB, decode_s=0.25)
    assert p.decide(512, MB, 10 * MB, queue_depth={}).path == "nvdec"
    assert p.decide(512, MB, 10 * MB, queue_depth={"nvdec": 8}).path == "dpu"


def test_forced_mode_without_its_decoder_uses_what_exists():
    p = Policy(PolicyConfig(mode="nvdec"), available=("inproc",))
    assert p.decide(512, MB, 10 * MB, queue_depth={}).path == "inproc"


def test_the_measured_device_load_is_part_of_a_fetch_and_a_slow_one_recomputes():
    """``PolicyConfig.load_bps`` (the warm-up's measured load into a device pool) adds ``decoded / rate`` to
    every path's estimate: a fast device decode keeps the fetch, a slow one (a host-rate decode) loses."""
    estimates = {}
    for rate in (0.0, 100e9, 50e6):
        p = Policy(PolicyConfig(mode="dpu", load_bps=rate), available=("dpu",))
        for n in (256, 512, 1024, 2048):
            p.observe_prefill(n, n / 4000.0)
        p.observe_fetch("dpu", nbytes=10 * MB, fetch_s=0.01, decoded_bytes=20 * MB, decode_s=0.0)
        estimates[rate] = p.decide(1024, nbytes=10 * MB, decoded_bytes=20 * MB, queue_depth={})
    assert estimates[100e9].path == "dpu"
    extra = estimates[100e9].est_fetch_s - estimates[0.0].est_fetch_s
    assert extra == pytest.approx(20 * MB / 100e9)
    assert estimates[100e9].est_decode_s - estimates[0.0].est_decode_s == pytest.approx(extra)
    assert estimates[50e6].path == "recompute"  # 0.42 s of load against 0.26 s of prefill
