"""The policy under a changing link: in-flight fetches feed the estimate, losing fetches are abandoned
(byte-scaled hang guard), stale estimates are re-probed, forced modes still recompute; plus the
``--remote-kv inproc`` baseline mode. Pure Python with an injected clock, no server."""

from __future__ import annotations

import argparse
import threading

import pytest

from sgl_remote_kv import runtime
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch import paths
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint, PathName

MB = 1 << 20
T0 = 1000.0
OPT = {"dpu": (1000, 10 * MB, 20 * MB)}  # 1000 tokens, 10 MB on the wire, 20 MB decoded
FP = ModelFingerprint(
    "TestArch", KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32"), "w" * 64
)


def _policy(mode: str = "dpu", available=("dpu",), **cfg) -> Policy:
    pol = Policy(PolicyConfig(mode=mode, **cfg), available=available)
    pol.last_link_sample = pol.last_probe = T0
    for n in (250, 500, 1000):
        pol.observe_prefill(n, n / 250.0)  # 250 tok/s: 1000 tokens recompute in 4 s
    return pol


def _learn_fast_link(pol: Policy, now: float = T0) -> None:
    for _ in range(3):  # 100 MB/s link, 1 GB/s decode: the 1000-token fetch costs ~0.12 s
        pol.observe_fetch("dpu", 10 * MB, 0.1, 20 * MB, 0.02, now=now)


def test_running_slow_fetch_turns_the_next_decision_to_recompute():
    pol = _policy()
    _learn_fast_link(pol)
    d = pol.decide_among(OPT, {}, now=T0)
    assert d.path == "dpu" and d.est_fetch_s < 0.5
    pol.fetch_started("r1", d, 10 * MB, now=T0)
    # 0.3 s later the fetch is a little late: not yet evidence that fetching loses
    assert pol.decide_among(OPT, {}, now=T0 + 0.3).path == "dpu"
    # 5 s later it is still running (the link dropped to < 2 MB/s): the EWMA alone still says
    # 100 MB/s, but the in-flight bound makes the next request recompute before r1 ends
    assert pol.link_spb.value < 1e-7
    late = pol.decide_among(OPT, {}, now=T0 + 5.0)
    assert late.path == "recompute" and late.est_fetch_s > late.est_recompute_s
    pol.fetch_ended("r1", now=T0 + 5.0)  # gone: the bound goes with it
    assert pol.decide_among(OPT, {}, now=T0 + 5.0).path == "dpu"


def test_reported_transfer_time_replaces_the_elapsed_bound():
    pol = _policy()
    _learn_fast_link(pol)
    d = pol.decide_among(OPT, {}, now=T0)
    pol.fetch_started("r1", d, 10 * MB, now=T0)
    # transfer finished in 0.1 s (fast link); the rest of the 5 s is decode/queueing, not the link
    assert pol.check("r1", received=10 * MB, link_s=0.1, now=T0 + 5.0) is None
    assert pol.inflight.spb_bound(T0 + 5.0) == pytest.approx(0.1 / (10 * MB))
    # the same fetch reported 10 MB in 8 s: a slow link
    pol.check("r1", received=10 * MB, link_s=8.0, now=T0 + 8.5)
    assert pol.decide_among(OPT, {}, now=T0 + 8.5).path == "recompute"


def test_losing_fetch_is_abandoned_and_the_loss_is_learned():
    pol = _policy()
    _learn_fast_link(pol)
    opt = {"dpu": (2000, 10 * MB, 20 * MB)}  # recompute estimate 8 s
    d = pol.decide_among(opt, {}, now=T0)
    pol.fetch_started("r1", d, 10 * MB, now=T0)
    abandon, timeout = pol.inflight.deadlines(pol.inflight.items["r1"])
    assert abandon == pytest.approx(1.5 * 8.0, rel=0.05)  # factor x margin x recompute estimate
    assert timeout > abandon
    assert pol.check("r1", now=T0 + abandon - 0.1) is None
    assert pol.check("r1", now=T0 + abandon + 0.1) == "abandoned"
    before = pol.link_spb.value
    pol.fetch_ended("r1", censored=True, now=T0 + abandon + 0.1)
    assert pol.link_spb.value > 10 * before and not pol.inflight.items
    assert pol.decide_among(opt, {}, now=T0 + 13).path == "recompute"


def test_abandon_floor_protects_fetches_of_tiny_prefixes():
    pol = _policy()
    d = pol.decide_among({"dpu": (40, MB // 100, MB // 50)}, {}, now=T0)  # recompute ~0.16 s
    assert d.path == "dpu"
    pol.fetch_started("r1", d, MB // 100, now=T0)
    assert pol.check("r1", now=T0 + 7.9) is None  # jitter / a data-plane hang the DPU client detects
    assert pol.check("r1", now=T0 + 8.1) == "abandoned"


def test_slow_link_fetch_that_still_wins_is_not_killed_but_a_hang_is():
    # A slow link (~1.3 MB/s) where recompute is slower still: the fetch wins and must run to its end.
    pol = _policy(margin=1.0)
    for _ in range(3):
        pol.observe_fetch("dpu", 2 * MB, 1.5, 20 * MB, 0.02, now=T0)
    opt = {"dpu": (4000, 2 * MB, 20 * MB)}  # recompute of 4000 tokens ~16 s; fetch ~1.6 s
    d = pol.decide_among(opt, {}, now=T0)
    assert d.path == "dpu"
    pol.fetch_started("r1", d, 2 * MB, now=T0)
    assert pol.check("r1", now=T0 + 12.0) is None  # 7x slower than estimated and still winning
    # Forcing fetches (margin 1e9): only the byte-scaled hang guard applies: floor + bytes / 2 Mbit/s
    forced = _policy(margin=1e9)
    forced.fetch_started("r2", d, 2 * MB, now=T0)
    guard = 10.0 + 2 * MB / 250e3
    assert forced.check("r2", now=T0 + guard - 0.5) is None
    assert forced.check("r2", now=T0 + guard + 0.5) == "fetch_timeout"
    capped = _policy(margin=1e9, timeout_cap_s=30.0)
    capped.fetch_started("r3", d, 100 * MB, now=T0)  # guard would be ~430 s
    assert capped.check("r3", now=T0 + 29) is None and capped.check("r3", now=T0 + 31) == "fetch_timeout"


def test_recompute_verdict_is_reprobed_once_per_interval_and_recovery_is_learned():
    pol = _policy(probe_interval_s=30.0)
    for _ in range(3):  # a 0.1 MB/s link: fetching 10 MB takes 100 s vs 4 s recompute
        pol.observe_fetch("dpu", 10 * MB, 100.0, 20 * MB, 0.02, now=T0)
    assert pol.decide_among(OPT, {}, now=T0 + 10).path == "recompute"
    d = pol.decide_among(OPT, {}, now=T0 + 31)
    assert d.path == "dpu" and d.probe and pol.probes == 1
    assert pol.decide_among(OPT, {}, now=T0 + 31.2).path == "recompute"  # one probe per interval
    # the probe finds a recovered link: its sample (0.5 s after the probe started) replaces the stale
    # estimate at once instead of being averaged with it
    pol.observe_fetch("dpu", 10 * MB, 0.1, 20 * MB, 0.02, now=T0 + 31.5)
    assert pol.link_spb.value == pytest.approx(0.1 / (10 * MB))
    again = pol.decide_among(OPT, {}, now=T0 + 32)
    assert again.path == "dpu" and not again.probe


def test_no_probe_while_a_fetch_is_in_flight_and_a_failed_probe_keeps_recomputing():
    pol = _policy(probe_interval_s=30.0)
    for _ in range(3):
        pol.observe_fetch("dpu", 10 * MB, 100.0, 20 * MB, 0.02, now=T0)
    probe = pol.decide_among(OPT, {}, now=T0 + 31)
    assert probe.probe
    pol.fetch_started("p", probe, 10 * MB, now=T0 + 31)
    assert pol.decide_among(OPT, {}, now=T0 + 70).path == "recompute"  # probe still running
    assert pol.check("p", now=T0 + 31 + 10.5) == "abandoned"  # link still slow
    pol.fetch_ended("p", censored=True, now=T0 + 41.5)
    assert pol.decide_among(OPT, {}, now=T0 + 50).path == "recompute"
    assert pol.decide_among(OPT, {}, now=T0 + 72).probe  # next interval: probe again


@pytest.mark.parametrize("mode", ["dpu", "nvdec", "inproc"])
def test_forced_modes_still_recompute_when_fetching_cannot_win(mode):
    pol = _policy(mode=mode, available=("dpu", "nvdec", "inproc"), probe_interval_s=1e9)
    opts = {p: OPT["dpu"] for p in ("dpu", "nvdec", "inproc")}
    assert pol.decide_among(opts, {}, now=T0).path == mode  # optimistic prior: fetch on the mode's path
    pol.observe_fetch(mode, 10 * MB, 100.0, 20 * MB, 0.02, now=T0)
    assert pol.decide_among(opts, {}, now=T0 + 1).path == "recompute"
    assert pol.decide(1000, 10 * MB, 20 * MB, {}, now=T0 + 1).path == "recompute"


def test_inproc_mode_parses_and_installs_only_the_in_process_path(tmp_path):
    p = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(p)
    ns = p.parse_args(["--remote-kv", "inproc", "--remote-kv-store", f"file://{tmp_path / 's'}"])
    cfg = RemoteKVConfig._from_namespace(ns)
    assert cfg.mode == "inproc" and RemoteKVConfig.from_json(cfg.to_json()) == cfg
    client = open_client(cfg.resolved_store_url())
    wake = threading.Event()
    parts = paths.PathParts(cfg, FP, paths.write_codec(cfg), client, None, wake)
    rt = runtime.build(cfg, FP, parts.codec, client, paths.build_paths(parts), wake)  # no data plane started
    try:
        assert list(rt.paths) == [PathName.INPROC] and rt.primary.name is PathName.INPROC
        assert (
            paths.write_codec(cfg).name
            == paths.write_codec(RemoteKVConfig(mode="dpu", store_url="file:///x")).name
        )
        assert rt.policy.decide_among({"inproc": OPT["dpu"]}, {}).path == "inproc"
    finally:
        rt.close()


def test_wire_bytes_follow_the_learned_compression_ratio():
    pol = _policy()
    assert pol.wire_bytes("dpu", 20 * MB, 0.5) == 10 * MB  # the caller's guess before any fetch
    pol.observe_fetch("dpu", 8 * MB, 0.1, 20 * MB, 0.0, now=T0)  # 2.5x compression measured
    assert pol.wire_bytes("dpu", 20 * MB, 0.5) == 8 * MB
    assert pol.wire_bytes("inproc", 20 * MB, 1.0) == 20 * MB  # per path


def test_pipelined_path_is_not_charged_its_decode_twice():
    # The DPU reports one job time (fetch + decode + scatter pipelined) and no separate decode time:
    # at 1 s per 10 MB job vs 1.2 s recompute it must fetch (the 200 MB/s decode prior would have
    # added 0.1 s x (1 + queue depth) on top and made it recompute at depth 2).
    pol = _policy()
    pol.observe_prefill(300, 1.2)  # 250 tok/s
    pol.observe_fetch("dpu", 10 * MB, 1.0, 20 * MB, 0.0, now=T0)
    assert pol.decode_spb["dpu"].value == 0.0
    assert pol.decide_among({"dpu": (300, 10 * MB, 20 * MB)}, {"dpu": 2}, now=T0).path == "dpu"
    pol.observe_fetch("dpu", 10 * MB, 0.0, 0, 0.0, now=T0)  # nothing fetched, nothing learned
    assert pol.decode_spb["dpu"].samples == 1
