"""Decoder pool worker crashes (NVDEC path, ``nvdec/pool.py``): a crash while decoding one chunk fails
that chunk only (a miss), is counted, and the pool keeps decoding the next chunks bit-exact with all
its instances. Faults are injected into the real pool (a crashing sink, a decoder failing mid-stream,
a worker thread dying); the decode itself is real.

The NVDEC path is not wired into the SGLang server in this build (``--remote-kv nvdec`` has no pool
behind it), so this is tested at the pool boundary, not end to end."""

from __future__ import annotations

import threading
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest
import sgl_remote_kv.nvdec  # noqa: F401
from sgl_remote_kv.nvdec import video
from sgl_remote_kv.nvdec.pool import DecoderCrashed, DecoderPool, SlotWriter

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec

SMALL = dict(tokens_per_frame=4, min_side=16)
TOKENS = 12


@pytest.fixture(scope="module")
def chunks():
    fp = synthetic.fingerprint(num_layers=3, dtype="float32")
    codec = get_codec("hevc", **SMALL)
    out = []
    for i in range(3):
        k, v = synthetic.kv(fp.layout, TOKENS, seed=40 + i)
        blob = codec.encode(k, v, fp)
        out.append((blob, *codec.decode(blob, fp)))
    return fp, out


def _restore(pool, fp, blob, sink_wrap=None):
    k_pool = np.zeros((fp.layout.num_layers, TOKENS, fp.layout.num_kv_heads, fp.layout.head_dim), np.float32)
    v_pool = k_pool.copy()
    sink = SlotWriter(list(k_pool), list(v_pool), np.arange(TOKENS), "float32")
    fut = pool.submit(blob, fp, sink_wrap(sink) if sink_wrap else sink)
    return fut, k_pool, v_pool


def _assert_healthy(pool, fp, chunks, n: int) -> None:
    """``n`` chunks in a row decode bit-exact (so every instance is still alive and correct)."""
    for i in range(n):
        blob, rk, rv = chunks[i % len(chunks)]
        fut, k, v = _restore(pool, fp, blob)
        fut.result(timeout=60)
        assert np.array_equal(k, rk) and np.array_equal(v, rv)


def test_sink_crash_mid_chunk_fails_that_chunk_only(chunks, caplog):
    fp, cs = chunks

    def crashing(sink):
        calls = {"n": 0}

        def wrapped(fc):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected sink crash")
            sink(fc)

        return wrapped

    with DecoderPool(instances=2) as pool:
        for _ in range(3):
            fut, _, _ = _restore(pool, fp, cs[0][0], crashing)
            with pytest.raises(RuntimeError, match="injected"):
                fut.result(timeout=60)
        assert pool.stats["internal_errors"] == 3
        _assert_healthy(pool, fp, cs, 4)


def test_decoder_failing_mid_stream_is_reset_and_reused(chunks, monkeypatch):
    fp, cs = chunks
    real = video.VideoDecoder.frames
    fail_next = threading.Event()

    def flaky(self, *a, **kw):
        for i, fr in enumerate(real(self, *a, **kw)):
            if i == 1 and fail_next.is_set():
                fail_next.clear()
                raise OSError("injected decoder crash")
            yield fr

    monkeypatch.setattr(video.VideoDecoder, "frames", flaky)
    with DecoderPool(instances=1) as pool:
        fail_next.set()
        fut, _, _ = _restore(pool, fp, cs[1][0])
        with pytest.raises(Exception, match="injected decoder crash"):
            fut.result(timeout=60)
        _assert_healthy(pool, fp, cs, 3)


def test_dead_worker_thread_is_replaced_and_its_chunk_fails(chunks, monkeypatch):
    fp, cs = chunks
    real = video.VideoDecoder.frames
    armed = threading.Event()
    armed.set()

    def dying(self, *a, **kw):
        if armed.is_set():
            armed.clear()
            raise SystemExit("injected worker death")
        yield from real(self, *a, **kw)

    monkeypatch.setattr(video.VideoDecoder, "frames", dying)
    pool = DecoderPool(instances=1)
    try:
        fut, _, _ = _restore(pool, fp, cs[0][0])
        try:
            fut.result(timeout=8)
        except FutureTimeout:
            pytest.fail("the crashed chunk's future was never resolved")
        except DecoderCrashed:  # the chunk failed (a miss for the caller): the expected outcome
            pass
        nxt, k, _ = _restore(pool, fp, cs[1][0])
        try:
            nxt.result(timeout=8)
        except FutureTimeout:
            pytest.fail("the pool stopped decoding after its worker died")
        assert np.array_equal(k, cs[1][1])
    finally:
        pool.close(timeout=2)
