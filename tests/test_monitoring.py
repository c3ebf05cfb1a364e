"""The monitoring kit (examples/monitoring: Prometheus rules, their promtool unit tests, the Grafana
dashboard built from panels.json) checked for real: promtool checks and tests the rules, every panel query
is valid PromQL, the committed dashboard matches panels.json, and Debian's ``prometheus`` scraping a real
tier server returns data for every panel query after a short workload (``benchmarks/dashboard.py``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks import dashboard

KIT = dashboard.KIT


def _promtool(*args: str, cwd: Path = KIT) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed (Debian: apt-get install prometheus; scripts/setup_env.sh)")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_pass_promtool_check_and_their_unit_tests():
    r = _promtool("check", "rules", "remote_kv.rules.yml")
    assert r.returncode == 0 and "4 rules found" in r.stdout, r.stdout + r.stderr
    r = _promtool("test", "rules", "remote_kv.rules.test.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_example_prometheus_config_is_valid():
    r = _promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_panel_query_is_valid_promql(tmp_path):
    exprs = [e for p in dashboard.panels() for e in p["exprs"].values()]
    rules = {
        "groups": [
            {"name": "panels", "rules": [{"record": f"panel:q{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    (tmp_path / "panels.rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    r = _promtool("check", "rules", "panels.rules.yml", cwd=tmp_path)
    assert r.returncode == 0 and f"{len(exprs)} rules found" in r.stdout, r.stdout + r.stderr


def test_committed_grafana_dashboard_matches_the_panels():
    committed = json.loads((KIT / "grafana-dashboard.json").read_text())
    assert committed == dashboard.grafana_dashboard(), "run: python -m benchmarks.dashboard"
    assert len(committed["panels"]) == len(dashboard.panels())


# make test-slow (default run kept near 30 min): ~80 s with a real Prometheus
@pytest.mark.slow
@pytest.mark.e2e
def test_prometheus_scrapes_a_tier_server_and_every_panel_has_data(model_dir, tmp_path):
    from tests.fixtures.remote_kv_server import remote_kv_server

    with remote_kv_server(model_dir, f"file://{tmp_path}/store", "--remote-kv-policy-margin", "1e9") as srv:
        with dashboard.prometheus(f"127.0.0.1:{srv.port}", tmp_path) as url:
            dashboard.scrapes_up(url)
            dashboard.workload(srv, model_dir, n_cases=2)
            time.sleep(4)
            results = dashboard.panel_results(url)
            loaded = dashboard.query(url, "count(ALERTS) or vector(0)")  # the rules evaluate
            hit = dashboard.query(url, "sum(sglang:remote_kv_hit_tokens_total)")
    empty = [(t, n) for t, r in results.items() for n, c in r.items() if not c]
    assert not empty, f"panel queries without data: {empty}"
    assert loaded and float(hit[0]["value"][1]) >= 2 * 2 * 192  # 2 cases x 2 remote hits x 3 chunks
