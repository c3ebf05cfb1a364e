"""``DpuFetchHandle`` (our view of a data-plane fetch) over a stand-in DPU-client handle: the hit
prefix, failure kind, decoded bytes and the compressed wire bytes the data plane reports per chunk."""

from __future__ import annotations

import threading

from sgl_remote_kv.fetch.dpu import DpuFetchHandle
from sgl_remote_kv.fetch.dpu_client.jobs import FetchResult

C, BPT = 64, 1000


class Inner:
    def __init__(self, result: FetchResult | None) -> None:
        self.request_id, self.num_chunks, self.num_layers = "r", 4, 30
        self._result = result
        self.verified, self.verified_bytes, self.verified_s = threading.Event(), 0, 0.0
        self.t_done = 12.5  # monotonic time the client saw the last chunk terminal

    def result(self) -> FetchResult | None:
        return self._result


def test_done_reports_hit_prefix_wire_and_decoded_bytes():
    res = FetchResult("r", 3, 3 * C, 4, {3: "store_miss"}, 0.25, wire_bytes=12345)
    h = DpuFetchHandle(None, Inner(res), 128, C, BPT)
    assert h.done()
    assert (h.ok_chunks, h.ok_tokens, h.failure) == (3, 3 * C, "store_miss")
    assert h.fetched_bytes == 12345 and h.decoded_bytes == 3 * C * BPT and h.fetch_s == 0.25
    # kv_wait ends when the KV was ready; no in-process decode time is reported for the DPU path
    assert h.finished_at == 12.5 and not h.decoded_here


def test_not_done_until_the_data_plane_answers():
    h = DpuFetchHandle(None, Inner(None), 0, C, BPT)
    assert not h.done() and h.fetched_bytes == 0
