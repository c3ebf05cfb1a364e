"""The write-back never takes the serving thread's place (issue 51 item 2): while the scheduler runs batches
(``WriteBack.note_serving``), the worker paces its encoding to ``cpu_share`` of the wall time
(``--remote-kv-writeback-cpu``), or with share 0 waits until the server is idle; an idle server is written
back at full speed. Without a server: a host pool, a codec whose encode takes a known time."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
from dpu_helpers import FP, LAYOUT, codecs

from sgl_remote_kv import runtime
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.writeback import WriteBack

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
    assert writeback_share(auto, device) == 1.0  # a GPU's prefill: keep up
    assert writeback_share(RemoteKVConfig(mode="dpu", writeback_cpu=0.0), device) == 0.0
    with pytest.raises(ValueError, match="--remote-kv-writeback-cpu must be in"):
        RemoteKVConfig(mode="dpu", writeback_cpu=1.5)
