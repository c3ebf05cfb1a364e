"""The write-back never takes the serving thread's place (issue 51 item 2): while the scheduler runs batches
(``WriteBack.note_serving``), the worker paces its encoding to ``cpu_share`` of the wall time
(``--remote-kv-writeback-cpu``), or with share 0 waits until the server is idle; an idle server is written
back at full speed. Without a server: a host pool, a codec whose encode takes a known time."""

from __future__ import annotations

import threading
import time
import types
from unittest import mock

import pytest
import torch
from dpu_helpers import FP, LAYOUT, codecs

from sgl_remote_kv import runtime
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.writeback.worker import WriteBack

CH = 32
ENCODE_S = 0.03  # what each chunk's encode takes here


class _SlowCodec:
    def __init__(self, codec) -> None:
        self.codec = codec

    def encode(self, *a, **kw):
        time.sleep(ENCODE_S)
        return self.codec.encode(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.codec, name)


def _writeback(tmp_path, share: float, chunks: int):
    codec = codecs()["lossless"]
    torch.manual_seed(0)  # the same KV in every call's pool
    pool = [
        torch.randn(chunks * CH, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16) for _ in range(8)
    ]
    writer = writer_for(PoolTensors(pool[:4], pool[4:]), LAYOUT)
    store = open_client(f"file://{tmp_path / 'store'}")
    keys = runtime.KeySpace(FP, codec, CH)
    r2t = types.SimpleNamespace(req_to_token=torch.arange(chunks * CH)[None, :].clone())
    wb = WriteBack(
        _SlowCodec(codec),
        FP,
        store,
        keys,
        RemoteKVMetrics(),
        writer,
        WriteBackRequests(r2t),
        1 << 30,
        cpu_share=share,
    )
    req = types.SimpleNamespace(
        rid="r",
        cache_salt=None,
        extra_key=None,
        kv=types.SimpleNamespace(req_pool_idx=0),
        full_untruncated_fill_ids=list(range(chunks * CH)),
    )
    return wb, req


def _serving(wb, stop: threading.Event) -> threading.Thread:
    def run():
        while not stop.is_set():
            wb.note_serving()  # a batch every 10 ms
            time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_while_serving_the_encode_takes_at_most_its_share_and_idle_runs_full_speed(tmp_path) -> None:
    n = 6
    wb, req = _writeback(tmp_path, 0.25, n)
    t0 = time.monotonic()
    wb.offer(req, n * CH)
    assert wb.flush(30)
    idle_s = time.monotonic() - t0  # not serving: no pause
    assert idle_s < n * ENCODE_S * 2.5

    wb2, req2 = _writeback(tmp_path / "b", 0.25, n)
    stop = threading.Event()
    _serving(wb2, stop)
    t0 = time.monotonic()
    wb2.offer(req2, n * CH)
    assert wb2.flush(30)
    serving_s = time.monotonic() - t0
    stop.set()
    # busy n * ENCODE_S at a 25% share: at least ~(n - 1) pauses of 3 x ENCODE_S between chunks
    assert serving_s >= n * ENCODE_S + (n - 1) * 3 * ENCODE_S * 0.9, (idle_s, serving_s)
    wb.close()
    wb2.close()


def test_share_zero_defers_encoding_until_the_server_is_idle(tmp_path) -> None:
    wb, req = _writeback(tmp_path, 0.0, 2)
    stop = threading.Event()
    _serving(wb, stop)
    wb.offer(req, 2 * CH)
    time.sleep(0.5)
    assert wb.pending() == 1 and not wb.flush(0.01)  # nothing encoded while serving
    stop.set()
    assert wb.flush(10)  # idle: written
    wb.close()


def test_the_default_share_paces_host_pools_only_and_the_flag_overrides_it() -> None:
    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.sglang_glue.assemble import WRITEBACK_CPU_HOST_POOL, writeback_share

    host = types.SimpleNamespace(device_dequant=False)
    device = types.SimpleNamespace(device_dequant=True)
    auto = RemoteKVConfig(mode="dpu")
    assert writeback_share(auto, host) == WRITEBACK_CPU_HOST_POOL == 0.1  # the forward's own cores
    # a GPU's prefill: keep up, unpaced, on a quarter of the cores (1 here on 2 cores; at most 8)
    for cores, want in ((2, 1.0), (16, 4.0), (128, 8.0)):
        with mock.patch("os.sched_getaffinity", return_value=set(range(cores))):
            assert writeback_share(auto, device) == want
    assert writeback_share(RemoteKVConfig(mode="dpu", writeback_cpu=0.0), device) == 0.0
    assert writeback_share(RemoteKVConfig(mode="dpu", writeback_cpu=3.0), host) == 3.0
    with pytest.raises(ValueError, match="--remote-kv-writeback-cpu must be in"):
        RemoteKVConfig(mode="dpu", writeback_cpu=65.0)


def test_a_share_of_n_cores_encodes_a_jobs_chunks_on_n_threads_with_the_same_blobs(tmp_path) -> None:
    """--remote-kv-writeback-cpu 3: three encoder threads at once, never paced while serving, and the store
    ends up with exactly the blobs (and keys) a single paced thread writes."""
    n = 6
    live, peak, lock = [0], [0], threading.Lock()

    class Counting(_SlowCodec):
        def encode(self, *a, **kw):
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            try:
                return super().encode(*a, **kw)
            finally:
                with lock:
                    live[0] -= 1

    wb, req = _writeback(tmp_path / "par", 3.0, n)
    assert wb.threads == 3
    wb.codec = wb._host.codec = Counting(wb.codec.codec)  # the host encode's codec too
    stop = threading.Event()
    _serving(wb, stop)
    wb.offer(req, n * CH)
    assert wb.flush(30)
    stop.set()
    assert peak[0] >= 2  # side by side (3 threads, 6 chunks of 30 ms each)
    serial, req1 = _writeback(tmp_path / "one", 1.0, n)
    assert serial.threads == 1
    serial.offer(req1, n * CH)
    assert serial.flush(30)
    keys = wb.keys.keys_for(list(range(n * CH)), n, None)
    assert len(keys) == n and keys == serial.keys.keys_for(list(range(n * CH)), n, None)
    blobs = wb.client.get_many(keys)
    assert None not in blobs and blobs == serial.client.get_many(keys)
    wb.close()
    serial.close()
