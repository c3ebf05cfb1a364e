"""The installed wheel, not the checkout, serves: a fresh virtual environment with the wheel
(tests/fixtures/dists.py) installed non-editable, its dependencies (SGLang, torch, ...) seen from this
environment's site-packages through a ``.pth`` line (no second download; a plain path line does not run
that directory's own ``.pth`` files, so this checkout's editable finder stays off). From a directory
outside the checkout: a CPU SGLang server with ``--remote-kv dpu`` writes a prompt back to a file store,
a second server on that store serves it from the remote tier with the cold run's tokens, through
SGLang's linker API (the queue inserts nothing into the tree: no ``device`` tokens; one ``dpu``
decision, no failure); the wheel's console scripts (``sgl-remote-kv-admin``, ``sgl-remote-kv-dpu``) start
and exit cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.launcher import ServerSpec, SGLangServer
from tests.fixtures.dists import ROOT
from tests.fixtures.remote_kv_server import flush_cache, metrics, post, storage_tokens, total

pytestmark = pytest.mark.e2e

CHUNK = 256  # the default --remote-kv-chunk-size: what users run
SHIPS = ["Aurora", "Bellwether", "Cormorant", "Dunlin", "Egret", "Fulmar", "Gannet"]
PORTS = ["Lisbon", "Bergen", "Riga", "Cork", "Gdansk", "Porto", "Oslo"]
CARGO = ["salt", "timber", "wool", "copper", "tea", "rope", "wine"]
PROMPT = (  # > 2 full chunks of the model's tokens
    "Notes from the harbour master's log, one line per ship that came in during the spring season.\n"
    + "".join(
        f"Day {d + 1}: the {SHIPS[d % 7]} arrived from {PORTS[3 * d % 7]} with {10 + 7 * d} crates of "
        f"{CARGO[5 * d % 7]} and left {d % 3 + 1} days later.\n"
        for d in range(19)
    )
    + "Question: which ship brought copper first, and from which port? Answer:"
)


@dataclass(frozen=True)
class Installed:
    python: str  # the fresh environment's interpreter
    bin: Path
    env: dict  # its processes' environment: no PYTHONPATH, its bin first on PATH
    work: Path  # outside the checkout: the working directory of everything started here


def _fresh_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return env | {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"}


@pytest.fixture(scope="module")
def installed(built_dists, tmp_path_factory) -> Installed:
    work = tmp_path_factory.mktemp("installed")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index"]
    subprocess.run(
        pip + ["--disable-pip-version-check", "-q", built_dists.wheel_from_sdist], check=True, timeout=300
    )
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(site, "srkv_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return Installed(python, venv / "bin", _fresh_env(venv), work)


PROBE = """
import json, sys, importlib.metadata as md, importlib.util
import sgl_remote_kv
ours = md.distribution("sgl-remote-kv")
eps = [
    (e.group, e.name, e.value, str(e.dist.locate_file("")))
    for g in ("sglang.srt.plugins", "sglang.srt.platforms")
    for e in md.entry_points(group=g)
]
print(json.dumps({
    "ours": sgl_remote_kv.__file__, "sglang": importlib.util.find_spec("sglang").origin, "dist": str(ours.locate_file("")),
    "entry_points": eps, "sys_path": sys.path, "meta_path": [type(f).__module__ for f in sys.meta_path],
}))
"""


def test_fresh_environment_imports_the_wheel_not_the_checkout(installed):
    p = subprocess.run(
        [installed.python, "-c", PROBE],
        cwd=installed.work,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(p.stdout.strip().splitlines()[-1])
    venv = str(installed.bin.parent)
    assert got["ours"].startswith(venv + "/"), got["ours"]
    assert got["dist"].startswith(venv + "/"), got["dist"]
    assert got["sglang"].startswith(sysconfig.get_path("purelib")), got["sglang"]  # the shared dependency
    ours = [e for e in got["entry_points"] if e[2].startswith("sgl_remote_kv.")]
    assert sorted(e[0] for e in ours) == ["sglang.srt.platforms", "sglang.srt.plugins"], ours  # once each
    assert all(e[3].startswith(venv + "/") for e in ours), ours
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    from_checkout = [p for p in got["sys_path"] if Path(p).is_relative_to(ROOT) and p not in deps]
    assert not from_checkout, got["sys_path"]
    assert not [m for m in got["meta_path"] if "editable" in m], got["meta_path"]


def _generate(srv) -> dict:
    return post(
        srv.base_url + "/generate",
        {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
    )


def test_installed_wheel_serves_remote_hits_across_a_restart(installed, model_dir):
    store = f"file://{installed.work / 'store'}"
    args = ("--remote-kv", "dpu", "--remote-kv-store", store, "--remote-kv-codec", "lossless")

    def spec(name: str) -> ServerSpec:
        return ServerSpec(
            model_path=model_dir,
            extra_args=args + ("--enable-cache-report", "--enable-metrics"),
            max_total_tokens=4096,
            python=installed.python,
            cwd=str(installed.work),
            env=installed.env | {"PYTHONPATH": ""},  # the launcher adds it to this process's environment
            log_path=str(installed.work / f"server-{name}.log"),
        )

    with SGLangServer(spec("cold")) as cold_srv:
        cold = _generate(cold_srv)
        flush_cache(cold_srv)  # the queued write-back lands first
        log = cold_srv.log_text()
    assert "sgl-remote-kv: --remote-kv dpu" in log
    assert f"{installed.python} -m sgl_remote_kv.dpu" in log  # the data plane runs the wheel's interpreter
    with SGLangServer(spec("warm")) as warm_srv:
        warm = _generate(warm_srv)
        m = metrics(warm_srv)
        log = warm_srv.log_text()
    assert "remote KV tier through the linker API" in log
    assert warm["meta_info"]["cached_tokens_details"]["device"] == 0, warm["meta_info"]
    assert m.get('sglang:remote_kv_decisions_total{path="dpu"}', 0) == 1, m
    assert total(m, "failures") == 0, m
    usable = (cold["meta_info"]["prompt_tokens"] - 1) // CHUNK * CHUNK  # full chunks (the tail comes too)
    assert usable >= 2 * CHUNK
    assert storage_tokens(cold) == 0
    assert usable <= storage_tokens(warm) < warm["meta_info"]["prompt_tokens"], warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]

    p = subprocess.run(
        [installed.bin / "sgl-remote-kv-admin", "stats", "--store", store, "--json"],
        cwd=installed.work,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    groups = json.loads(p.stdout)["groups"]
    assert [g["codec"] for g in groups] == ["lossless"], groups
    assert groups[0]["tokens"] >= usable and groups[0]["chunks"] >= usable // CHUNK, groups


def test_data_plane_console_script_serves_and_stops_on_sigterm(installed):
    endpoint = f"ipc://{installed.work / 'dpu.sock'}"
    log = installed.work / "dpu.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [installed.bin / "sgl-remote-kv-dpu", "--endpoint", endpoint, "--log-level", "INFO"]
            + ["--store", f"file://{installed.work / 'dpu-store'}"],
            cwd=installed.work,
            env=installed.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while f"serving on {endpoint}" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert f"serving on {endpoint}" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, log.read_text()
    assert "shutting down" in log.read_text()
