"""``--remote-kv auto``/``nvdec`` wiring without a server: the policy's choice among paths, the waiting
queue's decision step (path + chunk count + metrics), and codec-separated namespaces."""

from __future__ import annotations

import pytest

from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.policy.estimator import Policy, PolicyConfig
from sgl_remote_kv.sglang_glue import paths
from sgl_remote_kv.sglang_glue.runtime import FetchPath, RemoteKVRuntime
from sgl_remote_kv.sglang_glue.waiting_queue import WaitingForKV, _Parked
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint

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


class _Backend:
    def __init__(self, depth: int) -> None:
        self.depth = depth

    def queue_depth(self) -> int:
        return self.depth

    def close(self) -> None:
        pass


@pytest.fixture()
def rt(tmp_path):
    cfg = RemoteKVConfig(mode="auto", store_url=f"file://{tmp_path / 's'}", chunk_size=16, codec="default")
    rt = RemoteKVRuntime(cfg, FP, paths.write_codec(cfg), open_client(cfg.resolved_store_url()))
    yield rt
    rt.close()


def test_write_codec_follows_the_mode_and_namespaces_never_collide(rt):
    base = dict(store_url="file:///x", chunk_size=16)
    assert paths.write_codec(RemoteKVConfig(mode="nvdec", **base)).name == "hevc"
    assert paths.write_codec(RemoteKVConfig(mode="dpu", **base)).name == rt.codec.name != "hevc"
    hevc = paths.write_codec(RemoteKVConfig(mode="nvdec", **base))
    ids = list(range(64))
    quant_keys, hevc_keys = rt.keys_for(ids, 3, None), rt.keys_for(ids, 3, None, hevc)
    assert len(set(quant_keys) | set(hevc_keys)) == 6
    assert rt.keys_for(ids, 3, None, hevc) == hevc_keys  # memoised namespace is stable


def test_waiting_queue_decision_picks_path_counts_and_metrics(rt):
    from sgl_remote_kv.codec.base import get_codec

    rt.set_paths(
        [FetchPath("dpu", _Backend(depth=5), rt.codec), FetchPath("nvdec", _Backend(0), get_codec("hevc"))]
    )
    for _ in range(3):
        rt.policy.observe_prefill(1000, 1.0)
    wq = WaitingForKV.__new__(WaitingForKV)
    wq.rt = rt
    before = rt.metrics.snapshot()
    p = _Parked(req=type("R", (), {"rid": "r1"})(), keys={}, local_chunks=0)
    assert wq._decide_fetch(p, {"dpu": 4, "nvdec": 4})
    assert (p.path, p.remote_chunks) == ("nvdec", 4)  # the DPU queue is deep
    q = _Parked(req=type("R", (), {"rid": "r2"})(), keys={}, local_chunks=0)
    assert wq._decide_fetch(q, {"dpu": 6, "nvdec": 0})
    assert (q.path, q.remote_chunks) == ("dpu", 6)  # only the DPU namespace has the prefix
    after = rt.metrics.snapshot()
    for path in ("nvdec", "dpu"):
        key = f"decisions|path={path}"
        assert after.get(key, 0) - before.get(key, 0) == 1


def test_in_flight_dedup_follows_then_reparks(rt):
    wq = WaitingForKV.__new__(WaitingForKV)
    wq.rt, wq.parked = rt, {}
    released, reparked = [], []
    wq._release_fn = released.append
    wq.park = lambda req: reparked.append(req.rid) or False  # local match now covers it
    req = type("R", (), {})
    lead = _Parked(req=req(), keys={"dpu": [b"a", b"b"]}, local_chunks=0, path="dpu", handle=object())
    lead.req.rid = "lead"
    other = _Parked(req=req(), keys={"dpu": [b"x"]}, local_chunks=0, path="dpu")
    same = _Parked(req=req(), keys={"dpu": [b"a"]}, local_chunks=0, path="dpu", fetch_started=1e18)
    same.req.rid = "same"
    wq.parked = {"lead": lead, "same": same}
    assert wq._inflight_leader(other) is None and wq._inflight_leader(same) is lead
    same.follow = "lead"
    wq._poll_follower(same, 0.0)
    assert "same" in wq.parked and not reparked  # leader still fetching
    del wq.parked["lead"]  # leader installed and released
    wq._poll_follower(same, 0.0)
    assert reparked == ["same"] and released == [same.req] and "same" not in wq.parked


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
