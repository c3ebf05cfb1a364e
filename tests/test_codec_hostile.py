"""Hostile blobs: every failure is a typed ChunkError, raised quickly with bounded memory."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from benchmarks import synthetic_kv as synthetic
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


# ---- hevc: the bitstream's own picture size is checked before FFmpeg sees a byte ----------------------


@pytest.fixture
def decoder_opens(monkeypatch):
    """Records every decoder context the hevc path creates (a spy: behaviour unchanged)."""
    from sgl_remote_kv.nvdec import video

    opened: list[int] = []
    real = video.VideoDecoder._context

    def spy(self):
        opened.append(1)
        return real(self)

    monkeypatch.setattr(video.VideoDecoder, "_context", spy)
    return opened


def _hevc(tokens: int = 32, **params):
    fp = synthetic.fingerprint(num_layers=3, dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, tokens, seed=3)
    codec = get_codec("hevc", min_side=16, **params)
    return codec, fp, codec.encode(k, v, fp)


def _section_parts(codec, fp, blob) -> tuple[bytes, list[bytes], bytes]:
    """(section bytes before the K video, the K video's packets, the V video table + packets)."""
    from sgl_remote_kv.nvdec.hevc_codec import SEC, SIDE

    from sgl_remote_kv.codec.format import layer_section

    hdr = parse_header(blob, fp)
    sec = bytes(layer_section(blob, hdr, 0))
    o = SEC.size + SIDE.size + SIDE.unpack_from(sec, SEC.size)[0]
    (n,) = struct.unpack_from("<I", sec, o)
    lens = struct.unpack_from(f"<{n}I", sec, o + 4)
    start = o + 4 * (n + 1)
    packets = [sec[a : a + ln] for a, ln in zip(np.cumsum([start, *lens[:-1]]), lens, strict=True)]
    return sec[:o], packets, sec[start + sum(lens) :]


def _repack(codec, fp, head: bytes, k_packets: list[bytes], tail: bytes, tokens: int = 32) -> bytes:
    from sgl_remote_kv.codec.format import pack

    table = struct.pack(f"<{len(k_packets) + 1}I", len(k_packets), *map(len, k_packets))
    section = head + table + b"".join(k_packets) + tail
    return pack(codec.codec_id, codec.params_bytes(), fp, tokens, [section, b"", b""])


def _ue(v: int) -> str:
    b = bin(v + 1)[2:]
    return "0" * (len(b) - 1) + b


def _read_ue(bits: str, pos: int) -> tuple[int, int]:
    zeros = bits.index("1", pos) - pos
    end = pos + 2 * zeros + 1
    return int(bits[pos + zeros : end], 2) - 1, end


def _sps_claiming(nal: bytes, width: int, height: int) -> bytes:
    """An x265 SPS NAL unit rewritten to declare a ``width x height`` picture (all else kept)."""
    rbsp = nal[2:].replace(b"\x00\x00\x03", b"\x00\x00")
    bits = "".join(f"{x:08b}" for x in rbsp)
    assert bits[4:7] == "000"  # no sub-layers: the profile_tier_level is 96 bits after 8
    _, pos = _read_ue(bits, 104)  # sps_seq_parameter_set_id
    chroma, pos = _read_ue(bits, pos)
    pos += chroma == 3  # separate_colour_plane_flag
    _, p = _read_ue(bits, pos)
    _, p = _read_ue(bits, p)
    new = (bits[:pos] + _ue(width) + _ue(height) + bits[p:]).rstrip("0")  # keep the stop bit
    new += "0" * (-len(new) % 8)
    out, zeros = bytearray(nal[:2]), 0
    for byte in int(new, 2).to_bytes(len(new) // 8, "big"):
        if zeros >= 2 and byte <= 3:  # emulation prevention
            out.append(3)
            zeros = 0
        out.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    return bytes(out)


def _with_sps(packets: list[bytes], rewrite) -> list[bytes]:
    """``packets`` with the first packet's SPS NAL unit replaced by ``rewrite(sps)``."""
    sps = _first_sps(packets)
    return [packets[0].replace(sps, rewrite(sps), 1), *packets[1:]]


def test_hevc_honest_blob_passes_the_bitstream_check(decoder_opens):
    codec, fp, blob = _hevc()
    k, v = codec.decode(blob, fp)
    assert k.shape == (3, 32, 3, 64) and decoder_opens  # the check lets honest videos through
    head, packets, tail = _section_parts(codec, fp, blob)
    same = _with_sps(packets, lambda sps: _sps_claiming(sps, *_sps_size(sps)))
    assert same == packets  # the test's SPS writer reproduces x265's SPS bit for bit
    assert _repack(codec, fp, head, same, tail) == blob


def _sps_size(sps: bytes) -> tuple[int, int]:
    from sgl_remote_kv.nvdec.video import _sps_picture

    cw, ch, *_ = _sps_picture(sps)
    return cw, ch


@pytest.mark.parametrize(
    "case",
    ["sps_claims_4096x4096", "sps_claims_8192x8192", "sps_claims_one_ctb_more", "no_sps", "huge_sps"],
)
def test_hevc_bitstream_claiming_another_picture_is_refused_before_ffmpeg(case, decoder_opens):
    """The K video's SPS (re-written, CRCs resealed by ``pack``) declares another picture than the
    chunk header's geometry: refused before any decoder exists (old code: FFmpeg allocated frames
    for the claimed size, then our frame-size check fired)."""
    codec, fp, blob = _hevc()
    head, packets, tail = _section_parts(codec, fp, blob)
    w, h = _sps_size(_first_sps(packets))
    rewrite = {
        "sps_claims_4096x4096": lambda s: _sps_claiming(s, 4096, 4096),
        "sps_claims_8192x8192": lambda s: _sps_claiming(s, 8192, 8192),
        "sps_claims_one_ctb_more": lambda s: _sps_claiming(s, w + 64, h),
        "no_sps": lambda s: b"\x4e\x01\x05",  # the SPS replaced by an SEI stub
        "huge_sps": lambda s: s + b"\xff" * 5000,
    }[case]
    bad = _repack(codec, fp, head, _with_sps(packets, rewrite), tail)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CorruptChunk, match="SPS|sequence parameter set"):
            codec.decode(bad, fp)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoder_opens == [], "FFmpeg was handed the hostile bitstream"
    assert time.perf_counter() - t0 < 1.0 and peak < 8 * len(bad) + (1 << 20)


def _first_sps(packets: list[bytes]) -> bytes:
    from sgl_remote_kv.nvdec.video import NAL_SPS, _nal_units

    return next(n.rstrip(b"\0") for n in _nal_units(packets[0]) if (n[0] >> 1) & 0x3F == NAL_SPS)


def test_hevc_params_asking_for_huge_frames_are_refused_before_ffmpeg(decoder_opens):
    """Header-chosen codec params (``min_side``) that make the frame 8192x8192 for 32 tokens, with the
    section header agreeing: refused by the geometry bound, before any decoder exists."""
    from sgl_remote_kv.nvdec.hevc_codec import SEC

    from sgl_remote_kv.codec.base import decode as decode_any

    codec, fp, blob = _hevc()
    head, packets, tail = _section_parts(codec, fp, blob)
    hostile = get_codec("hevc", min_side=8192)
    fields = list(SEC.unpack_from(head))
    fields[5:7] = hostile.frame_layout(32, 3, 64).size
    bad = _repack(hostile, fp, SEC.pack(*fields) + head[SEC.size :], packets, tail)
    with pytest.raises(CorruptChunk, match="hevc frame 8192x8192"):
        decode_any(bad, fp)
    assert decoder_opens == []


def test_hevc_randomized_sps_mutations_never_escape(decoder_opens):
    """400 random edits of the K video's SPS bytes: every outcome is a typed error or the honest KV."""
    codec, fp, blob = _hevc()
    k_ref, v_ref = codec.decode(blob, fp)
    head, packets, tail = _section_parts(codec, fp, blob)
    sps = _first_sps(packets)
    rng = np.random.default_rng(9)
    outcomes = {"error": 0, "same": 0}
    t0 = time.perf_counter()
    for _ in range(400):
        bad_sps = bytearray(sps)
        for i in rng.integers(2, len(sps), int(rng.integers(1, 4))):
            bad_sps[i] = int(rng.integers(256))
        bad = _repack(codec, fp, head, _with_sps(packets, lambda s, b=bytes(bad_sps): b), tail)
        try:
            k, v = codec.decode(bad, fp)
        except ChunkError:
            outcomes["error"] += 1
            continue
        assert np.array_equal(k, k_ref) and np.array_equal(v, v_ref)
        outcomes["same"] += 1
    assert outcomes["error"] >= 200, outcomes
    assert time.perf_counter() - t0 < 60


def test_hevc_packets_without_start_codes_are_corrupt_chunks():
    """Packets holding no Annex-B start code at all (found by the first GPU run, where the NAL splitter
    raised ValueError instead of finding no unit): junk after the headers' packet is a typed error, and
    a video of junk alone has no SPS. The checks are pure Python, the same before FFmpeg and NVDEC."""
    from sgl_remote_kv.nvdec import video

    from tests.nvdec_video_helpers import _decode_all, _videos

    packets, count, h, w = _videos()[0]
    assert count > 1 and len(packets) == count
    assert list(video._nal_units(b"\xff" * 700)) == []
    with pytest.raises(CorruptChunk, match="sequence parameter set"):
        video.check_bitstream([memoryview(b"\xff" * 700)] * count, h, w)
    with pytest.raises(CorruptChunk):
        _decode_all(video.VideoDecoder("cpu"), [packets[0], *[b"\xff" * 700] * (count - 1)], count, h, w)
