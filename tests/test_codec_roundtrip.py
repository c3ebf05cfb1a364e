"""Round trips for every codec and KV dtype; stage-split decoding equals ``decode``."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec import quant
from sgl_remote_kv.codec.base import codec_for_header, decode, default_codec, get_codec
from sgl_remote_kv.codec.format import layer_section, parse_header
from sgl_remote_kv.codec.quant import QuantSpec, to_f32

DTYPES = ["float32", "float16", "bfloat16"]
QUANT_CONFIGS = [
    dict(k_bins="256", v_bins="256", granularity="token"),
    dict(k_bins="64", v_bins="32", granularity="head", k_channel_scale=True),
    dict(k_bins="32@0,16@2", v_bins="32@0,16@1", granularity="token"),
    dict(k_bins="64", v_bins="128", granularity="token", k_outliers=5),
]
TOKENS = 37


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["deflate", "zstd"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_lossless_bit_exact(dtype, method, shuffle):
    fp = synthetic.fingerprint(dtype=dtype)
    k, v = synthetic.kv(fp.layout, TOKENS, seed=1)
    codec = get_codec("lossless", method=method, shuffle=shuffle)
    blob = codec.encode(k, v, fp)
    k2, v2 = codec.decode(blob, fp)
    assert k2.dtype == k.dtype and k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()


def _bound(spec: QuantSpec, layer: int, x: np.ndarray, dtype: str, is_k: bool) -> np.ndarray:
    """Per-element error bound: a/(2m) + scale rounding + output rounding (a = vector max-abs)."""
    mk, mv = spec.levels(layer)
    m = mk if is_k else mv
    xf = np.abs(x)
    if is_k and spec.k_outliers:  # exact channels are excluded from the vector scaling
        flat = xf.reshape(xf.shape[0], -1).copy()
        flat[:, np.argsort(-flat.max(axis=0), kind="stable")[: spec.k_outliers]] = 0
        xf = flat.reshape(xf.shape)
    if is_k and spec.k_channel_scale:
        cs = xf.max(axis=0, keepdims=True)
        a = (xf / np.where(cs > 0, cs, 1)).max(
            axis=2 if spec.granularity == "head" else (1, 2), keepdims=True
        ) * cs
    else:
        a = xf.max(axis=2 if spec.granularity == "head" else (1, 2), keepdims=True)
    out_eps = {"float32": 2**-23, "float16": 2**-10, "bfloat16": 2**-7}[dtype]
    return a * (0.5 / m + 2**-10) * (1 + 2**-8) + (a + 1e-30) * out_eps + 1e-7


def make_codec(name: str, fp, **cfg):
    if name == "quant_rans":
        return synthetic.fitted_rans_codec(fp, **cfg)
    return get_codec(name, **cfg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", QUANT_CONFIGS)
@pytest.mark.parametrize("name", ["quant_deflate", "quant_rans", "cachegen"])
def test_quantized_error_bounded(name, dtype, cfg):
    fp = synthetic.fingerprint(dtype=dtype)
    k, v = synthetic.kv(fp.layout, TOKENS, seed=2)
    codec = make_codec(name, fp, **cfg)
    blob = codec.encode(k, v, fp)
    k2, v2 = codec.decode(blob, fp)
    for x, y, is_k in ((k, k2, True), (v, v2, False)):
        xf, yf = to_f32(x, dtype), to_f32(y, dtype)
        for layer in range(fp.layout.num_layers):
            err = np.abs(xf[layer] - yf[layer])
            bound = _bound(codec.spec, layer, xf[layer], dtype, is_k)
            assert (err <= bound).all(), (layer, is_k, float((err - bound).max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_vectors_decode_to_zero(dtype):
    fp = synthetic.fingerprint(num_layers=2, dtype=dtype)
    k, v = synthetic.kv(fp.layout, 8, seed=3)
    k[:, 3] = 0
    v[1] = 0
    codec = get_codec("quant_deflate", granularity="head", k_channel_scale=True)
    k2, v2 = codec.decode(codec.encode(k, v, fp), fp)
    assert not to_f32(k2[:, 3], dtype).any() and not to_f32(v2[1], dtype).any()
    assert np.isfinite(to_f32(k2, dtype)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_output_rounding_matches_reference(dtype):
    """The numba kernel's hand-written fp32->fp16/bf16 conversion rounds to nearest even."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((1, 64, 1, 64)) * np.logspace(-9, 4, 64)[None, :, None, None]).astype(np.float32)
    fp32 = synthetic.fingerprint(num_layers=1, heads=1, dim=64, dtype="float32")
    codec = get_codec("quant_deflate", granularity="head")
    blob = codec.encode(x, x, fp32)
    hdr = parse_header(blob, fp32)
    scratch = np.empty(codec.scratch_bytes(hdr, 0), np.uint8)
    n = codec.lossless_stage(layer_section(blob, hdr, 0), scratch)
    view = quant.split_layer(codec.spec, scratch[:n], 0, 64, 1, 64)
    ref, ref_v = np.empty((64, 1, 64), np.float32), np.empty((64, 1, 64), np.float32)
    quant.dequant_layer(view, "float32", ref, ref_v)
    half, half_v = np.empty((64, 1, 64), np.uint16), np.empty((64, 1, 64), np.uint16)
    quant.dequant_layer(view, dtype, half, half_v)
    expect = ref.astype(np.float16).view(np.uint16) if dtype == "float16" else synthetic.from_f32(ref, dtype)
    assert np.array_equal(expect, half)
    assert (expect != 0).sum() > 1000  # the data spans subnormals to large values


@pytest.mark.parametrize("name", ["lossless", "quant_deflate", "quant_rans", "cachegen"])
def test_stage_split_equals_decode(name):
    fp = synthetic.fingerprint(dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, TOKENS, seed=5)
    codec = make_codec(name, fp)
    blob = codec.encode(k, v, fp)
    k1, v1 = codec.decode(blob, fp)
    layers = list(codec.decode_layers(blob, fp))
    assert [i for i, _, _ in layers] == list(range(fp.layout.num_layers))
    for i, kl, vl in layers:
        assert np.array_equal(kl, k1[i]) and np.array_equal(vl, v1[i])
    k3, v3 = decode(blob, fp)  # codec chosen from the header
    assert np.array_equal(k3, k1) and np.array_equal(v3, v1)
    assert codec_for_header(parse_header(blob, fp)).params_bytes() == codec.params_bytes()


def test_default_codec_roundtrips():
    fp = synthetic.fingerprint(dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, TOKENS, seed=6)
    codec = default_codec()
    k2, _ = codec.decode(codec.encode(k, v, fp), fp)
    assert k2.shape == k.shape


def test_blob_flags_are_refused_authenticity_is_the_stores():
    """No blob flag is defined (the codec-level MAC is gone: the store frames values with an HMAC bound
    to their key, ``store/security.py``); a blob with any flag set is corrupt, not silently accepted."""
    from sgl_remote_kv.codec.errors import CorruptChunk

    fp = synthetic.fingerprint(dtype="float16")
    k, v = synthetic.kv(fp.layout, 5, seed=7)
    codec = get_codec("quant_deflate")
    blob = bytearray(codec.encode(k, v, fp))
    assert codec.decode(bytes(blob), fp)[0].shape == k.shape
    blob[6] |= 1  # the flags field (u16 after magic + version)
    with pytest.raises(CorruptChunk, match="unknown flags"):
        codec.decode(bytes(blob), fp)


@pytest.mark.parametrize("cfg", QUANT_CONFIGS)
def test_entropy_coders_decode_the_same_codes_as_deflate(cfg):
    """quant_rans, cachegen and quant_deflate differ only in the lossless stage: identical output."""
    fp = synthetic.fingerprint(dtype="float16")
    k, v = synthetic.kv(fp.layout, TOKENS, seed=8)
    ref = get_codec("quant_deflate", **cfg).decode(get_codec("quant_deflate", **cfg).encode(k, v, fp), fp)
    for name in ("quant_rans", "cachegen"):
        codec = make_codec(name, fp, **cfg)
        out = codec.decode(codec.encode(k, v, fp), fp)
        assert np.array_equal(out[0], ref[0]) and np.array_equal(out[1], ref[1]), name


def test_rans_tables_save_load_and_unknown_table(tmp_path):
    from sgl_remote_kv.codec.calibration import tables
    from sgl_remote_kv.codec.errors import ForeignChunk

    fp = synthetic.fingerprint(dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, TOKENS, seed=9)
    codec = synthetic.fitted_rans_codec(fp, k_bins="64", v_bins="32")
    t = codec.tables_for(fp)
    path = t.save(tmp_path / "t.npz")
    blob = codec.encode(k, v, fp)
    expect = codec.decode(blob, fp)
    tables.unregister(t.table_id)
    with pytest.raises(ForeignChunk):
        get_codec("quant_rans", k_bins="64", v_bins="32").decode(blob, fp)
    assert tables.load_dir(tmp_path) == 1
    got = get_codec("quant_rans", k_bins="64", v_bins="32").decode(blob, fp)
    assert np.array_equal(got[0], expect[0]) and np.array_equal(got[1], expect[1])
    assert tables.EntropyTables.load(path).table_id == t.table_id


def test_rans_beats_deflate_and_cachegen_pays_for_tables():
    fp = synthetic.fingerprint(dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, 256, seed=10)
    cfg = dict(k_bins="32", v_bins="32", granularity="head")
    sizes = {
        n: len(make_codec(n, fp, **cfg).encode(k, v, fp)) for n in ("quant_deflate", "quant_rans", "cachegen")
    }
    assert sizes["quant_rans"] < sizes["quant_deflate"], sizes
    assert sizes["quant_rans"] < sizes["cachegen"], sizes


def test_bins_specs_parse_and_merge():
    assert quant.parse_bins("32@0,16@10") == ((0, 32), (10, 16))
    assert quant.per_layer_spec([64, 64, 256, 256, 128]) == "64@0,256@2,128@4"
    spec = QuantSpec.make(quant.per_layer_spec([64, 64, 256, 256, 128]), "9")
    assert [spec.levels(i) for i in range(5)] == [(31, 4), (31, 4), (127, 4), (127, 4), (63, 4)]
    for bad in ("16@3", "32@0,16@0", "2", "300", "x"):
        with pytest.raises(ValueError):
            quant.parse_bins(bad)


def test_hot_loops_are_compiled_nogil():
    from sgl_remote_kv.codec import rans

    for fn in (quant.dequant_rows, rans.decode, rans.encode, rans.build_decode_tables):
        assert fn.targetoptions.get("nogil") is True, fn


@pytest.mark.parametrize("name", ["quant_deflate", "quant_rans", "lossless"])
def test_one_codec_instance_many_threads(name):
    from concurrent.futures import ThreadPoolExecutor

    fp = synthetic.fingerprint(dtype="bfloat16")
    k, v = synthetic.kv(fp.layout, 64, seed=12)
    codec = make_codec(name, fp)
    blobs = [codec.encode(k, v, fp) for _ in range(2)]
    expect = codec.decode(blobs[0], fp)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: codec.decode(blobs[i % 2], fp), range(16)))
    assert all(np.array_equal(o[0], expect[0]) and np.array_equal(o[1], expect[1]) for o in outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_key_channels_are_exact(dtype):
    fp = synthetic.fingerprint(dtype=dtype)
    k, v = synthetic.kv(fp.layout, TOKENS, seed=13)
    codec = get_codec("quant_deflate", k_bins="16", v_bins="16", k_outliers=6)
    k2, _ = codec.decode(codec.encode(k, v, fp), fp)
    for layer in range(fp.layout.num_layers):
        flat = to_f32(k[layer], dtype).reshape(TOKENS, -1)
        top = np.argsort(-np.abs(flat).max(axis=0), kind="stable")[:6]
        assert np.array_equal(k2[layer].reshape(TOKENS, -1)[:, top], k[layer].reshape(TOKENS, -1)[:, top])
    assert get_codec("quant_deflate").params() == get_codec("quant_deflate", k_outliers=0).params()


def test_huffman_only_streams_are_plain_deflate_and_roundtrip():
    """``pack_streams(..., symbols=)`` with Deflate: those parts are Deflate streams any inflater reads (zlib here,
    isal in ``unpack_streams``), the others keep their method, a part that does not shrink is stored."""
    import zlib

    from sgl_remote_kv.codec import lz

    rng = np.random.default_rng(11)
    syms = (128 + np.clip(rng.laplace(0, 6, 70_000), -120, 120)).astype(np.uint8).tobytes()
    parts = [b"prelude" * 40, syms, rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()]
    sec = lz.pack_streams(lz.DEFLATE, 1, parts, symbols=(1, 2))
    out = np.empty(sum(map(len, parts)), np.uint8)
    assert lz.unpack_streams(memoryview(sec), out, lz.DEFLATE) == out.size
    assert out.tobytes() == b"".join(parts)
    _, n, _, _ = lz.SUB.unpack_from(sec, 0)
    heads = [lz.STREAM.unpack_from(sec, lz.SUB.size + i * lz.STREAM.size) for i in range(n)]
    assert [h[0] for h in heads] == [lz.DEFLATE, lz.DEFLATE, lz.RAW]  # random bytes do not shrink
    body = lz.SUB.size + n * lz.STREAM.size + heads[0][2]
    assert zlib.decompress(sec[body : body + heads[1][2]], -15) == syms
    with pytest.raises(ValueError, match="Deflate or zstd"):
        lz.pack_streams(lz.RAW, 3, parts, symbols=(1,))
