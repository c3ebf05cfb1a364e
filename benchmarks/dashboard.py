"""The monitoring kit in examples/monitoring against real processes: Debian's ``prometheus`` scrapes a
real CPU SGLang server with the tier on while a short workload runs (cold requests, written back, then
remote hits after local flushes); every dashboard panel's query is asked of Prometheus, and the main
panels are rendered with matplotlib from the scraped data.

``python -m benchmarks.dashboard`` (``make dashboard``): writes ``examples/monitoring/grafana-dashboard.json``
(built from ``panels.json``), ``docs/results/dashboard.png`` and ``docs/results/dashboard.json`` (which
queries returned data). ``tests/test_monitoring.py`` uses the same pieces.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.redis_server import free_port

KIT = Path(__file__).resolve().parent.parent / "examples" / "monitoring"
PNG = Path("docs/results/dashboard.png")
OUT = Path("docs/results/dashboard.json")


def panels() -> list[dict]:
    return json.loads((KIT / "panels.json").read_text())["panels"]


def grafana_dashboard() -> dict:
    """A Grafana dashboard (schema 39) with one time-series panel per entry of ``panels.json``, over a
    ``datasource`` variable, two panels per row."""
    out = []
    for i, p in enumerate(panels()):
        targets = [
            {
                "refId": chr(65 + j),
                "expr": expr,
                "legendFormat": _legend(name, expr),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
            }
            for j, (name, expr) in enumerate(p["exprs"].items())
        ]
        out.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": p["title"],
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": _grafana_unit(p["unit"])}, "overrides": []},
                "targets": targets,
            }
        )
    return {
        "title": "sgl-remote-kv: remote KV tier",
        "uid": "sgl-remote-kv",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["sglang", "sgl-remote-kv"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": out,
    }


def _legend(name: str, expr: str) -> str:
    by = expr.split("by (", 1)[1].split(")", 1)[0] if "by (" in expr and "by (le)" not in expr else ""
    return "{{" + by.split(",")[0].strip() + "}}" if by else name


def _grafana_unit(unit: str) -> str:
    return {"bytes/s": "Bps", "s": "s", "ratio": "percentunit"}.get(unit, "short")


# Prometheus 2.x negotiates OpenMetrics, and prometheus_client then escapes the ':' of SGLang's metric names
# to '_' (sglang_prompt_tokens_total); Prometheus 3 keeps them. This relabelling restores SGLang's names, so
# the same queries work on both (examples/monitoring/prometheus.yml carries it too).
SGLANG_NAMES = [
    {
        "source_labels": ["__name__"],
        "regex": "sglang_(.*)",
        "target_label": "__name__",
        "replacement": "sglang:$1",
    }
]


@contextlib.contextmanager
def prometheus(target: str, workdir: Path, scrape_s: float = 1.0) -> Iterator[str]:
    """Debian's ``prometheus`` scraping ``target`` (host:port) every ``scrape_s``, with our rules
    loaded; yields its base URL and stops it on exit."""
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError(
            "prometheus is not installed (Debian: apt-get install prometheus; scripts/setup_env.sh)"
        )
    port = free_port()
    cfg = workdir / "prometheus.yml"
    cfg.write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": f"{scrape_s:g}s", "evaluation_interval": f"{scrape_s:g}s"},
                "rule_files": [str(KIT / "remote_kv.rules.yml")],
                "scrape_configs": [
                    {
                        "job_name": "sglang",
                        "static_configs": [{"targets": [target]}],
                        "metric_relabel_configs": SGLANG_NAMES,
                    }
                ],
            }
        )
    )
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(url: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr} | ({"time": str(at)} if at else {})
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=30) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
    with urllib.request.urlopen(
        f"{url}/api/v1/query_range?{urllib.parse.urlencode(params)}", timeout=30
    ) as r:
        return json.loads(r.read())["data"]["result"]


def scrapes_up(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s["value"][1] == "1" for s in query(url, 'up{job="sglang"}')):
            return
        time.sleep(0.5)
    raise RuntimeError("prometheus never scraped the server")


def workload(srv, model_dir: str, n_cases: int = 3) -> None:
    """Cold prompts (written back), then the same prompts after local flushes (remote hits)."""
    from transformers import AutoTokenizer

    from tests.fixtures.faults import ask, make_case, prime

    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = [prime(srv, make_case(tok, f"dashboard-{i}", n_chunks=3)) for i in range(n_cases)]
    for _ in range(2):
        for c in cases:
            ask(srv, c)


def panel_results(url: str) -> dict[str, dict[str, int]]:
    """Series count each panel query returns now (0 = no data)."""
    return {p["title"]: {name: len(query(url, expr)) for name, expr in p["exprs"].items()} for p in panels()}


def render(url: str, start: float, end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = panels()[:8]
    fig, axes = plt.subplots(4, 2, figsize=(13, 12))
    step = max(1.0, (end - start) / 200)
    for ax, p in zip(axes.flat, chosen, strict=True):
        for name, expr in p["exprs"].items():
            for s in query_range(url, expr, start, end, step):
                xs = [float(t) - start for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                label = ",".join(f"{v}" for k, v in s["metric"].items() if k != "__name__") or name
                if any(y > 0 for y in ys if y == y):  # skip all-zero and all-NaN series
                    ax.plot(xs, ys, label=label[:30])
        ax.set_title(p["title"], fontsize=9)
        ax.set_xlabel("s", fontsize=8)
        ax.set_ylabel(p["unit"], fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "all series 0 in this window", ha="center", transform=ax.transAxes, fontsize=8)
    fig.suptitle(
        "sgl-remote-kv dashboard, rendered from Prometheus after a short workload (CPU, SmolLM2-135M)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main() -> None:
    from sgl_remote_kv.model import ensure_model
    from tests.fixtures.remote_kv_server import remote_kv_server

    (KIT / "grafana-dashboard.json").write_text(json.dumps(grafana_dashboard(), indent=1) + "\n")
    model = str(ensure_model("float32"))
    with tempfile.TemporaryDirectory(prefix="srkv-dash-") as tmp:
        store = f"file://{tmp}/store"
        with remote_kv_server(model, store, "--remote-kv-policy-margin", "1e9") as srv:
            with prometheus(f"127.0.0.1:{srv.port}", Path(tmp)) as url:
                scrapes_up(url)
                start = time.time()
                workload(srv, model)
                time.sleep(5)  # a few more scrapes
                end = time.time()
                results = panel_results(url)
                render(url, start - 5, end, PNG)
    OUT.write_text(json.dumps({"panels": results, "window_s": round(end - start, 1)}, indent=1) + "\n")
    empty = [(t, n) for t, r in results.items() for n, c in r.items() if not c]
    print(json.dumps(results, indent=1))
    print(f"wrote {PNG}, {OUT}, {KIT / 'grafana-dashboard.json'}; queries without data: {empty or 'none'}")


if __name__ == "__main__":
    main()
