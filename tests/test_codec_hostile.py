"""Hostile blobs: every failure is a typed ChunkError, raised quickly with bounded memory."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from sgl_remote_kv.codec import synthetic
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.errors import (
    ChunkError,
    CorruptChunk,
    ForeignChunk,
    LimitExceeded,
    UnsupportedVersion,
)
from sgl_remote_kv.codec.format import CRC, FIXED, LAYER_ENTRY, Limits, crc32, parse_header

CODECS = [
    ("lossless", {}),
    ("quant_deflate", {}),
    ("quant_deflate", dict(k_bins="32@0,16@2", granularity="head", k_channel_scale=True, method="zstd")),
    ("quant_rans", dict(k_bins="64", granularity="head", k_outliers=4)),
    ("cachegen", {}),
]


def _blob(name="quant_deflate", params=None, dtype="bfloat16", tokens=16):
    fp = synthetic.fingerprint(num_layers=3, dtype=dtype)
    k, v = synthetic.kv(fp.layout, tokens, seed=11)
    if name == "quant_rans":
        codec = synthetic.fitted_rans_codec(fp, **(params or {}))
    else:
        codec = get_codec(name, **(params or {}))
    return codec, fp, codec.encode(k, v, fp)


def reseal(blob: bytearray) -> bytearray:
    """Recompute section CRCs and the header CRC after a mutation (to reach the codec's own checks)."""
    f = FIXED.unpack_from(blob, 0)
    params_len, nl, header_len = f[4], f[6], f[11]
    base = FIXED.size + params_len
    for i in range(nl):
        off, length, _ = LAYER_ENTRY.unpack_from(blob, base + i * LAYER_ENTRY.size)
        sec = blob[header_len + off : header_len + off + length]
        LAYER_ENTRY.pack_into(blob, base + i * LAYER_ENTRY.size, off, length, crc32(bytes(sec)))
    CRC.pack_into(blob, header_len - CRC.size, crc32(bytes(blob[: header_len - CRC.size])))
    return blob


def _expect_chunk_error(codec, fp, blob, limits=Limits()):
    try:
        codec.decode(bytes(blob), fp, limits)
    except ChunkError as e:
        return e
    return None


def test_empty_and_garbage():
    codec, fp, _ = _blob()
    for bad in (b"", b"S", b"SKVC", bytes(200), b"\xff" * 1000):
        with pytest.raises(CorruptChunk):
            codec.decode(bad, fp)


@pytest.mark.parametrize("name,params", CODECS)
def test_truncated_everywhere(name, params):
    codec, fp, blob = _blob(name, params)
    hdr = parse_header(blob, fp)
    cuts = list(range(hdr.header_len + 1)) + list(range(hdr.header_len, len(blob), 7))
    for n in cuts:
        with pytest.raises(ChunkError):
            codec.decode(blob[:n], fp)
    with pytest.raises(CorruptChunk):
        codec.decode(blob + b"\0", fp)


@pytest.mark.parametrize("name,params", CODECS)
def test_every_header_bit_flip_and_payload_flips(name, params):
    codec, fp, blob = _blob(name, params)
    hdr = parse_header(blob, fp)
    rng = np.random.default_rng(0)
    positions = [(i, b) for i in range(hdr.header_len) for b in range(8)]
    positions += [(int(i), int(rng.integers(8))) for i in rng.integers(hdr.header_len, len(blob), 300)]
    for i, b in positions:
        bad = bytearray(blob)
        bad[i] ^= 1 << b
        assert _expect_chunk_error(codec, fp, bad) is not None, (i, b)


def test_wrong_fingerprint_codec_params_version():
    codec, fp, blob = _blob()
    other = synthetic.fingerprint(num_layers=3, dtype="bfloat16")
    other = type(other)(other.architecture, other.layout, "other-weights")
    with pytest.raises(ForeignChunk):
        codec.decode(blob, other)
    with pytest.raises(ForeignChunk):
        get_codec("quant_deflate", k_bins="64").decode(blob, fp)
    with pytest.raises(ForeignChunk):
        get_codec("lossless").decode(blob, fp)
    bad = bytearray(blob)
    struct.pack_into("<H", bad, 4, 99)
    with pytest.raises(UnsupportedVersion):
        codec.decode(bytes(reseal(bad)), fp)


@pytest.mark.parametrize(
    "field,value",
    [(6, 2**31), (7, 70000), (8, 70000), (10, 2**32 - 1), (12, 2**62), (4, 60000)],
)
def test_absurd_sizes_refused_before_allocating(field, value):
    codec, fp, blob = _blob()
    f = list(FIXED.unpack_from(blob, 0))
    f[field] = value
    bad = bytearray(blob)
    FIXED.pack_into(bad, 0, *f)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises((LimitExceeded, CorruptChunk)):
            codec.decode(bytes(bad), fp, Limits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(blob) + (1 << 20), peak
    assert time.perf_counter() - t0 < 1.0


def test_claimed_decoded_size_beyond_limits():
    codec, fp, blob = _blob(tokens=64)
    with pytest.raises(LimitExceeded):
        codec.decode(blob, fp, Limits(max_tokens=32))
    with pytest.raises(LimitExceeded):
        codec.decode(blob, fp, Limits(max_blob_bytes=len(blob) - 1))
    with pytest.raises(LimitExceeded):
        codec.decode(blob, fp, Limits(max_decoded_bytes=1000))


@pytest.mark.parametrize("name,params", CODECS)
def test_randomized_malformed_inputs(name, params):
    """700 mutated blobs per codec (3500 in all), resealed so they reach the codec's own validation."""
    codec, fp, blob = _blob(name, params)
    hdr = parse_header(blob, fp)
    rng = np.random.default_rng(hash(name) % 2**32)
    t0 = time.perf_counter()
    outcomes = {"error": 0, "decoded": 0}
    for trial in range(700):
        bad = bytearray(blob)
        kind = trial % 4
        if kind == 0:  # random byte edits anywhere in the payload
            for i in rng.integers(hdr.header_len, len(bad), int(rng.integers(1, 8))):
                bad[i] = int(rng.integers(256))
        elif kind == 1:  # section sub-header edits
            e = hdr.layers[int(rng.integers(len(hdr.layers)))]
            i = e.offset + int(rng.integers(min(8, e.length)))
            bad[i] = int(rng.integers(256))
        elif kind == 2:  # truncate one section's body, shifting the rest
            e = hdr.layers[int(rng.integers(len(hdr.layers)))]
            del bad[e.offset + e.length - int(rng.integers(1, e.length)) : e.offset + e.length]
        else:  # random bytes with a valid prefix
            bad = bad[: int(rng.integers(len(bad)))] + bytearray(rng.bytes(int(rng.integers(64))))
        if kind in (0, 1):
            reseal(bad)
        err = _expect_chunk_error(codec, fp, bad)
        outcomes["error" if err else "decoded"] += 1
    assert outcomes["error"] >= 300, outcomes
    assert time.perf_counter() - t0 < 20
