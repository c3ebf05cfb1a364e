"""The transform codec and its calibration record, on a synthetic calibration (no model needed).

The calibration fitted with the real model is exercised by ``tests/test_calibrate.py``."""

from __future__ import annotations

import calibration_helpers
import numpy as np
import pytest

from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec import transform, transform_ops
from sgl_remote_kv.codec.base import codec_for_header, decode, get_codec
from sgl_remote_kv.codec.errors import ChunkError, ForeignChunk
from sgl_remote_kv.codec.format import parse_header
from sgl_remote_kv.types import KVLayout, ModelFingerprint, RopeSpec

L, H, D, T = 3, 2, 16, 48
ROPE = RopeSpec(10000.0, D, "neox")


def fp(dtype="float32", tp_rank=0, tp_size=1, heads=H, weights="w"):
    return ModelFingerprint("Llama", KVLayout(L, heads, D, dtype), weights, tp_rank, tp_size)


def _rotate(x, start, sign, rope=ROPE):
    x = np.array(x, np.float32)
    transform_ops.apply_rope(x, rope, start, sign)
    return x


def make_calibration(
    levels=("0.0005", "0.001", "0.01"), step=0.05, seed=0, key_fp=None, rope=ROPE, groups=1, sinks=1
) -> cm.Calibration:
    return calibration_helpers.make_calibration(key_fp or fp(), levels, step, seed, rope, groups, sinks)


def kv(dtype="float32", start=0, seed=1, t=T, heads=H, scale=1.0):
    """Keys with RoPE applied at positions start.. (as a model caches them), values as is."""
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((L, t, heads, D)) * scale).astype(np.float32)
    v = (rng.standard_normal((L, t, heads, D)) * scale).astype(np.float32)
    k = np.stack([_rotate(k[i], start, +1) for i in range(L)])
    return _store(k, dtype), _store(v, dtype)


def _store(x, dtype):
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(dtype)


def _f32(x):
    return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x.astype(np.float32)


@pytest.fixture
def cal():
    c = make_calibration()
    yield c
    cm.unregister(c.calib_id)


def test_rope_undo_then_apply_is_identity_far_into_the_sequence():
    x = np.random.default_rng(0).standard_normal((T, H, D)).astype(np.float32)
    back = _rotate(_rotate(x, 100_000, -1), 100_000, +1)
    assert np.max(np.abs(back - x)) < 1e-5
    gptj = RopeSpec(10000.0, D, "gptj")
    assert np.max(np.abs(_rotate(_rotate(x, 7, -1, gptj), 7, +1, gptj) - x)) < 1e-5
    assert np.max(np.abs(_rotate(x, 7, -1) - x)) > 0.1  # it does rotate


@pytest.mark.parametrize("entropy", ["deflate", "rans", "auto", "zstd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_roundtrip_error_is_bounded_by_the_steps(cal, entropy, dtype):
    codec = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.0005", entropy=entropy)
    start = 512
    k, v = kv(dtype, start)
    blob = codec.encode(k, v, fp(dtype), start=start)
    k2, v2 = codec.decode(blob, fp(dtype))
    assert k2.dtype == k.dtype and k2.shape == k.shape
    for a, b in ((k, k2), (v, v2)):
        x, y = _f32(a), _f32(b)
        rms = np.sqrt(np.mean(np.square(x - cal.mean[:, 0].reshape(L, 1, H, D)), axis=(2, 3)))  # ~ token RMS
        # per (token, head): |error| <= sqrt(D) * step/2 * token RMS (+ the storage dtype's rounding)
        err = np.sqrt(np.sum(np.square(x - y), axis=3))
        bound = np.sqrt(D) * 0.05 / 2 * rms[:, :, None] * 1.3 + 0.02 * np.abs(x).max()
        assert np.all(err <= bound), float((err / bound).max())
    assert len(blob) < k.nbytes + v.nbytes


def test_rans_and_deflate_variants_decode_identically(cal):
    k, v = kv("bfloat16", 256, scale=3.0)
    outs = []
    for entropy in ("deflate", "rans", "auto", "zstd"):
        codec = get_codec("transform", calibration=cal.calib_id.hex(), entropy=entropy)
        outs.append(decode(codec.encode(k, v, fp("bfloat16"), start=256), fp("bfloat16")))
    for o in outs[1:]:
        assert np.array_equal(outs[0][0], o[0]) and np.array_equal(outs[0][1], o[1])


def test_auto_entropy_keeps_the_smaller_section_per_layer(cal):
    """Per layer, auto's section is the smaller of the Deflate and rANS ones (+ its tag), so the blob is
    never larger than either variant's; a bad tag is a corrupt chunk."""
    from sgl_remote_kv.codec.errors import CorruptChunk
    from sgl_remote_kv.codec.format import layer_section, parse_header

    k, v = kv("float16", 256, scale=3.0)
    k[:, :, :, : D // 2] *= np.float16(0.05)  # half the channels far from the calibration's spread
    f = fp("float16")
    blobs = {
        e: get_codec("transform", calibration=cal.calib_id.hex(), entropy=e).encode(k, v, f, start=256)
        for e in ("deflate", "rans", "auto")
    }
    hdrs = {e: parse_header(b, f) for e, b in blobs.items()}
    tags = set()
    for layer in range(L):
        sec = {e: len(layer_section(blobs[e], hdrs[e], layer)) for e in blobs}
        assert sec["auto"] == min(sec["deflate"], sec["rans"]) + 1
        tags.add(bytes(layer_section(blobs["auto"], hdrs["auto"], layer)[:1]))
    assert len(blobs["auto"]) <= min(len(blobs["deflate"]), len(blobs["rans"]))
    codec = get_codec("transform", calibration=cal.calib_id.hex(), entropy="auto")
    sec = bytearray(layer_section(blobs["auto"], hdrs["auto"], 0))
    sec[0] = 7
    with pytest.raises(CorruptChunk, match="entropy tag"):
        codec.lossless_stage(memoryview(bytes(sec)), np.empty(codec.scratch_bytes(hdrs["auto"], 0), np.uint8))
    assert tags <= {b"\x00", b"\x01"}


def test_the_chunk_position_travels_in_the_blob(cal):
    """A chunk encoded at position 300 decodes to keys rotated for 300, whatever the decoder's context."""
    codec = get_codec("transform", calibration=cal.calib_id.hex())
    k, v = kv("float32", 300)
    k_wrong, _ = kv("float32", 0)
    k2, _ = codec.decode(codec.encode(k, v, fp(), start=300), fp())
    assert np.abs(k2 - k).max() < np.abs(k2 - k_wrong).max() / 5


def test_stage_split_matches_whole_decode(cal):
    codec = get_codec("transform", calibration=cal.calib_id.hex(), entropy="rans")
    k, v = kv("float16", 64)
    blob = codec.encode(k, v, fp("float16"), start=64)
    kw, vw = codec.decode(blob, fp("float16"))
    hdr = codec.parse(blob, fp("float16"))
    scratch = np.empty(codec.max_scratch_bytes(hdr), np.uint8)
    for layer, kl, vl in codec.decode_layers(blob, fp("float16")):
        assert np.array_equal(kl, kw[layer]) and np.array_equal(vl, vw[layer])
        ok, ov = np.empty_like(kl), np.empty_like(vl)
        codec.decode_layer_into(blob, hdr, layer, scratch, ok, ov)
        assert np.array_equal(ok, kl) and np.array_equal(ov, vl)


def test_levels_are_distinct_codecs_and_coarser_is_smaller(cal):
    k, v = kv("bfloat16", 0)
    fine = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.001", entropy="rans")
    coarse = get_codec("transform", calibration=cal.calib_id.hex(), quality="0.01", entropy="rans")
    b_fine, b_coarse = fine.encode(k, v, fp("bfloat16")), coarse.encode(k, v, fp("bfloat16"))
    assert len(b_coarse) < len(b_fine)
    with pytest.raises(ForeignChunk):
        coarse.decode(b_fine, fp("bfloat16"))
    assert codec_for_header(parse_header(b_coarse, fp("bfloat16"))).quality == "0.01"
    with pytest.raises(ValueError):
        get_codec("transform", calibration=cal.calib_id.hex(), quality="0.003")
    with pytest.raises(cm.CalibrationError):
        get_codec("transform", calibration=cal.calib_id.hex(), quality="0.005")  # not fitted


def test_a_per_head_calibration_serves_tp1_and_the_largest_groups_are_preferred(cal):
    per_head = make_calibration(groups=H, seed=9)
    try:
        assert transform.TransformCodec.for_model(fp(), "0.001").cal.calib_id == cal.calib_id  # larger groups
        codec = get_codec("transform", calibration=per_head.calib_id.hex(), entropy="rans")
        k, v = kv("float32", 40)
        k2, v2 = codec.decode(codec.encode(k, v, fp(), start=40), fp())
        assert np.abs(k2 - k).max() < 0.5 and np.abs(v2 - v).max() < 0.5
        assert per_head.group_dim == D and per_head.groups == H
    finally:
        cm.unregister(per_head.calib_id)


def test_tp_rank_uses_its_head_group(cal):
    tp2 = make_calibration(groups=2)
    try:
        rank_fp = fp("float32", tp_rank=1, tp_size=2, heads=1)
        codec = transform.TransformCodec.for_model(rank_fp, "0.001", rope=ROPE)
        assert codec.cal.calib_id == tp2.calib_id  # the fixture's one-group calibration does not fit TP 2
        k, v = kv("float32", 0, heads=1)
        blob = codec.encode(k, v, rank_fp)
        k2, v2 = codec.decode(blob, rank_fp)
        assert np.abs(k2 - k).max() < 0.5 and np.abs(v2 - v).max() < 0.5
        with pytest.raises(ForeignChunk):  # rank 0's fingerprint: another digest
            codec.decode(blob, fp("float32", tp_rank=0, tp_size=2, heads=1))
        with pytest.raises(cm.CalibrationError, match="--tp 3"):  # no calibration for TP 3
            transform.TransformCodec.for_model(fp("float32", 0, 3, heads=1), "0.001")
    finally:
        cm.unregister(tp2.calib_id)


def test_token_scales_are_log_coded_and_fall_back_to_floats_when_their_range_does_not_fit():
    from sgl_remote_kv.codec import transform_ops as ops

    rng = np.random.default_rng(7)
    rms = rng.uniform(0.01, 2.0, 300).astype(np.float32)
    rms[0] = 0.0  # a sink token
    fmt, raw, back = ops.code_scales([rms, rms * 3])
    assert fmt == ops.SCALE_LOG8 and len(raw) == ops.scale_bytes(fmt, 300) == 8 + 600
    for want, got in zip((rms, rms * 3), back, strict=True):
        assert got[0] == 0 and np.all(
            np.abs(got[1:] / want[1:] - 1) <= 2 ** (0.5 / ops.LOG8_STEPS) - 1 + 1e-6
        )
    buf = np.frombuffer(raw, np.uint8)
    np.testing.assert_array_equal(
        ops.read_scales(buf, 0, fmt, 300), np.stack(back)
    )  # what decoders read back
    wide = rms.copy()
    wide[5] = wide[1:].min() * 2.0**9  # 9 octaves > 254 codes
    fmt, raw, back = ops.code_scales([rms, wide])
    assert fmt == ops.SCALE_FP16 and len(raw) == 4 * 300
    np.testing.assert_array_equal(back[1], wide.astype(np.float16).astype(np.float32))
    assert ops.code_scales([np.full(4, 1e6, np.float32)])[0] == ops.SCALE_LOG8  # large but narrow: fits
    assert ops.code_scales([np.array([1e-3, 1e6], np.float32)])[0] == ops.SCALE_FP32


def test_sink_positions_are_stored_exactly():
    c = make_calibration(levels=("0.0005",), step=0.3, sinks=2)
    try:
        codec = get_codec("transform", calibration=c.calib_id.hex(), entropy="rans")
        k, v = kv("bfloat16", 0)
        k[:, 0] = 0x4480  # 1024.0: an outsized sink
        k2, v2 = codec.decode(codec.encode(k, v, fp("bfloat16"), start=0), fp("bfloat16"))
        assert np.array_equal(k2[:, :2], k[:, :2]) and np.array_equal(v2[:, :2], v[:, :2])
        assert not np.array_equal(k2[:, 2:], k[:, 2:])  # the rest is quantized
        k3, _ = codec.decode(codec.encode(k, v, fp("bfloat16"), start=1), fp("bfloat16"))
        assert np.array_equal(k3[:, :1], k[:, :1]) and not np.array_equal(k3[:, 1], k[:, 1])
    finally:
        cm.unregister(c.calib_id)


def test_for_model_refuses_another_rope_and_a_missing_calibration(cal):
    with pytest.raises(cm.CalibrationError, match="RoPE"):
        transform.TransformCodec.for_model(fp(), "0.001", rope=RopeSpec(500000.0, D, "neox"))
    with pytest.raises(cm.CalibrationError, match="sgl_remote_kv.codec.calibration"):
        transform.TransformCodec.for_model(fp(weights="another-model"), "0.001")


def test_unknown_or_foreign_calibration_is_foreign(cal):
    codec = get_codec("transform", calibration=cal.calib_id.hex())
    k, v = kv()
    blob = codec.encode(k, v, fp())
    cm.unregister(cal.calib_id)
    try:
        with pytest.raises(ForeignChunk):
            decode(blob, fp())
    finally:
        cm.register(cal)
    other = make_calibration(seed=5, key_fp=fp(weights="other"))
    try:
        with pytest.raises(ValueError, match="another model"):
            get_codec("transform", calibration=other.calib_id.hex()).encode(k, v, fp())
    finally:
        cm.unregister(other.calib_id)


def test_kv_far_from_the_calibration_fails_to_encode_cleanly():
    c = make_calibration(levels=("0.0005",), step=0.001, seed=3)
    try:
        codec = get_codec("transform", calibration=c.calib_id.hex())
        k, v = kv(scale=1.0)
        with pytest.raises(ValueError, match="too far"):
            codec.encode(k, v, fp())
    finally:
        cm.unregister(c.calib_id)


def test_escapes_keep_outliers_exact_enough(cal):
    """A token whose energy sits in one component (|q| > 127) is escaped, not clipped."""
    k, v = kv("float32", 0)
    v[:, 5] = 0.0
    v[:, 5, 0, 3] = 40.0
    codec = get_codec("transform", calibration=cal.calib_id.hex(), entropy="rans")
    _, v2 = codec.decode(codec.encode(k, v, fp()), fp())
    assert abs(v2[0, 5, 0, 3] - 40.0) < 2.0


def test_hostile_bytes_raise_only_chunk_errors(cal):
    rng = np.random.default_rng(7)
    for entropy in ("deflate", "rans"):
        codec = get_codec("transform", calibration=cal.calib_id.hex(), entropy=entropy)
        k, v = kv("bfloat16", 0, t=16)
        blob = bytearray(codec.encode(k, v, fp("bfloat16")))
        hdr = codec.parse(bytes(blob), fp("bfloat16"))
        for _ in range(150):
            b = bytearray(blob)
            for _ in range(rng.integers(1, 6)):
                b[rng.integers(0, len(b))] = rng.integers(0, 256)
            try:
                codec.decode(bytes(b), fp("bfloat16"))
            except ChunkError:
                pass
        # sections that pass their CRC but lie (the CRC is not a MAC): stage by stage
        scratch = np.empty(codec.max_scratch_bytes(hdr), np.uint8)
        out = np.empty((16, H, D), np.uint16)
        for _ in range(150):
            sec = bytearray(bytes(blob)[hdr.header_len : hdr.header_len + 400])
            sec[rng.integers(0, min(len(sec), 40))] = rng.integers(0, 256)
            try:
                n = codec.lossless_stage(memoryview(bytes(sec)), scratch)
                codec.dequant_stage(hdr, 0, scratch[:n], out, out.copy())
            except ChunkError:
                pass


def test_calibration_file_roundtrip_and_tamper(cal, tmp_path):
    path = cal.save(tmp_path)
    assert path.name == f"{cal.calib_id.hex()}.npz"
    back = cm.Calibration.load(path)
    assert back.calib_id == cal.calib_id and back.levels == cal.levels and back.rope == ROPE
    with np.load(path, allow_pickle=False) as z:
        arrays = {n: z[n] for n in z.files}
    arrays["mean"] = arrays["mean"] + 1
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(cm.CalibrationError, match="does not match its id"):
        cm.Calibration.load(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(cm.CalibrationError, match="not a calibration"):
        cm.Calibration.load(tmp_path / "junk.npz")
    assert cm.load_dir(tmp_path, force=True) == 1  # the good file; the bad ones are skipped


def test_calibration_rejects_malformed_tables():
    c = make_calibration(levels=("0.001",))
    cm.unregister(c.calib_id)
    with pytest.raises(cm.CalibrationError, match="positive"):
        cm.Calibration(c.model_key, ROPE, c.mean, c.basis, {"0.001": -c.steps["0.001"]}, c.freq)
    with pytest.raises(cm.CalibrationError, match="unknown levels"):
        cm.Calibration(
            c.model_key, ROPE, c.mean, c.basis, {"0.3": c.steps["0.001"]}, {"0.3": c.freq["0.001"]}
        )
    with pytest.raises(cm.CalibrationError, match="rotary dim"):
        cm.Calibration(c.model_key, RopeSpec(1e4, 24), c.mean, c.basis, c.steps, c.freq)


def test_rope_spec_from_hf_configs():
    assert RopeSpec.from_hf_config(
        {"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}, "head_dim": 64}
    ) == RopeSpec(1e5, 64)
    assert (
        RopeSpec.from_hf_config({"rope_theta": 5e5, "hidden_size": 512, "num_attention_heads": 8}).rotary_dim
        == 64
    )
    with pytest.raises(ValueError, match="head size"):
        RopeSpec.from_hf_config({"rope_theta": 1e4})
    with pytest.raises(ValueError, match="llama3"):
        RopeSpec.from_hf_config({"rope_theta": 5e5, "head_dim": 64, "rope_scaling": {"rope_type": "llama3"}})
