"""Examples against a real server (marked e2e) and the bench harness's pure helpers (fast). The examples
that need only a running tier server run on test_e2e_server.py's (one server start fewer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import e2e_server
from benchmarks.launcher import ServerSpec, SGLangServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import long_document  # noqa: E402


def _extra(store) -> tuple[str, ...]:
    return (
        "--remote-kv",
        "dpu",
        "--remote-kv-store",
        f"file://{store}",
        "--enable-cache-report",
        "--enable-metrics",
    )


@pytest.mark.e2e
@pytest.mark.slow  # two servers, ~2 min; `make demo` runs the same flow
def test_long_document_recompute_local_hit_remote_hit(model_dir, tmp_path):
    """``make demo``'s part 2: server A reads the document and is stopped, server B (A restarted on the
    same store; one server at a time) is asked about it. Which tier served which row is checked, not how
    fast (a benchmark's job). First in this module: the module's ``server`` does not exist yet."""
    spec = ServerSpec(model_path=model_dir, extra_args=_extra(tmp_path / "store"), max_total_tokens=8192)
    with SGLangServer(spec) as a:
        rows = long_document.phase_a(a.base_url, max_tokens=8)
    with SGLangServer(spec) as b:
        rows += long_document.phase_b(b.base_url, max_tokens=8)
    by_path = {r.path: r for r in rows}
    recompute, local, remote = by_path["recompute"], by_path["local hit"], by_path["remote hit"]
    first = by_path["first remote hit (fresh server)"]
    assert recompute.prompt_tokens > 2000 and recompute.cached_storage == 0 and recompute.codec is None
    # question 2 reuses the document (all of question 1's prompt up to the question) from A's own cache
    assert local.cached_device > 2000 and local.cached_device + local.cached_storage >= 2200
    # B computed nothing of the document: all but the prompt's last partial sub-chunk came from the tier
    for r in (first, remote):
        assert r.cached_device == 0 and r.cached_storage >= r.prompt_tokens - 64, r
        # --remote-kv dpu's default codec (the transform codec: `make test` calibrates the model first)
        # served it; the data plane's fetch time was counted
        assert r.codec == "transform" and r.fetch_s is not None and r.fetch_s > 0, r
    assert all(r.answer for r in rows)
    assert "first remote hit" in long_document.table(rows)


# -- bench_e2e helpers (no server) ---------------------------------------------------------------
def test_metric_parsing_sums_labels_and_deltas(monkeypatch):
    text = "\n".join(
        [
            "# HELP sglang:remote_kv_fetched_bytes_total x",
            'sglang:remote_kv_fetched_bytes_total{tp_rank="0"} 1000.0',
            'sglang:remote_kv_decisions_total{path="inproc",tp_rank="0"} 3.0',
            'sglang:remote_kv_decisions_total{path="recompute"} 1.0',
            "sglang:remote_kv_fetch_seconds_sum 0.5",
            "sglang:other_metric 7",
        ]
    )

    class R:
        def __init__(self, t):
            self.t = t

        def read(self):
            return self.t.encode()

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(e2e_server.urllib.request, "urlopen", lambda *a, **k: R(text))
    m = e2e_server.scrape("http://x")
    assert e2e_server.metric(m, "remote_kv_fetched_bytes_total") == 1000.0
    assert e2e_server.decisions(m) == {"inproc": 3.0, "recompute": 1.0}
    assert not any("other_metric" in k for k in m)
    d = e2e_server.delta({"a": 5.0, "b": 1.0}, {"a": 2.0, "b": 1.0})
    assert d == {"a": 3.0}


def test_workload_args_are_offline_gsp():
    wl = e2e_server.Workload(groups=3, system_len=512, turns=2)
    a = wl.args()
    assert a[a.index("--dataset-name") + 1] == "generated-shared-prefix"
    assert a[a.index("--gsp-num-turns") + 1] == "2"
    assert "--dataset-path" not in a


def test_status_flags_a_path_the_server_did_not_take():
    from benchmarks.bench_e2e import Bench

    run = {"harness": {"remote": {"paths": {"inproc": 2.0}, "hit_tokens": 1024}}, "probe": []}
    s = Bench.status(e2e_server.CONFIGS["dpu"], {"runs": [run]})
    assert s.startswith("not run as 'dpu'") and "inproc" in s
    assert Bench.status(e2e_server.CONFIGS["auto"], {"runs": [run]}) == "ok"
