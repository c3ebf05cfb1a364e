"""End to end through a real data-plane process: store -> pipeline -> shared region -> KV pool.

Every fixture closes its client, which SIGTERMs (then SIGKILLs) and reaps the data plane.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from dpu_helpers import (
    CHUNK,
    FP,
    LAYOUT,
    codecs,
    make_pool,
    pool_tokens,
    put_chunks,
    random_chunks,
    register_raw,
)
from dpu_service_helpers import settings_service

from sgl_remote_kv.codec.base import decode
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.fetch.dpu_client.host_region import HostRegion
from sgl_remote_kv.types import KVLayout, ModelFingerprint
from tests.fixtures.dpu_clients import dp_spec

pytest_plugins = ["fixtures.dpu_clients"]

CB = chunk_bytes(LAYOUT, CHUNK)


@contextlib.contextmanager
def _attached(tmp_path: Path, url: str, codec) -> Iterator[DpuClient]:
    """A client attached to a data plane running ``dp_spec()`` as a service (a server's own data plane
    takes no connection but its host's; these tests bring connections of their own)."""
    svc = settings_service(tmp_path, url, dp_spec())
    c = DpuClient(
        DpuClientConfig(url, dest_slots=2, dest_slot_bytes=3 * CB, endpoint=svc.endpoint), FP, codec
    )
    try:
        c.start()
        yield c
    finally:
        c.close()
        svc.kill()


@contextlib.contextmanager
def _raw_dealer(client: DpuClient) -> Iterator[zmq.Socket]:
    """A DEALER socket of our own on the data-plane service ``client`` is attached to (closed, context
    ended, on exit)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(client.cfg.endpoint)
    try:
        yield s
    finally:
        s.close()
        ctx.term()


def _assert_pool_equals_decode(target, blobs, n, fp=FP):
    for i in range(n):
        k, v = decode(blobs[i], fp)
        pk, pv = pool_tokens(target, fp.layout, i * CHUNK, (i + 1) * CHUNK)
        assert np.array_equal(k, pk) and np.array_equal(v, pv), f"chunk {i} differs"


@pytest.mark.parametrize(
    "codec_name,workers", [("lossless", (1, 1, 1, 1)), ("quant", (1, 1, 1, 1)), ("quant", (2, 3, 3, 1))]
)
def test_round_trip_bit_exact_with_rounds(tmp_path, make_client, codec_name, workers):
    """(2, 3, 3, 1): several inflate and dequant workers write slabs of the same chunks concurrently."""
    codec = codecs()[codec_name]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(7, seed=3))
    writes: list[tuple[float, int]] = []  # the scheduler-side cost the glue exports (dataplane_write_*)
    c = make_client(
        url, codec, on_write=lambda s, n, output: writes.append((s, n)), process=dp_spec(workers=workers)
    )  # 3 chunks per host round, 2 per DP round
    target = make_pool(LAYOUT, 1024, 7 * CHUNK)
    h = c.submit("r", keys, CHUNK, target)
    assert h.wait_layer(0, timeout=30)
    res = h.wait(timeout=30)
    assert res.hit_chunks == 7 and res.hit_tokens == 7 * CHUNK and not res.failures
    assert res.wire_bytes == sum(map(len, blobs))  # the codec blobs the store returned
    assert h.layer_is_ready(LAYOUT.num_layers - 1)
    assert len(h.rounds) == 3
    # one layer write per layer of each run of chunks written together: per round at least, per chunk at most
    assert 3 * LAYOUT.num_layers <= sum(n for _, n in writes) <= 7 * LAYOUT.num_layers
    assert all(s >= 0 for s, _ in writes)
    assert sum(s for s, _ in writes) == pytest.approx(c.counters["write_s"])
    _assert_pool_equals_decode(target, blobs, 7)
    dp = c.stats()
    assert dp["chunks_done"] == 7 and dp["restarts"] == 0


def test_a_freed_slot_sends_the_next_round_at_once(tmp_path, make_client):
    """A ``JobDone`` frees a destination slot and queues the next round's submit on the receiver thread; it
    goes out right after the events are handled, not at the receiver's next poll timeout (heartbeat_s / 2,
    made 15 s here). It once waited for that timeout: up to 250 ms per round by default, which made a
    Llama-3-8B-shaped prompt's remote hit (2 chunks per 64 MiB round) slower than recomputing it."""
    codec = codecs()["quant"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(6, seed=5))
    c = make_client(url, codec, dest_chunks=1, heartbeat_s=30.0, heartbeat_timeout_s=90.0)
    target = make_pool(LAYOUT, 1024, 6 * CHUNK)
    res = c.fetch("r", keys, CHUNK, target, timeout=12)  # 6 rounds on 2 slots: 4 submits after a JobDone
    assert res.hit_chunks == 6 and not res.failures
    _assert_pool_equals_decode(target, blobs, 6)


def test_real_smollm2_kv_bit_exact(tmp_path, make_client):
    cache = Path(__file__).resolve().parent.parent / ".cache" / "kvdata" / "gpl3.npz"
    if not cache.exists():
        pytest.skip("real KV not extracted yet (python -m benchmarks.kvdata)")
    z = np.load(cache)
    lay = KVLayout(30, 3, 64, "bfloat16")
    fp = ModelFingerprint("LlamaForCausalLM", lay, "smollm2-test")
    codec = codecs()["quant"]
    n = 4
    chunks = [
        (z["k"][:, i * CHUNK : (i + 1) * CHUNK].copy(), z["v"][:, i * CHUNK : (i + 1) * CHUNK].copy())
        for i in range(n)
    ]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, chunks, fp)
    c = make_client(
        url, codec, fp, dest_chunks=2, process=dp_spec(slot_bytes=2 * chunk_bytes(lay, CHUNK), layer_group=5)
    )
    target = make_pool(lay, 512, n * CHUNK)
    res = c.fetch("real", keys, CHUNK, target, timeout=60)
    assert res.hit_chunks == n
    _assert_pool_equals_decode(target, blobs, n, fp)


def test_corrupt_and_foreign_chunks_end_the_prefix(tmp_path, make_client):
    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(6, seed=5))
    bad = bytearray(blobs[2])
    bad[-10] ^= 0xFF  # inside the last layer's section: its CRC no longer matches
    other_fp = ModelFingerprint("Other", LAYOUT, "x" * 16)
    foreign = codec.encode(*random_chunks(1, seed=9)[0], other_fp)
    from sgl_remote_kv.store.client import open_client

    s = open_client(url)
    s.put_many([(keys[2], bytes(bad)), (b"f".ljust(32, b"\0"), foreign)])
    s.close()
    c = make_client(url, codec)
    target = make_pool(LAYOUT, 1024, 6 * CHUNK)
    res = c.fetch("r", keys, CHUNK, target, timeout=30)
    assert res.hit_chunks == 2 and res.failures[2] == "corrupt"
    assert all(res.failures.get(i) in ("cancelled", None) for i in range(3, 6))
    _assert_pool_equals_decode(target, blobs, 2)
    res = c.fetch(
        "f", [keys[0], b"f".ljust(32, b"\0"), keys[1]], CHUNK, make_pool(LAYOUT, 1024, 3 * CHUNK), timeout=30
    )
    assert res.hit_chunks == 1 and res.failures[1] == "foreign"


def test_missing_key_is_a_miss_for_the_rest(tmp_path, make_client):
    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    keys, _ = put_chunks(url, codec, random_chunks(3, seed=2))
    c = make_client(url, codec)
    res = c.fetch("m", [keys[0], b"absent".ljust(32, b"\0"), keys[2]], CHUNK, None, timeout=30)
    assert res.hit_chunks == 1 and res.failures[1] == "miss"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_down_is_all_misses(tmp_path, make_client):
    codec = codecs()["lossless"]
    keys, _ = put_chunks(f"file://{tmp_path}/store", codec, random_chunks(3, seed=2))
    c = make_client(
        f"redis://:hunter2@127.0.0.1:{_closed_port()}/0", codec, process=dp_spec(store_timeout_s=0.5)
    )
    # the store URL reaches the data plane on stdin: its password is not in the process list
    assert "hunter2" not in Path(f"/proc/{c._proc.pid}/cmdline").read_text()
    errors: list[tuple[str, str, int]] = []
    c.on_store_error = lambda op, kind, n: errors.append((op, kind, n))
    t0 = time.monotonic()
    res = c.fetch("down", keys, CHUNK, make_pool(LAYOUT, 512, 3 * CHUNK), timeout=30)
    # the data plane's store client failure reaches the host by kind (store_errors_total on /metrics)
    assert res.hit_chunks == 0 and res.failures[0] == "store_unavailable"
    assert errors and errors[0] == ("get", "unavailable", 1)
    assert time.monotonic() - t0 < 10 and c.stats()["restarts"] == 0


def test_store_timeout_and_framing_corruption_keep_their_kind(tmp_path, make_client):
    """A value failing the store framing is ``corrupt`` (not a miss: the waiting queue's repair keys
    off it), a timed-out store call ``store_timeout``; both reach the store error listener."""
    from sgl_remote_kv.store.client import open_client
    from sgl_remote_kv.store.framing import frame

    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(3, seed=8))
    s = open_client(url)
    raw = bytearray(frame(keys[1], blobs[1]))
    raw[len(raw) // 2] ^= 0x01  # a raw bit flip: the framing CRC fails in the data plane's client
    s._guard.backend().put_many([(keys[1], bytes(raw))])  # noqa: SLF001 (write past the framing on purpose)
    s.close()
    c = make_client(url, codec)
    errors: list[tuple[str, str, int]] = []
    c.on_store_error = lambda op, kind, n: errors.append((op, kind, n))
    res = c.fetch("bitflip", keys, CHUNK, make_pool(LAYOUT, 512, 3 * CHUNK), timeout=30)
    assert res.hit_chunks == 1 and res.failures[1] == "corrupt"
    assert errors == [("get", "corrupt", 1)]
    res = c.fetch("again", keys, CHUNK, None, timeout=30)  # the data plane's client deleted the value
    assert res.hit_chunks == 1 and res.failures[1] == "miss"
    slow = make_client(_slow_url(tmp_path, 2.0), codec, process=dp_spec(store_timeout_s=0.3))
    slow.on_store_error = lambda op, kind, n: errors.append((op, kind, n))
    res = slow.fetch("slow", keys[:1], CHUNK, None, timeout=30)
    assert res.hit_chunks == 0 and res.failures[0] == "store_timeout"
    assert errors[-1] == ("get", "timeout", 1)


def _slow_url(tmp_path, latency: float) -> str:
    return f"faulty+file://{tmp_path}/store?latency_s={latency}"


def test_cancel_mid_fetch(tmp_path, make_client):
    codec = codecs()["lossless"]
    keys, blobs = put_chunks(f"file://{tmp_path}/store", codec, random_chunks(6, seed=4))
    c = make_client(_slow_url(tmp_path, 0.25), codec)
    target = make_pool(LAYOUT, 1024, 6 * CHUNK)
    h = c.submit("c", keys, CHUNK, target)
    time.sleep(0.4)
    c.cancel(h)
    res = h.wait(timeout=30)
    assert res.hit_chunks < 6
    assert all(res.failures.get(i) in ("cancelled", None) for i in range(res.hit_chunks, 6))
    res2 = c.fetch("after", keys[:2], CHUNK, make_pool(LAYOUT, 1024, 2 * CHUNK), timeout=30)
    assert res2.hit_chunks == 2  # slots were released: the data plane keeps serving
    assert c.stats()["inflight_rounds"] == 0


def test_sigkill_mid_fetch_restarts_and_serves(tmp_path, make_client):
    codec = codecs()["quant"]
    keys, blobs = put_chunks(f"file://{tmp_path}/store", codec, random_chunks(8, seed=6))
    c = make_client(_slow_url(tmp_path, 0.2), codec)
    restarts: list[str] = []
    c.on_restart = restarts.append  # sglang:remote_kv_dataplane_restarts_total{reason}
    old_pid = c.pid
    h = c.submit("k", keys, CHUNK, make_pool(LAYOUT, 1024, 8 * CHUNK))
    time.sleep(0.5)
    os.kill(old_pid, signal.SIGKILL)
    res = h.wait(timeout=10)  # ends with its lost rounds (its queued ones dropped), not at a timeout
    assert res is not None, "the request outlived its lost rounds"
    assert res.hit_chunks < 8 and "dataplane_lost" in res.failures.values()
    target = make_pool(LAYOUT, 1024, 3 * CHUNK, seed=3)
    res2 = c.fetch("next", keys[:3], CHUNK, target, timeout=60)
    assert res2.hit_chunks == 3 and c.pid != old_pid and c.stats()["restarts"] == 1
    assert restarts == ["exited"]
    _assert_pool_equals_decode(target, blobs, 3)


def test_hung_data_plane_is_replaced(tmp_path, make_client):
    codec = codecs()["lossless"]
    keys, _ = put_chunks(f"file://{tmp_path}/store", codec, random_chunks(2, seed=7))
    c = make_client(f"file://{tmp_path}/store", codec, heartbeat_s=0.2, heartbeat_timeout_s=1.5)
    restarts: list[str] = []
    c.on_restart = restarts.append
    old_pid = c.pid
    os.kill(old_pid, signal.SIGSTOP)  # alive but silent
    h = c.submit("h", keys, CHUNK, None)
    res = h.wait(timeout=30)
    assert res.hit_chunks == 0 and res.failures[0] == "dataplane_lost"
    assert c.fetch("h2", keys, CHUNK, None, timeout=60).hit_chunks == 2 and c.pid != old_pid
    assert restarts == ["hung"]


def test_hostile_frames_do_not_hurt_the_data_plane(tmp_path):
    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    keys, _ = put_chunks(url, codec, random_chunks(2, seed=8))
    with _attached(tmp_path, url, codec) as c, _raw_dealer(c) as s:
        rng = np.random.default_rng(0)
        for _ in range(300):
            s.send(rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes())
        s.send_multipart([b"a", b"b", b"c"])
        time.sleep(0.3)
        assert c.fetch("ok", keys, CHUNK, None, timeout=30).hit_chunks == 2
        assert c.stats()["restarts"] == 0


def test_layer_wait_means_layer_is_in_the_pool(tmp_path, make_client):
    codec = codecs()["quant"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(4, seed=11))
    c = make_client(url, codec)
    target = make_pool(LAYOUT, 1024, 4 * CHUNK)
    h = c.submit("lw", keys, CHUNK, target)
    for layer in range(LAYOUT.num_layers):
        assert h.wait_layer(layer, timeout=30)
        n = h.hit_chunks_now()
        for i in range(n):  # every hit chunk's layer is already scattered, finished or not
            k, v = decode(blobs[i], FP)
            pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
            assert np.array_equal(k[layer], pk[layer]) and np.array_equal(v[layer], pv[layer])
    assert h.wait(timeout=30).hit_chunks == 4


@pytest.mark.parametrize(
    "case", ["past_region", "codes_past_region", "codes_area_too_small", "codes_no_device_dequant"]
)
def test_bad_destination_is_rejected_not_written(tmp_path, case):
    from sgl_remote_kv.contract import protocol as P
    from sgl_remote_kv.contract.sizing import layer_bytes

    codec = codecs()["lossless" if case in ("past_region", "codes_no_device_dequant") else "quant"]
    url = f"file://{tmp_path}/store"
    keys, _ = put_chunks(url, codec, random_chunks(1, seed=12))
    lb = layer_bytes(LAYOUT, CHUNK)
    size = 2 * 3 * CB
    dest, output = {
        "past_region": (
            P.ChunkDest(keys[0], CHUNK, size - 16, 0, 4096),
            "kv",
        ),  # would write past the region
        "codes_past_region": (P.ChunkDest(keys[0], CHUNK, size - 3 * lb, 0, 2 * lb), "codes"),
        "codes_area_too_small": (
            P.ChunkDest(keys[0], CHUNK, 0, 0, 2 * lb - 1),
            "codes",
        ),  # < the layer's K + V
        "codes_no_device_dequant": (P.ChunkDest(keys[0], CHUNK, 0, 0, 2 * lb), "codes"),  # lossless: KV only
    }[case]
    mine = HostRegion(size, shm_names.region_name(), named=True)  # a service attaches it by name
    got = []
    with _attached(tmp_path, url, codec) as c, _raw_dealer(c) as s:
        register_raw(s, c, mine.name)  # a registered client: the region is its own, the offsets are not
        msg = P.SubmitFetch(
            999, "evil", codec.name, codec.params_bytes(), c._wire_fp, mine.name, [dest], output=output
        )
        s.send(P.encode(msg))
        while s.poll(5000):
            got.append(P.decode(s.recv()))
            if isinstance(got[-1], P.JobDone):
                break
    mine.close()
    assert isinstance(got[0], P.ChunkFailed) and got[0].kind == "bad_request"
    assert got[-1] == P.JobDone(999, 0, 1)


def test_sigterm_shuts_down_cleanly(tmp_path):
    codec = codecs()["lossless"]
    url = f"file://{tmp_path}/store"
    keys, _ = put_chunks(url, codec, random_chunks(1, seed=13))
    c = DpuClient(DpuClientConfig(url, dest_slot_bytes=2 * CB, process=dp_spec()), FP, codec)
    c.start()
    try:
        assert c.fetch("t", keys, CHUNK, None, timeout=30).hit_chunks == 1
    finally:
        proc = c._proc.proc
        c.close()
    assert proc.returncode == 0  # SIGTERM handled: pipeline joined, sockets closed, exit 0


def test_cli_help_lists_deployment_flags():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sgl_remote_kv.dpu", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--endpoint",
        "--store",
        "--auth-key-file",
        "--client-timeout",
        "--inflate-workers",
        "--cpus",
    ):
        assert flag in out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_data_plane_exits_when_the_host_dies(tmp_path):
    import subprocess
    import sys

    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from dpu_helpers import FP, codecs
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.contract.settings import DataPlaneSettings
spec = DataPlaneSettings(slot_bytes=1 << 20)
c = DpuClient(DpuClientConfig("file://{tmp_path}/store", dest_slot_bytes=1 << 20, process=spec), FP, codecs()["lossless"])
c.start()
print(c.pid, c.dest.name, c._proc.endpoint, flush=True)
time.sleep(120)
"""
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid_text, region, endpoint = host.stdout.readline().split()
        dp_pid = int(pid_text)
        # the region never has a name; once the child accepted its host, no socket file (nor run dir)
        assert not Path("/dev/shm", region).exists() and not Path(endpoint[6:]).parent.exists()
        assert f"/memfd:{region} (deleted)" in Path(f"/proc/{dp_pid}/maps").read_text()  # anonymous
        host.kill()  # the serving process dies without cleaning up
        host.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _gone(dp_pid):
            time.sleep(0.1)
        assert _gone(dp_pid)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        if "dp_pid" in locals() and not _gone(dp_pid):
            os.kill(dp_pid, signal.SIGKILL)


def test_concurrent_requests_are_isolated(tmp_path, make_client):
    codec = codecs()["quant"]
    url = f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(9, seed=21))
    from sgl_remote_kv.store.client import open_client

    bad = bytearray(blobs[4])
    bad[len(bad) // 2] ^= 0x55
    s = open_client(url)
    s.put_many([(keys[4], bytes(bad))])
    s.close()
    c = make_client(url, codec, dest_chunks=2)
    groups = [keys[0:3], keys[3:6], keys[6:9]]  # the middle request holds the corrupt chunk (its #1)
    targets = [make_pool(LAYOUT, 1024, 3 * CHUNK, seed=30 + i) for i in range(3)]
    handles = [c.submit(f"r{i}", g, CHUNK, t) for i, (g, t) in enumerate(zip(groups, targets, strict=True))]
    results = [h.wait(timeout=60) for h in handles]
    assert [r.hit_chunks for r in results] == [3, 1, 3]
    assert results[1].failures[1] == "corrupt"
    for gi, (res, t) in enumerate(zip(results, targets, strict=True)):
        for j in range(res.hit_chunks):
            k, v = decode(blobs[3 * gi + j], FP)
            pk, pv = pool_tokens(t, LAYOUT, j * CHUNK, (j + 1) * CHUNK)
            assert np.array_equal(k, pk) and np.array_equal(v, pv)
    assert c.stats()["inflight_rounds"] == 0 and c.stats()["pending_rounds"] == 0


def test_dpu_cpus_flag_pins_the_data_plane(tmp_path, make_client):
    """``--remote-kv-dpu-cpus`` parses to a core list, survives the JSON hop, and the data plane pins
    itself there (its Pong stats report the effective affinity)."""
    import argparse
    import json

    from sgl_remote_kv.config import RemoteKVConfig

    parser = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(parser)
    ns = parser.parse_args(["--remote-kv", "dpu", "--remote-kv-dpu-cpus", "1,0-0"])
    ns.remote_kv_probe_store = False
    cfg = RemoteKVConfig.from_namespace(ns)
    assert cfg.dpu_cpus == (0, 1) and RemoteKVConfig.from_json(cfg.to_json()) == cfg
    assert RemoteKVConfig._from_namespace(parser.parse_args([])).dpu_cpus == ()  # default: automatic
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--remote-kv-dpu-cpus", bad])
    want = max(os.sched_getaffinity(0))  # one core we may use (core 1 on the 2-core box)
    c = make_client(
        f"file://{tmp_path}/store", codecs()["lossless"], process=dp_spec(cpus=(want,), workers=(2, 1, 1, 1))
    )
    assert sorted(os.sched_getaffinity(c.pid)) == [want]
    deadline = time.monotonic() + 10
    while c.last_pong is None and time.monotonic() < deadline:
        time.sleep(0.1)
    dp = json.loads(c.stats()["dataplane"])
    assert dp["cpus"] == [want]
    assert dp["fetch_gate"]["limit"] == 2  # the default: two fetch workers, adaptive, nothing measured yet


def test_dpu_args_flag_and_data_plane_flags_reach_their_config():
    """``--remote-kv-dpu-args`` refuses the flags the host owns and unbalanced quotes; the data plane's
    ablation and fault-injection flags land in its pipeline config (they were once parsed and dropped)."""
    import argparse

    from sgl_remote_kv.dpu.__main__ import build_parser, config_from_args

    from sgl_remote_kv.config import RemoteKVConfig

    parser = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(parser)
    ns = parser.parse_args(["--remote-kv-dpu-args", "--dma-delay-s 0.05 --layer-group 2"])
    assert RemoteKVConfig._from_namespace(ns).dpu_args == "--dma-delay-s 0.05 --layer-group 2"
    for bad in ("--endpoint ipc:///x", "--store=file:///y", "'unbalanced"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--remote-kv-dpu-args", bad])
    base = ["--endpoint", "ipc:///x", "--store", "file:///y"]
    pipe = config_from_args(build_parser().parse_args(base)).settings.pipeline()
    assert (pipe.serial, pipe.prealloc, pipe.dma_delay_s, pipe.adaptive_fetch) == (False, True, 0.0, True)
    fixed = config_from_args(build_parser().parse_args(base + ["--fetch-concurrency", "fixed"])).settings
    assert fixed.pipeline().adaptive_fetch is False
    with pytest.raises(ValueError, match="fetch-concurrency"):
        DataPlaneSettings.from_flags(["--fetch-concurrency", "sometimes"])
    with pytest.raises(ValueError, match="fetch_concurrency"):
        DataPlaneSettings(fetch_concurrency="sometimes")
    extra = ["--ablation-serial", "--ablation-no-prealloc", "--dma-delay-s", "0.5"]
    settings = config_from_args(build_parser().parse_args(base + extra)).settings
    pipe = settings.pipeline()
    assert (pipe.serial, pipe.prealloc, pipe.dma_delay_s) == (True, False, 0.5)
    # the host's way: the same settings as one JSON argument, defaults defined once
    assert DataPlaneSettings.from_json(settings.to_json()) == settings
    host = config_from_args(build_parser().parse_args(base + ["--settings-json", settings.to_json()]))
    assert host.settings == settings
    assert DataPlaneSettings.from_flags([]) == DataPlaneSettings(cpus=())


def test_inflate_and_dequant_workers_default_to_one_per_data_plane_core():
    """Workers 0 (the inflate and dequant defaults) resolve to the data plane's cores: its ``cpus``, else the
    cores this process may use, capped; explicit counts stay; negative counts are refused."""
    from sgl_remote_kv.contract.settings import AUTO_WORKERS_MAX

    d = DataPlaneSettings()
    assert d.workers == (2, 0, 0, 1)
    four = DataPlaneSettings(cpus=(4, 5, 6, 7))
    assert four.stage_workers() == (2, 4, 4, 1)
    pipe = four.pipeline()
    assert (pipe.fetch_workers, pipe.inflate_workers, pipe.dequant_workers, pipe.dma_workers) == (2, 4, 4, 1)
    assert "inflate 4, dequant 4" in four.describe_workers() and "(4 cores)" in four.describe_workers()
    mine = min(AUTO_WORKERS_MAX, len(os.sched_getaffinity(0)))
    assert DataPlaneSettings(cpus=()).stage_workers() == (2, mine, mine, 1)
    assert DataPlaneSettings(cpus=tuple(range(64))).stage_workers()[1] == AUTO_WORKERS_MAX
    assert DataPlaneSettings(cpus=(0, 1), workers=(1, 1, 2, 1)).stage_workers() == (1, 1, 2, 1)
    assert DataPlaneSettings.from_flags(["--inflate-workers", "3"]).stage_workers()[1] == 3
    with pytest.raises(ValueError, match="counts >= 0"):
        DataPlaneSettings(workers=(2, -1, 0, 1))
    with pytest.raises(ValueError):
        DataPlaneSettings.from_flags(["--no-such-flag"])
