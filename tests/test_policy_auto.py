"""``--remote-kv auto``/``nvdec`` wiring without a server: the policy's choice among paths, the waiting
queue's decision step (path + chunk count + metrics), and codec-separated namespaces."""

from __future__ import annotations

import dataclasses

import pytest

from sgl_remote_kv.admission import Phase, WaitingForKV
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch import paths
from sgl_remote_kv.fetch.base import FetchPath
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.runtime import KeySpace
from sgl_remote_kv.types import KVLayout, ModelFingerprint, PathName
from tests.admission_fakes import C, make_queue, req

MB = 1 << 20
FP = ModelFingerprint(
    "TestArch", KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32"), "w" * 64
)


def _auto(**cfg) -> Policy:
    pol = Policy(PolicyConfig(mode="auto", **cfg), available=("dpu", "nvdec"))
    for _ in range(3):  # a prefill model: 1 ms per token
        pol.observe_prefill(1000, 1.0)
    return pol


def test_auto_picks_the_faster_decoder_from_observed_throughput():
    pol = _auto()
    pol.observe_fetch("dpu", 0, 0.0, 100 * MB, 1.0)  # 100 MB/s
    pol.observe_fetch("nvdec", 0, 0.0, 100 * MB, 0.1)  # 1 GB/s
    assert pol.decide_among({"dpu": (1000, MB, 10 * MB), "nvdec": (1000, MB, 10 * MB)}, {}).path == "nvdec"
    pol.observe_fetch("nvdec", 0, 0.0, 10 * MB, 10.0)  # nvdec got very slow
    pol.observe_fetch("nvdec", 0, 0.0, 10 * MB, 10.0)
    assert pol.decide_among({"dpu": (1000, MB, 10 * MB), "nvdec": (1000, MB, 10 * MB)}, {}).path == "dpu"


def test_auto_queue_depth_and_coverage_shift_the_choice():
    pol = _auto()
    opts = {"dpu": (1000, MB, 10 * MB), "nvdec": (1000, MB, 10 * MB)}
    assert pol.decide_among(opts, {"dpu": 10, "nvdec": 0}).path == "nvdec"
    assert pol.decide_among(opts, {"dpu": 0, "nvdec": 10}).path == "dpu"
    # nvdec has a much longer prefix: more prefill saved wins over equal per-byte cost
    longer = {"dpu": (200, MB // 5, 2 * MB), "nvdec": (1000, MB, 10 * MB)}
    assert pol.decide_among(longer, {}).path == "nvdec"


def test_auto_recomputes_when_no_path_can_win_and_modes_restrict_paths():
    pol = _auto()
    pol.observe_fetch("dpu", 100 * MB, 100.0, 0, 0.0)  # a 1 MB/s link
    d = pol.decide_among({"dpu": (1000, 10 * MB, 10 * MB), "nvdec": (1000, 10 * MB, 10 * MB)}, {})
    assert d.path == "recompute" and d.est_fetch_s > d.est_recompute_s > 0.0
    forced = Policy(PolicyConfig(mode="dpu"), available=("dpu", "nvdec"))
    assert forced.decide_among({"nvdec": (1000, 1, 1)}, {}).path == "recompute"  # nvdec not allowed
    assert forced.decide_among({"dpu": (1000, 1, 1), "nvdec": (1000, 1, 1)}, {}).path == "dpu"
    one = Policy(PolicyConfig(mode="dpu"), available=("dpu",))
    assert one.decide_among({"dpu": (1000, MB, MB)}, {}).path == one.decide(1000, MB, MB, {}).path


def test_write_codec_follows_the_mode_and_namespaces_never_collide():
    base = dict(store_url="file:///x", chunk_size=16)
    quant = paths.write_codec(RemoteKVConfig(mode="dpu", **base))
    hevc = paths.write_codec(RemoteKVConfig(mode="nvdec", **base))
    assert hevc.name == "hevc" != quant.name
    ks = KeySpace(FP, quant, 16)
    ids = list(range(64))
    quant_keys, hevc_keys = ks.keys_for(ids, 3, None), ks.keys_for(ids, 3, None, hevc)
    assert len(set(quant_keys) | set(hevc_keys)) == 6
    assert ks.keys_for(ids, 3, None, hevc) == hevc_keys  # memoised namespace is stable


def test_queue_decision_picks_the_path_with_the_prefix_and_the_shorter_queue():
    """Two paths (DPU: the quantized codec, queue 5 deep; NVDEC: hevc, idle) under ``auto``: a prefix
    stored under both goes to NVDEC; a prefix only the DPU namespace has goes to the DPU; each decision
    is counted under its path."""
    w = make_queue()
    dpu, nvdec = w.be, type(w.be)()
    dpu.queue_depth = lambda: 5
    hevc = get_codec("hevc")
    c = dataclasses.replace(
        w.c,
        paths={PathName.DPU: w.c.paths[PathName.DPU], PathName.NVDEC: FetchPath(PathName.NVDEC, nvdec, hevc)},
        policy=Policy(PolicyConfig(mode="auto"), available=("dpu", "nvdec")),
    )
    q = WaitingForKV(c, w.q.s)
    for _ in range(3):
        c.policy.observe_prefill(1000, 1.0)
    both, dpu_only = req("both", 4 * C + 1, base=0), req("dpu_only", 6 * C + 1, base=5000)
    w.stored(both, 4)
    w.stored(dpu_only, 6)
    w.stored(both, 4, hevc)
    before = c.metrics.snapshot()
    for r in (both, dpu_only):
        assert q.park(r)
        q.parked[r.rid].lookup.result(timeout=10)
    q.poll()
    p_both, p_dpu = q.parked["both"], q.parked["dpu_only"]
    assert (p_both.path, len(p_both.fetch_keys), p_both.phase) == (PathName.NVDEC, 4, Phase.FETCH)
    assert (p_dpu.path, len(p_dpu.fetch_keys), p_dpu.phase) == (PathName.DPU, 6, Phase.FETCH)
    assert "both" in nvdec.handles and "dpu_only" in dpu.handles
    after = c.metrics.snapshot()
    for path in ("nvdec", "dpu"):
        key = f"decisions|path={path}"
        assert after.get(key, 0) - before.get(key, 0) == 1


def test_nvdec_and_layerwise_flags_parse_and_validate(capsys):
    import argparse

    p = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(p)
    argv = ["--remote-kv", "nvdec", "--remote-kv-store", "file:///x", "--remote-kv-nvdec-instances", "3"]
    cfg = RemoteKVConfig._from_namespace(
        p.parse_args(argv + ["--remote-kv-layerwise", "--remote-kv-policy-margin", "1e9"])
    )
    assert (cfg.mode, cfg.nvdec_instances, cfg.layerwise, cfg.policy_margin) == ("nvdec", 3, True, 1e9)
    assert RemoteKVConfig.from_json(cfg.to_json()) == cfg
    default = RemoteKVConfig._from_namespace(p.parse_args(argv[:4]))
    assert (default.nvdec_instances, default.layerwise, default.policy_margin) == (2, False, 1.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--remote-kv-nvdec-instances", "0"])
    assert "--remote-kv-nvdec-instances" in capsys.readouterr().err
