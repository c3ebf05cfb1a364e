"""Config and CLI: bad store URLs and key files give one clear error at start (argparse line naming
the flag, before any model loads); an unreachable store is not a start-up error (one warning, then
misses until it answers: covered with a real server in ``test_faults_server.py``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from sgl_remote_kv import env
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.preflight import check_store_url, probe_store_async

BAD_URLS = {
    "ftp://host/x": "unknown scheme",
    "gopher+redis://h:1/0": "unknown scheme",
    "redis://": "missing host",
    "redis://:6379/0": "missing host",
    "redis://h:99999/0": "bad port",
    "redis://h:abc/0": "bad port",
    "redis://h:6379/db1": "database must be a number",
    "redis+cluster://a:1,:2": "missing host",
    "file://relative/dir": "absolute path",
    "faulty+ftp://x": "unknown scheme",
    "auth+redis://h:1/0": "auth_key_file",
    "-h": "not a URL",
    "dpu+ipc://relative.sock": "absolute path",
    "dpu+tcp://:5557": "missing host",
}
GOOD_URLS = [
    "",
    "/tmp/srkv-store",
    "file:///tmp/srkv-store?max_bytes=1G",
    "redis://127.0.0.1:6379/0",
    "redis://:pw@h:6379/2?timeout=1",
    "redis+cluster://a:7000,b:7001",
    "faulty+file:///tmp/s?error_rate=0.1",
    "dpu+ipc:///run/srkv/store.sock",
    "dpu+tcp://10.0.0.2:5558?auth_key_file=/etc/srkv.key",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="srv")
    RemoteKVConfig.add_cli_args(p)
    return p


@pytest.mark.parametrize("url,msg", BAD_URLS.items(), ids=list(BAD_URLS))
def test_bad_store_url_is_one_argparse_error_naming_the_flag(url, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--remote-kv", "dpu", f"--remote-kv-store={url}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("srv: error: argument --remote-kv-store:"), err
    assert msg in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("url", GOOD_URLS)
def test_good_store_urls_pass_without_touching_the_network(url):
    t0 = time.perf_counter()
    assert check_store_url(url) == url
    ns = _parser().parse_args(["--remote-kv", "dpu", f"--remote-kv-store={url}"])
    assert RemoteKVConfig.from_namespace(ns).store_url == url
    assert time.perf_counter() - t0 < 0.5  # syntax only: an unreachable host costs nothing here


def test_unreachable_store_is_one_warning_not_an_error(tmp_path, caplog):
    from benchmarks.redis_server import free_port

    with caplog.at_level("INFO", logger="sgl_remote_kv.preflight"):
        t0 = time.perf_counter()
        port = free_port()
        t = probe_store_async(f"redis://:secret@127.0.0.1:{port}/0?timeout=0.5")
        assert time.perf_counter() - t0 < 0.2  # never delays start-up
        t.join(10)
        probe_store_async(f"file://{tmp_path / 's'}").join(10)
    msgs = [r for r in caplog.records if str(port) in r.getMessage() or "/s " in r.getMessage()]
    warnings = [r.getMessage() for r in msgs if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "unreachable at start" in warnings[0], warnings
    assert "secret" not in warnings[0]  # the password is redacted
    assert any("reachable" in r.getMessage() and r.levelname == "INFO" for r in msgs)


def _launch(model_dir: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--device", "cpu"]
    return subprocess.run(
        cmd + list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, env.CPU_PLATFORM: "1"},
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args,flag,msg",
    [
        pytest.param(("--remote-kv-store", "ftp://x"), "--remote-kv-store", "unknown scheme", id="url"),
        pytest.param(
            ("--remote-kv-auth-key-file", "/nonexistent/srkv.key"),
            "--remote-kv-auth-key-file",
            "srkv.key",
            id="key-file",
            marks=pytest.mark.slow,  # same mechanism as "url"; ~45 s of imports on the shared box
        ),
    ],
)
def test_real_cli_bad_flag_fails_fast_with_one_line(model_dir, args, flag, msg):
    """The real launcher: exits with argparse's single error line, before loading the model."""
    t0 = time.perf_counter()
    proc = _launch(model_dir, "--remote-kv", "dpu", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and flag in errors[0] and msg in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert time.perf_counter() - t0 < 120


def test_impossible_chunk_sizes_are_one_clear_error():
    """The check ``assemble.build_runtime`` runs once the pool and the model layout are known."""
    from sgl_remote_kv.fetch.dpu_client.client import DpuClientConfig
    from sgl_remote_kv.preflight import StartupError, check_chunk_fits
    from sgl_remote_kv.types import KVLayout

    smol = KVLayout(30, 3, 64, "float32")  # 46 080 B of K+V per token
    slot = DpuClientConfig(store_url="").dest_slot_bytes
    fits = slot // (2 * 30 * 3 * 64 * 4) // 16 * 16
    check_chunk_fits(256, 4096, smol, data_plane=True)
    check_chunk_fits(fits, 10**6, smol, data_plane=True)
    check_chunk_fits(fits + 16, 10**6, smol, data_plane=False)  # no data plane: no slot limit
    with pytest.raises(StartupError) as e:
        check_chunk_fits(8192, 4096, smol, data_plane=True)
    msg = str(e.value)
    assert msg.startswith("--remote-kv-chunk-size 8192") and "KV pool (4096 tokens" in msg and "\n" not in msg
    with pytest.raises(StartupError) as e:
        check_chunk_fits(fits + 16, 10**6, smol, data_plane=True)
    assert f"{slot >> 20} MiB staging slot" in str(e.value) and f"at most {fits} tokens" in str(e.value)


@pytest.mark.e2e
@pytest.mark.slow
def test_chunk_larger_than_kv_pool_is_one_clear_error_at_start(model_dir):
    t0 = time.perf_counter()
    try:
        proc = _launch(
            model_dir,
            "--remote-kv",
            "dpu",
            "--remote-kv-chunk-size",
            "8192",
            "--max-total-tokens",
            "4096",
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("server kept running with an impossible chunk size instead of failing at start")
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    ours = [ln for ln in errors if "remote KV start-up error: --remote-kv-chunk-size 8192" in ln]
    assert len(ours) == 1 and "KV pool (4096 tokens" in ours[0], proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") <= 1, proc.stderr[-3000:]  # SGLang's one "Scheduler hit" dump
    assert "data plane" not in proc.stderr.lower()  # refused before any tier resource was started
    print(f"refused after {time.perf_counter() - t0:.0f} s; stderr {len(proc.stderr.splitlines())} lines")
