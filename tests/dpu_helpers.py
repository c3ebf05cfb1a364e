"""Shared fixtures' helpers for the DPU tests: random KV chunks in an embedded store, KV pools."""

from __future__ import annotations

import numpy as np
import torch

from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")
FP = ModelFingerprint("TestArch", LAYOUT, "w" * 16)
CHUNK = 32


def random_chunks(n: int, seed: int = 0, layout: KVLayout = LAYOUT, tokens: int = CHUNK):
    """``n`` (k, v) pairs of finite bf16 KV ``[L, T, H, D]`` as uint16 bits."""
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, tokens, layout.num_kv_heads, layout.head_dim)
    out = []
    for _ in range(n):
        k = (rng.standard_normal(shape, dtype=np.float32) * 2).astype(np.float32)
        v = rng.standard_normal(shape, dtype=np.float32).astype(np.float32)
        out.append(tuple((a.view(np.uint32) >> 16).astype(np.uint16) for a in (k, v)))
    return out


def put_chunks(store_url: str, codec, chunks, fp: ModelFingerprint = FP, prefix: bytes = b"k"):
    """Encode and store chunks; returns (keys, blobs)."""
    client = open_client(store_url)
    keys, blobs = [], []
    for i, (k, v) in enumerate(chunks):
        key = (prefix + i.to_bytes(4, "little")).ljust(32, b"\0")
        blob = codec.encode(k, v, fp)
        keys.append(key)
        blobs.append(blob)
    client.put_many(list(zip(keys, blobs, strict=True)))
    client.close()
    return keys, blobs


def make_pool(layout: KVLayout, pool_size: int, n_tokens: int, seed: int = 1, ops=None) -> KVTarget:
    """Zeroed per-layer pools (a CPU pool, or planes of ``ops``, the strict device double) behind their
    ``KVWriter``, and a random permutation of slots for ``n_tokens`` tokens."""
    dt = torch.bfloat16 if layout.dtype == "bfloat16" else getattr(torch, layout.dtype)
    shape = (pool_size, layout.num_kv_heads, layout.head_dim)
    if ops is None:
        k = [torch.zeros(shape, dtype=dt) for _ in range(layout.num_layers)]
        v = [torch.zeros(shape, dtype=dt) for _ in range(layout.num_layers)]
    else:
        k = [ops.plane(shape, dt) for _ in range(layout.num_layers)]
        v = [ops.plane(shape, dt) for _ in range(layout.num_layers)]
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pool_size, generator=g)[:n_tokens].to(torch.int64)
    return KVTarget(writer_for(PoolTensors(k, v), layout, ops=ops), slots)


def pool_tokens(target: KVTarget, layout: KVLayout, lo: int, hi: int):
    """Read tokens ``lo..hi`` back from the pool as numpy storage arrays ``[L, T, H, D]``."""
    return target.writer.read(target.rows[lo:hi])


def register_raw(sock, client, region: str | None = None) -> None:
    """Register a raw DEALER ``sock`` with ``client``'s data plane: for ``region`` (a region the test
    created) under a session of its own, or -- ``region`` None -- taking over ``client``'s registration
    (same session and region: the data plane then drops the client's)."""
    import os

    import msgspec

    from sgl_remote_kv.contract import protocol as P

    reg = client._proc.register
    if region is not None:
        reg = msgspec.structs.replace(reg, session=os.urandom(16), regions=[region])
    sock.send(P.encode(reg))
    while sock.poll(10000):
        msg = P.decode(sock.recv())
        if isinstance(msg, P.Registered):
            assert msg.ok, msg.detail
            return
    raise AssertionError("the data plane did not answer Register")


def dataplane_stage_items(client, timeout: float = 10.0) -> dict[str, int]:
    """Items each stage of ``client``'s data plane ran, from its heartbeat stats, once the inflate stage
    shows work."""
    import json
    import time

    deadline = time.monotonic() + timeout
    items: dict[str, int] = {}
    while time.monotonic() < deadline:
        stats = json.loads(client.stats().get("dataplane") or "{}").get("pipeline", {})
        items = {s: st["items"] for s, st in stats.items()}
        if items.get("inflate"):
            break
        time.sleep(0.1)
    return items


def codecs():
    return {
        "lossless": get_codec("lossless", method="deflate", level=1),
        "quant": get_codec("quant_deflate", k_bins="256", v_bins="256", granularity="head"),
    }


def protocol_samples() -> list:
    """One valid message of every kind (the protocol round-trip test and the fuzzers start from these)."""
    from sgl_remote_kv.contract import protocol as P

    fp = P.Fingerprint("Arch", P.Layout(30, 3, 64, "float32"), "w", 0, 1, b"d" * 32)
    dest = P.ChunkDest(b"k" * 32, 256, 0, 4096, 128)
    samples = [
        P.SubmitFetch(7, "req", "lossless", b'{"a":1}', fp, "psm_x", [dest, dest]),
        P.SubmitFetch(8, "req", "lossless", b"", fp, "psm_x", [dest], 1 << 20, 1 << 16),  # blob area
        P.Cancel(7, 3),
        P.Heartbeat(1, 123),
        P.Pong(1, 123, 42, 0, b"{}"),
        P.ChunkDone(7, 1),
        P.LayerDone(7, 1, 5, 6),
        P.LayerDone(7, 1, 5, 2, [1000, 1024]),  # output codes: the bytes of each layer
        P.SubmitFetch(9, "req", "quant_deflate", b"", fp, "psm_x", [dest], output="codes"),
        P.ChunkFailed(7, 2, "corrupt", "bad crc"),
        P.ChunkFailed(7, 3, "store_error", "", "timeout"),  # the data plane's store client failed
        P.ChunkFailed(7, 4, "corrupt", "", "corrupt"),  # a value failing the store framing
        P.JobDone(7, 2, 1),
        P.ChunksVerified(7, 2, [P.BlobRef(1 << 20, 900), P.BlobRef((1 << 20) + 900, 1000)]),
        P.ChunksVerified(8, 0),
        P.Pong(2, 124, 42, 1, b"{}", True),
        P.Register(b"s" * 16, "pid 1 tp 0/1", fp, "lossless", b'{"a":1}', ["srkv-dpu-1-2-ab", "r2"]),
        P.Registered(True, "", 10000, 4242),
        P.Registered(False, "destination region 'x' does not exist"),
        P.Goodbye(),
        P.StoreRequest(9, "put_many", [b"k" * 32, b"j" * 32]),
        P.StoreRequest(10, "count_prefix", []),
        P.StoreReply(9),
        P.StoreReply(11, "", 0, [True, False]),
        P.StoreReply(12, "unavailable"),
    ]
    assert {type(m) for m in samples} == set(P.KINDS.values()), "a message kind has no sample"
    return samples
