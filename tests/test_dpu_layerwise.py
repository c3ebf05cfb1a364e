"""The data plane's layer-wise contract, through a real data-plane process and a real embedded store:

- a chunk's slabs are decoded as soon as it was fetched, so with a slow store the first chunk's layers
  are in the region before the last chunk arrived (and ``ChunksVerified``, sent once every chunk was
  fetched, follows them); each chunk's layers complete in order; with the ``round_barrier`` ablation
  (the previous order) ``ChunksVerified`` comes first and the round's layers complete layer-major;
- with a blob area, the verified compressed blobs sit in the shared region before ``ChunksVerified``,
  byte-identical to what the store holds; the host client keeps copies and sets ``verified`` while
  layers are still being written (a DMA delay injected with ``--dma-delay-s`` makes that observable);
- no blob area / a full blob area / a missing chunk: never ``verified``, the fetch still completes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

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
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.fetch.dpu_client.jobs import HostRound

CB = chunk_bytes(LAYOUT, CHUNK)
N = 3
# No heartbeats while a raw connection holds the client's registration: the client would see "not
# registered" in a Pong and take it back, cancelling the raw connection's job.
QUIET = {"heartbeat_s": 60.0, "heartbeat_timeout_s": 120.0}


def _spec(*flags: str, layer_group: int = 1) -> DataPlaneSettings:
    return DataPlaneSettings.from_flags(
        list(flags),
        workers=(1, 1, 1, 1),
        layer_group=layer_group,
        slots=2,
        slot_bytes=N * CB,
        store_timeout_s=2.0,
    )


@contextlib.contextmanager
def _attached(tmp_path, url: str, spec: DataPlaneSettings, blob_bytes: int):
    """A quiet client attached to a data plane running ``spec`` as a service (``_raw_job`` brings a
    connection of its own, which a server's own data plane would not take)."""
    svc = settings_service(tmp_path, url, spec, "--client-timeout", "0")
    cfg = DpuClientConfig(url, 2, N * CB, blob_bytes, endpoint=svc.endpoint, **QUIET)
    c = DpuClient(cfg, FP, codecs()["lossless"])
    try:
        c.start()
        # The receiver's first pass sends its first heartbeat (the next one only after ``heartbeat_s``). Let
        # it happen now: a Pong that came after ``_raw_job`` took over the registration would say "not
        # registered", and the client would register again, dropping the raw connection and its job.
        c._wake()
        deadline = time.monotonic() + 10
        while c.last_pong is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.last_pong is not None, "the data plane did not answer the first heartbeat"
        yield c
    finally:
        c.close()
        svc.kill()


@pytest.fixture
def client(tmp_path, request):
    """A client with a blob area per slot (``request.param``: (blob bytes, extra data-plane flags))."""
    blob_bytes, extra = getattr(request, "param", (2 * N * CB, ()))
    url = f"file://{tmp_path}/store"
    with _attached(tmp_path, url, _spec(*extra), blob_bytes) as c:
        yield c, c.codec, url


def _events(sock: zmq.Socket, job: int, timeout: float = 30.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(200):
            msg = P.decode(sock.recv())
            if getattr(msg, "job", None) == job:
                out.append(msg)
                if isinstance(msg, P.JobDone):
                    return out
    raise AssertionError(f"job {job} did not finish: {out}")


def _layers(events) -> list[tuple[int, int]]:
    """(layer, chunk) of every layer the ``LayerDone`` s in ``events`` report, in arrival order."""
    return [(m.layer + i, m.chunk) for m in events if isinstance(m, P.LayerDone) for i in range(m.count)]


def _raw_job(c, codec, keys) -> list:
    """Submit ``keys`` as job 99 on a raw connection that took over ``c``'s registration; its events."""
    r = HostRound(None, 0, N, 0, N * CHUNK, slot=0)
    dests = c.io.chunk_dests(r, keys, [CHUNK] * N)
    blob_off, blob_cap = c.io.blob_area(0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(c.cfg.endpoint)
    try:
        register_raw(sock, c)
        sub = P.SubmitFetch(
            99,
            "raw",
            codec.name,
            codec.params_bytes(),
            c._wire_fp,
            c.dest.name.lstrip("/"),
            dests,
            blob_off,
            blob_cap,
        )
        sock.send(P.encode(sub))
        return _events(sock, 99)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("client", [(2 * N * CB, ("--ablation-round-barrier",))], indirect=True)
def test_round_barrier_ablation_verifies_first_then_layer_major(client):
    c, codec, url = client
    keys, blobs = put_chunks(url, codec, random_chunks(N, seed=3))
    events = _raw_job(c, codec, keys)
    kinds = [type(m).__name__ for m in events]
    assert kinds[0] == "ChunksVerified" and kinds[-1] == "JobDone", kinds
    layers = _layers(events)
    assert len(layers) == N * LAYOUT.num_layers
    assert layers == sorted(layers), "layers did not complete layer-major"


def test_chunks_decode_as_they_arrive(tmp_path):
    """A store 0.3 s away, one fetch worker: chunk 0's layers are in the region before the last chunk
    was fetched (before ``ChunksVerified``); every chunk's layers complete in order."""
    codec = codecs()["lossless"]
    keys, blobs = put_chunks(f"file://{tmp_path}/store", codec, random_chunks(N, seed=4))
    url = f"faulty+file://{tmp_path}/store?latency_s=0.3"
    spec = dataclasses.replace(_spec(), slot_bytes=2 * N * CB)  # one data-plane round for all chunks
    with _attached(tmp_path, url, spec, 0) as c:  # no blob area: no barrier
        events = _raw_job(c, codec, keys)
    kinds = [type(m).__name__ for m in events]
    assert kinds.count("ChunksVerified") == 1 and kinds[-1] == "JobDone", kinds
    first_verified = kinds.index("ChunksVerified")
    early = set(_layers(events[:first_verified]))
    assert {(layer, 0) for layer in range(LAYOUT.num_layers)} <= early, events
    for chunk in range(N):
        assert [la for la, ch in _layers(events) if ch == chunk] == list(range(LAYOUT.num_layers))


def test_a_layerwise_request_of_two_jobs_completes_layer_major_across_both(tmp_path):
    """A layer-wise request (blob area) cut into two host rounds, i.e. two data-plane jobs, with a slow
    DMA: every chunk of *both* jobs has layer l before any chunk has layer l + 1 (the forward pass waits
    for layer l of every chunk; finishing the first job before the second's layer 0 stalled a real
    server's layer-wise installs into their fallback), and the fetch is a full hit."""
    codec, url = codecs()["lossless"], f"file://{tmp_path}/store"
    n = 2 * N
    keys, blobs = put_chunks(url, codec, random_chunks(n, seed=6))
    target = make_pool(LAYOUT, 512, n * CHUNK, seed=3)
    slow = dataclasses.replace(_spec("--dma-delay-s", "0.02"), slot_bytes=n * CB)
    c = DpuClient(DpuClientConfig(url, 2, N * CB, 2 * N * CB, slow), FP, codec)  # N chunks per host round
    c.start()
    seen: list[tuple[int, int, int]] = []  # (job, layer, chunk) in arrival order
    book_on_event = c.book.on_event

    def observe(msg):  # runs under the client's lock, on its receiver thread
        if isinstance(msg, P.LayerDone):
            seen.extend((msg.job, msg.layer + i, msg.chunk) for i in range(msg.count))
        book_on_event(msg)

    c.book.on_event = observe
    try:
        h = c.submit("one-request", keys, CHUNK, target)
        assert len(h.rounds) == 2
        assert h.wait(60).hit_chunks == n
    finally:
        c.close()
    assert len({job for job, _, _ in seen}) == 2 and len(seen) == n * LAYOUT.num_layers
    layers = [layer for _, layer, _ in seen]
    assert layers == sorted(layers), seen  # layer-major across both jobs


def test_verified_blobs_sit_in_the_region(client):
    c, codec, url = client
    keys, blobs = put_chunks(url, codec, random_chunks(N, seed=3))
    events = _raw_job(c, codec, keys)
    assert type(events[-1]).__name__ == "JobDone"
    (verified,) = [m for m in events if isinstance(m, P.ChunksVerified)]
    assert verified.ok == N and len(verified.blobs) == N
    blob_off, blob_cap = c.io.blob_area(0)
    for ref, blob in zip(verified.blobs, blobs, strict=True):  # in the region, byte-identical
        assert blob_off <= ref.off and ref.off + ref.length <= blob_off + blob_cap
        assert c.dest.array[ref.off : ref.off + ref.length].tobytes() == blob
    assert sorted(_layers(events)) == [(la, ch) for la in range(LAYOUT.num_layers) for ch in range(N)]


def test_host_is_verified_while_layers_are_still_arriving(tmp_path):
    codec, url = codecs()["lossless"], f"file://{tmp_path}/store"
    keys, blobs = put_chunks(url, codec, random_chunks(N, seed=5))
    target = make_pool(LAYOUT, 512, N * CHUNK, seed=2)
    slow = _spec("--dma-delay-s", "0.25")  # fault injection: a slow DMA engine
    c2 = DpuClient(DpuClientConfig(url, 2, N * CB, 2 * N * CB, slow), FP, codec)
    c2.start()
    try:
        h = c2.submit("r", keys, CHUNK, target)
        assert h.verified.wait(30)
        with c2.cv:
            last_layer_chunks = h.layer_ready[-1]
        assert last_layer_chunks < N  # >= N * L slabs x 0.25 s of DMA still ahead
        assert h.blobs == blobs and [hd.num_tokens for hd in h.headers] == [CHUNK] * N
        assert h.verified_bytes == sum(map(len, blobs))
        res = h.wait(60)
        assert res.hit_chunks == N
        for i in range(N):
            k, v = decode(blobs[i], FP)
            pk, pv = pool_tokens(target, LAYOUT, i * CHUNK, (i + 1) * CHUNK)
            assert np.array_equal(k, pk) and np.array_equal(v, pv)
    finally:
        c2.close()


@pytest.mark.parametrize("client", [(0, ()), (64, ())], indirect=True, ids=["no_area", "area_full"])
def test_without_room_for_the_blobs_nothing_is_verified(client):
    c, codec, url = client
    keys, _ = put_chunks(url, codec, random_chunks(N, seed=7))
    h = c.submit("r", keys, CHUNK, make_pool(LAYOUT, 512, N * CHUNK))
    assert h.wait(30).hit_chunks == N
    assert not h.verified.is_set() and all(b is None for b in h.blobs)


def test_a_missing_chunk_is_never_verified(client):
    c, codec, url = client
    keys, _ = put_chunks(url, codec, random_chunks(N, seed=9))
    keys[1] = b"absent".ljust(32, b"\0")
    h = c.submit("r", keys, CHUNK, make_pool(LAYOUT, 512, N * CHUNK))
    res = h.wait(30)
    assert res.hit_chunks == 1 and res.failures[1] == "miss"
    assert not h.verified.is_set()
    assert c.stats()["verified"] == 0
