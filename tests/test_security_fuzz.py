"""Randomized hostile input, structure-aware (complements the byte-level fuzzes of the codec and DPU
protocol tests): every case must fail with the component's typed error (or decode to a message that
respects its bounds), within a time bound and with memory bounded by the input, never a crash.

- data-plane message parser: valid msgpack bodies with hostile *values* (out-of-range ints, wrong
  types, oversize strings, extra/missing fields, deep nesting, array/map headers claiming 2^32
  elements, big int/float extremes), 4000 cases;
- blob decoder, header-chosen codec (``codec.base.decode``, the path that parses codec params):
  hostile header fields and hostile params JSON, CRCs resealed so every case reaches the deep checks,
  3000 cases;
- the serving read path (real embedded store + ``StoreClient`` + ``InProcessFetchBackend``): a chunk
  replaced by a hostile value is a miss from that chunk on, the chunks before it decode bit-exact.
  (A tampered blob with *recomputed* CRCs can decode "validly": only the MAC stops that, see
  ``test_security_auth.py``.)
"""

from __future__ import annotations

import contextlib
import random
import struct
import threading
import time
import tracemalloc

import msgspec
import numpy as np
import pytest
from dpu_helpers import protocol_samples

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import codec_names, get_codec
from sgl_remote_kv.codec.base import decode as generic_decode
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.codec.format import CRC, FIXED, LAYER_ENTRY, crc32
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.store.client import ClientConfig, StoreClient
from sgl_remote_kv.store.local import LocalStore

SAMPLES = protocol_samples()  # one of every message kind (tests/dpu_helpers.py)
DEST = next(m for m in SAMPLES if isinstance(m, P.SubmitFetch)).chunks[0]
KIND_OF = {cls: k for k, cls in P.KINDS.items()}


def _hostile_value(rng: random.Random):
    choice = rng.randrange(12)
    return [
        lambda: -1,
        lambda: 2**64 - 1,
        lambda: -(2**63),
        lambda: 1e308 * 10,
        lambda: float("nan"),
        lambda: "x" * rng.choice([256, 4097, 70000]),
        lambda: b"\xff" * rng.choice([31, 33, 5000]),
        lambda: [DEST] * 0,
        lambda: {"nested": {"deeper": [1, 2, 3]}},
        lambda: None,
        lambda: True,
        lambda: "\ud800".encode("utf-8", "surrogatepass"),  # invalid UTF-8 as bytes
    ][choice]()


def _raw_hostile_body(rng: random.Random) -> bytes:
    """Hand-made msgpack that a well-behaved encoder never produces."""
    choice = rng.randrange(5)
    if choice == 0:  # nesting far beyond any recursion limit
        return b"\x91" * rng.choice([1000, 100_000, 1_000_000]) + b"\xc0"
    if choice == 1:  # array32 claiming 2^32-1 elements, a few present
        return b"\xdd\xff\xff\xff\xff" + b"\x01" * rng.randrange(64)
    if choice == 2:  # map32 claiming 2^32-1 pairs
        return b"\xdf\xff\xff\xff\xff" + b"\xa1a\x01" * rng.randrange(16)
    if choice == 3:  # bin32 / str32 claiming 4 GiB
        return rng.choice([b"\xc6", b"\xdb"]) + b"\xff\xff\xff\xff" + b"x" * rng.randrange(64)
    return b"\xc1" * rng.randrange(1, 32)  # the never-used type byte


def _structured_frame(rng: random.Random) -> bytes:
    msg = rng.choice(SAMPLES)
    kind = KIND_OF[type(msg)]
    if rng.random() < 0.2:
        body = _raw_hostile_body(rng)
    else:
        obj = msgspec.to_builtins(msg, enc_hook=bytes)
        target = obj
        if isinstance(obj, dict) and "fingerprint" in obj and rng.random() < 0.3:
            target = obj["fingerprint"] if rng.random() < 0.5 else obj["fingerprint"]["layout"]
        op = rng.randrange(3)
        if op == 0 and target:
            target[rng.choice(sorted(target))] = _hostile_value(rng)
        elif op == 1 and target:
            del target[rng.choice(sorted(target))]
        else:
            target[rng.choice(["extra", "job ", "\x00"])] = _hostile_value(rng)
        body = msgspec.msgpack.encode(obj)
    return P.ENVELOPE.pack(P.MAGIC, P.PROTOCOL_VERSION, kind) + body


def _check_bounds(msg) -> None:
    """A frame that decodes must still respect the documented limits."""
    if isinstance(msg, P.SubmitFetch):
        assert 1 <= len(msg.chunks) <= P.MAX_CHUNKS
        assert all(len(c.key) == 32 for c in msg.chunks)
        assert msg.fingerprint.layout.num_layers <= P.MAX_LAYERS
        assert msg.blob_off + msg.blob_cap < P.MAX_DEST_BYTES
    if isinstance(msg, P.ChunksVerified):
        assert len(msg.blobs) in (0, msg.ok) and len(msg.blobs) <= P.MAX_CHUNKS
        assert all(b.length >= 1 and b.off <= P.MAX_DEST_BYTES for b in msg.blobs)


def _quiesce_background_threads(timeout_s: float = 20.0) -> None:
    """tracemalloc's peak is process-wide: let store probes started by earlier tests (config parsing
    probes the store in the background) finish, so their allocations are not charged to the parser."""
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t.name.startswith("srkv-store-probe"):
            t.join(max(0.0, deadline - time.monotonic()))


def test_dpu_parser_structured_fuzz_no_crash_hang_or_unbounded_allocation():
    _quiesce_background_threads()
    rng = random.Random(99)
    outcomes = {"rejected": 0, "accepted": 0}
    tracemalloc.start()
    try:
        for _ in range(4000):
            frame = _structured_frame(rng)
            tracemalloc.reset_peak()
            t0 = time.perf_counter()
            try:
                msg = P.decode(frame)
            except P.ProtocolError:
                outcomes["rejected"] += 1
            else:
                outcomes["accepted"] += 1
                _check_bounds(msg)
            assert time.perf_counter() - t0 < 1.0, frame[:64]
            _, peak = tracemalloc.get_traced_memory()
            assert peak < 8 * len(frame) + (1 << 20), (peak, len(frame), frame[:32])
    finally:
        tracemalloc.stop()
    assert outcomes["rejected"] > 2500, outcomes


# ---- blob decoder ------------------------------------------------------------------------------


def _reseal(blob: bytearray) -> bytearray:
    f = FIXED.unpack_from(blob, 0)
    params_len, nl, header_len = f[4], f[6], f[11]
    if header_len > len(blob) or header_len < FIXED.size + CRC.size:
        return blob
    base = FIXED.size + params_len
    for i in range(min(nl, 4096)):
        at = base + i * LAYER_ENTRY.size
        if at + LAYER_ENTRY.size > header_len - CRC.size:
            break
        off, length, _ = LAYER_ENTRY.unpack_from(blob, at)
        sec = blob[header_len + off : header_len + off + length]
        LAYER_ENTRY.pack_into(blob, at, off, length, crc32(bytes(sec)))
    CRC.pack_into(blob, header_len - CRC.size, crc32(bytes(blob[: header_len - CRC.size])))
    return blob


_HOSTILE_PARAMS = [
    b"[" * 2048 + b"]" * 2048,
    b'{"level":' + b"9" * 4000 + b"}",
    b'{"level":1e999}',
    b'{"__class__":"os.system","level":3}',
    b'{"method":"zstd","level":-2147483649,"shuffle":true}',
    b"\xff\xfe\x00{",
    b"null",
    b'"just a string"',
    b'{"a":' * 1000 + b"1" + b"}" * 1000,
]


def _with_params(blob: bytes, params: bytes) -> bytearray:
    """Replace the params bytes, fixing params_len and header_len (the layer table follows them)."""
    f = list(FIXED.unpack_from(blob, 0))
    old = f[4]
    rest = blob[FIXED.size + old :]
    f[4] = len(params)
    f[11] = f[11] - old + len(params)
    return bytearray(FIXED.pack(*f) + params + rest)


def _mutate_header(rng: random.Random, blob: bytes) -> bytearray:
    if rng.random() < 0.3:
        return _with_params(blob, rng.choice(_HOSTILE_PARAMS))
    f = list(FIXED.unpack_from(blob, 0))
    idx = rng.choice([1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12])
    width = {1: 16, 2: 16, 3: 16, 4: 16, 9: 8, 12: 64}.get(idx, 32)
    f[idx] = rng.choice([0, 1, 2, 3, 5, 255, (1 << width) - 1, 1 << (width - 1), rng.getrandbits(width)])
    return bytearray(FIXED.pack(*f)) + bytearray(blob[FIXED.size :])


@pytest.mark.parametrize("codec_name", ["lossless", "quant_deflate", "cachegen"])
def test_generic_blob_decoder_hostile_headers_and_params(codec_name):
    fp = synthetic.fingerprint(num_layers=3, dtype="float32")
    k, v = synthetic.kv(fp.layout, 32, seed=5)
    blob = get_codec(codec_name).encode(k, v, fp)
    honest = 2 * k.nbytes + len(blob)
    rng = random.Random(codec_name)
    errors: dict[str, int] = {}
    for name in codec_names():  # a mutated codec id may name any codec: import (and JIT) them first
        with contextlib.suppress(ChunkError, ImportError, TypeError, ValueError):
            get_codec(name).decode(get_codec(name).encode(k, v, fp), fp)
    tracemalloc.start()
    try:
        for _ in range(1000):
            bad = bytes(_reseal(_mutate_header(rng, blob)))
            tracemalloc.reset_peak()
            t0 = time.perf_counter()
            try:
                generic_decode(bad, fp)
                errors["decoded"] = errors.get("decoded", 0) + 1
            except ChunkError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            assert time.perf_counter() - t0 < 2.0
            _, peak = tracemalloc.get_traced_memory()
            assert peak < 4 * honest + (2 << 20), (peak, honest)
    finally:
        tracemalloc.stop()
    assert sum(n for name, n in errors.items() if name != "decoded") > 700, errors


# ---- the serving read path ------------------------------------------------------------------------


def _hostile_variants(codec, fp, good_blob: bytes, other_blob: bytes) -> dict[str, bytes]:
    fp_other = synthetic.fingerprint(num_layers=3, dtype="float32", heads=2)
    k2, v2 = synthetic.kv(fp_other.layout, 32, seed=9)
    flipped = bytearray(good_blob)
    flipped[len(flipped) // 2] ^= 0x40
    return {
        "truncated": good_blob[: len(good_blob) - 17],
        "empty": b"",
        "bitflip": bytes(flipped),  # codec section CRC (the client re-frames it, so framing passes)
        "foreign_model": codec.encode(k2, v2, fp_other),
        "other_codec": get_codec("quant_deflate").encode(*synthetic.kv(fp.layout, 32, seed=3), fp),
        "wrong_chunk_size": codec.encode(*synthetic.kv(fp.layout, 16, seed=4), fp),
        "garbage": bytes(random.Random(1).randbytes(len(good_blob))),
        "json_bomb_params": bytes(_reseal(_with_params(good_blob, b"[" * 2000 + b"]" * 2000))),
    }


def test_hostile_chunk_in_store_is_a_miss_from_there_and_prefix_stays_exact(tmp_path):
    fp = synthetic.fingerprint(num_layers=3, dtype="float32")
    codec = get_codec("lossless")
    chunk = 32
    k, v = synthetic.kv(fp.layout, 4 * chunk, seed=1)
    blobs = [
        codec.encode(
            np.ascontiguousarray(k[:, i * chunk : (i + 1) * chunk]),
            np.ascontiguousarray(v[:, i * chunk : (i + 1) * chunk]),
            fp,
        )
        for i in range(4)
    ]
    client = StoreClient(LocalStore(tmp_path / "s"), ClientConfig(negative_ttl_s=0.0))
    backend = InProcessFetchBackend(client, codec, fp, chunk)
    try:
        for n, (name, bad) in enumerate(_hostile_variants(codec, fp, blobs[2], blobs[1]).items()):
            keys = [bytes([n, i]) * 16 for i in range(4)]
            items = list(zip(keys, blobs, strict=True))
            items[2] = (keys[2], bad)
            assert client.put_many(items) == 4
            h = backend.submit(f"r{n}", keys, 0)
            assert h.wait(30)
            assert h.ok_chunks == 2, (name, h.ok_chunks, h.failure)
            assert h.failure and h.failure.startswith("decode:"), (name, h.failure)
            assert np.array_equal(h.k[:, : 2 * chunk], k[:, : 2 * chunk]), name
            assert np.array_equal(h.v[:, : 2 * chunk], v[:, : 2 * chunk]), name
    finally:
        backend.close()
        client.close()


def test_truncated_store_value_below_codec_is_a_miss_not_an_error(tmp_path):
    """A value cut by a failed write (below the client framing) never reaches the decoder."""
    fp = synthetic.fingerprint(num_layers=3, dtype="float32")
    codec = get_codec("lossless")
    k, v = synthetic.kv(fp.layout, 32, seed=2)
    store = LocalStore(tmp_path / "s")
    client = StoreClient(store, ClientConfig(negative_ttl_s=0.0))
    key = b"\x07" * 32
    client.put_many([(key, codec.encode(k, v, fp))])
    framed = store.get_many([key])[0]
    for cut in (0, 1, 8, 19, len(framed) // 2, len(framed) - 1):
        store.put_many([(key, framed[:cut])])
        assert client.get_many([key]) == [None], cut
    assert client.stats().errors.get("corrupt", 0) >= 5
    client.close()


def test_header_struct_layout_is_what_the_fuzz_assumes():
    """Guard: the fuzz mutates FIXED by index; fail loudly if the format changes under it."""
    assert FIXED.format == "<4sHHHH32sIIIB3xIIQ16s"
    assert struct.calcsize(FIXED.format) == FIXED.size == 92  # (format.py docstring says 88)
