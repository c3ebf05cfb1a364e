"""The control-channel protocol: typed round trips, strict limits, and a fuzz of hostile frames."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest
from dpu_helpers import protocol_samples

from sgl_remote_kv.contract import protocol as P


def samples() -> list:
    return protocol_samples()


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


def test_envelope_errors_are_typed():
    good = P.encode(P.Cancel(1))
    with pytest.raises(P.BadFrame):
        P.decode(good[:5])
    with pytest.raises(P.BadFrame):
        P.decode(b"XXXX" + good[4:])
    with pytest.raises(P.VersionMismatch):
        P.decode(good[:4] + struct.pack("<H", 99) + good[6:])
    with pytest.raises(P.UnknownKind):
        P.decode(good[:6] + struct.pack("<H", 999) + good[8:])
    with pytest.raises(P.BadFrame):
        P.decode(good + b"\0" * P.MAX_FRAME_BYTES)


def test_field_limits_are_enforced():
    enc = msgspec.msgpack.encode
    env = P.ENVELOPE.pack(P.MAGIC, P.PROTOCOL_VERSION, 7)
    with pytest.raises(P.BadFrame):  # unknown failure kind
        P.decode(env + enc({"job": 1, "chunk": 0, "kind": "rm -rf", "detail": ""}))
    failed = {"job": 1, "chunk": 0, "kind": "store_error", "detail": ""}
    assert P.decode(env + enc({**failed, "store_error": "io:EROFS"})).store_error == "io:EROFS"
    for bad in ("", "x" * 65, "time out", "kind\n", "é"):  # required, bounded, one token
        with pytest.raises(P.BadFrame):
            P.decode(env + enc({**failed, "store_error": bad}))
    env = P.ENVELOPE.pack(P.MAGIC, P.PROTOCOL_VERSION, 2)
    with pytest.raises(P.BadFrame):  # job id 0 is invalid
        P.decode(env + enc({"job": 0}))
    with pytest.raises(P.BadFrame):  # unknown field
        P.decode(env + enc({"job": 1, "evil": True}))
    sub = P.encode(samples()[0])
    bad_key = sub.replace(b"k" * 32, b"k" * 31 + b"")
    with pytest.raises(P.ProtocolError):
        P.decode(bad_key)
    too_many = msgspec.structs.replace(samples()[0], chunks=[samples()[0].chunks[0]] * 2)
    assert len(P.decode(P.encode(too_many)).chunks) == 2
    with pytest.raises(msgspec.ValidationError):  # constraints apply on decode only; check the limit
        msgspec.msgpack.decode(
            enc(msgspec.structs.replace(too_many, chunks=[too_many.chunks[0]] * (P.MAX_CHUNKS + 1))),
            type=P.SubmitFetch,
        )


def test_layer_done_lengths_are_one_per_layer_and_output_is_kv_or_codes():
    env = P.ENVELOPE.pack(P.MAGIC, P.PROTOCOL_VERSION, P._KIND_OF[P.LayerDone])
    enc = msgspec.msgpack.encode
    assert P.decode(env + enc({"job": 1, "chunk": 0, "layer": 2, "count": 2, "lengths": [5, 6]})).lengths == [
        5,
        6,
    ]
    for lengths in ([5], [5, 6, 7], [-1, 5]):
        with pytest.raises(P.BadFrame):
            P.decode(env + enc({"job": 1, "chunk": 0, "layer": 2, "count": 2, "lengths": lengths}))
    sub = msgspec.msgpack.decode(P.encode(samples()[0])[P.ENVELOPE.size :])
    env = P.encode(samples()[0])[: P.ENVELOPE.size]
    assert P.decode(env + enc({**sub, "output": "codes"})).output == "codes"
    with pytest.raises(P.BadFrame):
        P.decode(env + enc({**sub, "output": "symbols"}))


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    op = rng.randrange(5)
    if op == 0 and b:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1:
        b = b[: rng.randrange(len(b) + 1)]
    elif op == 2:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif op == 3 and len(b) > P.ENVELOPE.size:
        i = rng.randrange(P.ENVELOPE.size, len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        b[P.ENVELOPE.size :] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    return bytes(b)


def test_fuzz_hostile_frames_only_raise_protocol_errors():
    rng = random.Random(1234)
    good = [P.encode(m) for m in samples()]
    outcomes = {"ok": 0, "rejected": 0}
    for i in range(6000):
        if i % 3 == 0:
            frame = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
            if i % 2:
                frame = P.ENVELOPE.pack(P.MAGIC, P.PROTOCOL_VERSION, rng.randint(1, len(P.KINDS))) + frame
        else:
            frame = _mutate(rng, rng.choice(good))
        try:
            msg = P.decode(frame)
        except P.ProtocolError:
            outcomes["rejected"] += 1
            continue
        assert type(msg) in P.KINDS.values()
        assert P.decode(P.encode(msg)) == msg  # whatever parses is a valid, re-encodable message
        outcomes["ok"] += 1
    assert outcomes["rejected"] > 3000
    assert outcomes["ok"] > 0
