"""The transform codec's trellis-coded quantizer (``quantizer=trellis``): the encoder's Viterbi search is
the optimum of its own cost, the decoder's replay gives the values the encoder chose, every decode path
(CPU stage, the GPU kernel's reference, the data plane's codes) reads the same codes, and bad sections
are chunk errors."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_codec_transform import D, H, L, T, fp, kv, make_calibration

from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec import transform_ops as ops
from sgl_remote_kv.codec import trellis
from sgl_remote_kv.codec.base import decode, get_codec
from sgl_remote_kv.codec.errors import ChunkError, CorruptChunk


@pytest.fixture
def cal():
    c = make_calibration()
    yield c
    cm.unregister(c.calib_id)


@pytest.fixture
def fine_cal():
    """Steps of 0.01 token RMS: an outlier's k exceeds the symbol range (escapes)."""
    c = make_calibration(step=0.01)
    yield c
    cm.unregister(c.calib_id)


def _codec(cal, quantizer="trellis", **kw):
    return get_codec("transform", calibration=cal.calib_id.hex(), quantizer=quantizer, **kw)


def _candidates(x: float, state: int, delta: float) -> list[int]:
    if state < 2:
        b = int(np.floor(x / (2 * delta)))
        return [b, b + 1, 0]
    b = int(np.floor((abs(x) / delta + 1) / 2))
    sg = 1 if x >= 0 else -1
    return [sg * b, sg * (b + 1), 0]


def _recon(k: int, state: int) -> int:
    return 2 * k - (int(np.sign(k)) if state >= 2 else 0)


def _bits(u: np.ndarray, delta: float) -> dict:
    cnt = np.full(256, 0.5)
    for x in u:
        k0 = int(np.rint(x / (2 * delta)))
        if -127 <= k0 <= 127:
            cnt[k0 + 128] += 1
    return -np.log2(cnt / cnt.sum())


def _path_cost(u, ks, delta, lam, bits):
    state, cost = 0, 0.0
    for x, k in zip(u, ks, strict=True):
        cost += (x - _recon(k, state) * delta) ** 2 + lam * bits[k + 128]
        state = trellis.NEXT[state, k & 1]
    return cost


@pytest.mark.parametrize("seed", range(4))
def test_viterbi_finds_the_cheapest_path_of_its_own_cost(seed):
    """Every path the candidate sets allow, enumerated (3^7), against the kernel's choice."""
    rng = np.random.default_rng(seed)
    u = (rng.standard_normal(7) * 2.5).astype(np.float32)
    delta, lam = trellis.DELTA, 0.3
    bits = _bits(u.astype(np.float64), delta)
    best = np.inf
    for choice in itertools.product(range(3), repeat=len(u)):
        state, ks = 0, []
        for x, i in zip(u, choice, strict=True):
            k = _candidates(float(x), state, delta)[i]
            ks.append(k)
            state = trellis.NEXT[state, k & 1]
        best = min(best, _path_cost(u.astype(np.float64), ks, delta, lam, bits))
    sym, esc = np.empty((1, len(u)), np.uint8), np.empty(8, np.int16)
    n = trellis.quantize(
        u.reshape(1, -1, 1), np.ones((1, 1), np.float32), np.ones(len(u), np.float32), delta, lam, sym, esc
    )
    assert n == 0
    ks = [int(s) - ops.ZERO for s in sym[0]]
    assert _path_cost(u.astype(np.float64), ks, delta, lam, bits) == pytest.approx(best, rel=1e-12)
    # the decoder's replay reconstructs the values the encoder chose
    out, out_esc = np.empty_like(sym), np.empty(8, np.int16)
    assert trellis.codes(sym, esc[:0], out, out_esc) == 0
    state, want = 0, []
    for k in ks:
        want.append(_recon(k, state))
        state = trellis.NEXT[state, k & 1]
    assert [int(s) - ops.ZERO for s in out[0]] == want


def test_trellis_is_closer_than_rint_at_its_grid_and_escapes_large_values():
    """On Gaussian values the trellis at DELTA = 0.6 steps (lambda 0) has a lower mean squared error than rint
    at 1.2 steps, the spacing of each of its two quantizers (TCQ's granular gain, ~1 dB); a value beyond
    the symbol range is escaped and replayed exactly."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal((64, 256)).astype(np.float32) * 6
    u[5, 7] = 700.0
    delta = trellis.DELTA
    sym, esc = np.empty((64, 256), np.uint8), np.empty(64 * 256, np.int16)
    n = trellis.quantize(
        u[None].transpose(0, 2, 1).copy(),
        np.ones((1, 64), np.float32),
        np.ones(256, np.float32),
        delta,
        0.0,
        sym,
        esc,
    )
    assert n >= 1 and sym[5, 7] == ops.ESC
    out, out_esc = np.empty_like(sym), np.empty(64 * 256, np.int16)
    m = trellis.codes(sym, esc[:n], out, out_esc)
    codes = out.astype(np.int64) - ops.ZERO
    codes[out == ops.ESC] = out_esc[:m]
    mse_trellis = np.mean((u - codes * delta) ** 2)
    mse_rint = np.mean((u - np.rint(u / (2 * delta)) * 2 * delta) ** 2)
    assert mse_trellis < 0.85 * mse_rint, (mse_trellis, mse_rint)
    assert abs(codes[5, 7] * delta - 700.0) <= 2 * delta


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roundtrip_error_is_bounded_and_the_codec_is_its_own_key_namespace(cal, dtype):
    codec, scalar = _codec(cal), _codec(cal, "scalar")
    assert codec.params()["quantizer"] == "trellis" and "quantizer" not in scalar.params()
    assert codec.params_bytes() != scalar.params_bytes()
    start = 300
    k, v = kv(dtype, start)
    blob = codec.encode(k, v, fp(dtype), start=start)
    k2, v2 = decode(blob, fp(dtype))  # the codec chosen from the header: its params name the quantizer
    from test_codec_transform import _f32

    for a, b in ((k, k2), (v, v2)):
        x, y = _f32(a), _f32(b)
        rms = np.sqrt(np.mean(np.square(x - cal.mean[:, 0].reshape(L, 1, H, D)), axis=(2, 3)))
        err = np.sqrt(np.sum(np.square(x - y), axis=3))
        bound = np.sqrt(D) * 0.05 * 1.5 * rms[:, :, None] * 1.3 + 0.02 * np.abs(x).max()
        assert np.all(err <= bound), float((err / bound).max())
    with pytest.raises(ChunkError):  # a scalar decoder refuses the trellis chunk (its params differ)
        scalar.decode(blob, fp(dtype))


def test_trellis_needs_deflate_or_zstd(cal):
    for entropy in ("rans", "auto"):
        with pytest.raises(ValueError, match="deflate', 'zstd'\\) only"):
            _codec(cal, entropy=entropy)
    k, v = kv("bfloat16", 300)
    f = fp("bfloat16")
    got = [decode(_codec(cal, entropy=e).encode(k, v, f, start=300), f) for e in ("deflate", "zstd")]
    assert all(np.array_equal(a, b) for a, b in zip(got[0], got[1], strict=True))  # same codes either way
    with pytest.raises(ValueError, match="quantizer must be"):
        _codec(cal, "vector")


def _outlier_kv():
    """A token whose energy sits in one component (|k| > 127 in every layer): escapes."""
    k, v = kv("float32", 0)
    v[:, 5] = 0.0
    v[:, 5, 0, 3] = 40.0
    return k, v


def _section_with(codec, blob, hdr, edit):
    """Layer 0 decoded, edited by ``edit(buf)``, then viewed."""
    scratch = np.empty(codec.scratch_bytes(hdr, 0), np.uint8)
    from sgl_remote_kv.codec.format import layer_section

    n = codec.lossless_stage(layer_section(blob, hdr, 0), scratch)
    buf = scratch[:n].copy()
    edit(buf)
    return codec.view(hdr, 0, buf)


def test_sections_that_lie_about_escapes_or_overflow_are_corrupt(fine_cal):
    codec = _codec(fine_cal)
    k, v = _outlier_kv()
    blob = codec.encode(k, v, fp())
    hdr = codec.parse(blob, fp())
    vw = _section_with(codec, blob, hdr, lambda b: None)
    assert vw.escapes_consistent() and vw.esc.size > 0
    t_n, c_n = T, H * D

    def drop_escape(buf):  # an escape symbol turned into an ordinary one: one escape left over
        syms = buf[-2 * t_n * c_n :]
        i = int(np.flatnonzero(syms == ops.ESC)[0])
        syms[i] = ops.ZERO

    with pytest.raises(CorruptChunk, match="escape count"):  # the view counts them (every decode path)
        _section_with(codec, blob, hdr, drop_escape)
    good = _section_with(codec, blob, hdr, lambda b: None)
    bad = dataclasses.replace(good, esc=good.esc[1:], nk=good.nk - 1 if good.nk else 0)
    assert bad.trellis and not bad.escapes_consistent()  # what the device writer refuses before a launch
    with pytest.raises(CorruptChunk, match="trellis"):
        bad.replayed()  # the host's replay checks too

    def huge_escape(buf):  # an escaped k whose code 2k - sign(k) does not fit int16
        from sgl_remote_kv.codec.transform import PRE

        pre = PRE.unpack_from(buf, 0)
        esc_at = PRE.size + ops.scale_bytes(pre[3], t_n)
        buf[esc_at : esc_at + 2] = np.array([32767], np.int16).view(np.uint8)

    with pytest.raises(CorruptChunk, match="trellis"):  # beyond what the encoder writes: refused at the view
        _section_with(codec, blob, hdr, huge_escape)


def test_every_decode_path_reads_the_same_codes(fine_cal):
    """The CPU dequant stage and the GPU kernel's torch reference (``kernels.transform``), from one trellis
    view: the view hands both the k as coded and the scales times DELTA; the host replays the k into codes
    (``replayed``), the device does (``trellis_codes``), and both give the same codes."""
    import torch
    from sgl_remote_kv.kernels.transform import inverse_reference, resolve_escapes, trellis_codes

    from sgl_remote_kv.codec.transform_ops import rope_tables

    cal, codec = fine_cal, _codec(fine_cal)
    k, v = _outlier_kv()
    blob = codec.encode(k, v, fp())
    hdr = codec.parse(blob, fp())
    scratch = np.empty(codec.scratch_bytes(hdr, 1), np.uint8)
    vw = codec.codes_stage(blob, hdr, 1, scratch)
    assert vw.esc.size > 0 and vw.escapes_consistent()
    want_k, want_v = np.empty_like(k[0]), np.empty_like(v[0])
    vw.dequant_into("float32", want_k, want_v)
    np.testing.assert_array_equal(want_k, decode(blob, fp())[0][1])
    consts = codec.device_consts(1, vw.group, vw.groups).to(torch.from_numpy)
    cos, sin = (torch.from_numpy(a.copy()) for a in rope_tables(cal.rope, vw.start, vw.tokens))
    out = torch.empty((2, T, H * D), dtype=torch.float32)
    assert vw.trellis
    q = trellis_codes(resolve_escapes(torch.from_numpy(vw.sym.copy()), torch.from_numpy(vw.esc.copy())))
    r = vw.replayed()
    assert not r.trellis and r.escapes_consistent()
    assert torch.equal(q, resolve_escapes(torch.from_numpy(r.sym), torch.from_numpy(r.esc)))
    inverse_reference(q, torch.from_numpy(vw.scales.copy()), cos, sin, consts, D, codec.rope_style, True, out)
    for i, want in enumerate((want_k, want_v)):
        got = out[i].numpy().reshape(want.shape)
        rows = slice(vw.n_sink, None)  # sinks are copied as raw bytes on both paths
        assert np.abs(got[rows] - want[rows]).max() <= 1e-4 * np.abs(want).max()


def test_the_trellis_is_the_default_and_scalar_keeps_its_keys(cal):
    """Without the flag a server writes the trellis in every mode, with Deflate where a data plane decodes and
    zstd with ``inproc`` (the host's cheaper entropy stage; the trellis does not code with rANS);
    ``--remote-kv-quantizer scalar`` writes what versions before the trellis wrote (rANS with ``inproc``, no
    quantizer param: the same keys); a blob's params without a quantizer decode as scalar;
    ``--remote-kv-entropy`` names the stage whatever the mode."""
    from test_codec_transform import ROPE
    from test_config import _parser

    from sgl_remote_kv.config import RemoteKVConfig
    from sgl_remote_kv.fetch import paths

    def written(*flags):
        cfg = RemoteKVConfig.from_namespace(_parser().parse_args(list(flags)))
        assert RemoteKVConfig.from_json(cfg.to_json()) == cfg
        return paths.write_codec(cfg, fp(), ROPE)

    for mode, entropy in (("dpu", "deflate"), ("auto", "deflate"), ("inproc", "zstd")):
        for flags in ((), ("--remote-kv-quantizer", "trellis"), ("--remote-kv-entropy", "default")):
            codec = written("--remote-kv", mode, *flags)
            assert (codec.name, codec.entropy, codec.params()["quantizer"]) == (
                "transform",
                entropy,
                "trellis",
            )
    for mode, entropy in (("dpu", "deflate"), ("inproc", "rans")):
        scalar = written("--remote-kv", mode, "--remote-kv-quantizer", "scalar")
        assert scalar.entropy == entropy and "quantizer" not in scalar.params()
        assert get_codec("transform", **scalar.params()).quantizer == "scalar"
    with pytest.raises(ValueError, match="--remote-kv-quantizer"):
        RemoteKVConfig(mode="dpu", quantizer="vector")
    for mode in ("dpu", "inproc"):  # --remote-kv-entropy: the stage named, whatever the mode
        for quantizer in ("trellis", "scalar"):
            for entropy in ("zstd", "deflate"):
                codec = written(
                    "--remote-kv", mode, "--remote-kv-quantizer", quantizer, "--remote-kv-entropy", entropy
                )
                assert codec.entropy == entropy and codec.params()["entropy"] == entropy
    assert (
        written(
            "--remote-kv", "dpu", "--remote-kv-quantizer", "scalar", "--remote-kv-entropy", "rans"
        ).entropy
        == "rans"
    )
    with pytest.raises(ValueError, match="needs --remote-kv-quantizer scalar"):
        RemoteKVConfig(mode="dpu", entropy="rans")
    with pytest.raises(ValueError, match="--remote-kv-entropy must be"):
        RemoteKVConfig(mode="dpu", entropy="lzma")


def test_values_beyond_the_code_range_fail_to_encode_cleanly():
    """A value no k can code (or a NaN) is an error, not a silent 0; too many escapes are one too (the
    encoder then raises, and the chunk is not written)."""
    sym, esc = np.empty((1, 4), np.uint8), np.empty(4, np.int16)
    ones = np.ones(4, np.float32)
    for bad in (1e5, float("nan")):
        y = np.array([[[1.0], [bad], [2.0], [0.5]]], np.float32)
        assert trellis.quantize(y, np.ones((1, 1), np.float32), ones, trellis.DELTA, 0.1, sym, esc) == -2
    y = np.full((1, 4, 1), 500.0, np.float32)
    assert trellis.quantize(y, np.ones((1, 1), np.float32), ones, trellis.DELTA, 0.1, sym, esc[:2]) == -1
    c = make_calibration(levels=("0.0005",), step=0.001, seed=3)
    try:
        with pytest.raises(ValueError, match="too far"):
            _codec(c).encode(*kv(scale=1.0), fp())
    finally:
        cm.unregister(c.calib_id)


def _codes_reference(sym, esc, out_sym, out_esc):
    """``trellis.codes`` as first written (the k, then the state machine from ``NEXT``, then the codes)."""
    c_n, t_n = sym.shape
    k = sym.astype(np.int64) - ops.ZERO
    at = sym == ops.ESC
    if at.sum() != esc.size:
        return -1
    k[at] = esc
    st = np.zeros(c_n, np.int64)
    r = np.empty_like(k)
    for t in range(t_n):
        r[:, t] = 2 * k[:, t] - (st >> 1) * np.sign(k[:, t])
        st = trellis.NEXT[st, k[:, t] & 1]
    n = 0
    for c in range(c_n):
        for t in range(t_n):
            if -127 <= r[c, t] <= 127:
                out_sym[c, t] = r[c, t] + ops.ZERO
            else:
                if not -32768 <= r[c, t] <= 32767:
                    return -2
                out_esc[n] = r[c, t]
                n += 1
                out_sym[c, t] = ops.ESC
    return n


def test_the_state_table_in_closed_form():
    """``codes`` replays ``NEXT`` as b0' = b1, b1' = b0 ^ parity (state = 2 b1 + b0)."""
    for st in range(4):
        for p in range(2):
            assert trellis.NEXT[st, p] == 2 * (p ^ (st & 1)) + (st >> 1)


@pytest.mark.parametrize("t_n", [1, 7, 8, 64, 100, 256])
def test_replay_matches_the_state_machine_value_for_value(t_n):
    """The fast replay (closed form, 8 tokens a word where T allows, components with a |k| >= 64 or an
    escape value by value) against the state machine, with escaped k, codes beyond the symbol range, rows
    that are not contiguous, and sections whose escapes do not match or overflow."""
    rng = np.random.default_rng(t_n)
    c_n = 24
    for spread in (3, 40, 90):
        k = np.clip(np.rint(rng.standard_normal((c_n, t_n)) * spread), -127, 127).astype(np.int64)
        big = rng.random((c_n, t_n)) < 0.03  # escaped k: beyond the symbols, or any value
        k[big] = rng.integers(-16383, 16384, big.sum())
        sym = np.where(big, ops.ESC, k + ops.ZERO).astype(np.uint8)
        esc = k[big].astype(np.int16)
        for layout in ("c", "strided"):
            s = sym if layout == "c" else np.repeat(sym, 2, axis=1)[:, ::2]
            want_sym, want_esc = np.empty((c_n, t_n), np.uint8), np.empty(c_n * t_n, np.int16)
            n = _codes_reference(s, esc, want_sym, want_esc)
            got_sym, got_esc = np.empty((c_n, t_n), np.uint8), np.empty(c_n * t_n, np.int16)
            assert trellis.codes(s, esc, got_sym, got_esc) == n >= 0
            np.testing.assert_array_equal(got_sym, want_sym)
            np.testing.assert_array_equal(got_esc[:n], want_esc[:n])
        if esc.size:  # one escape missing / left over
            assert trellis.codes(sym, esc[:-1], got_sym, got_esc) == -1
            assert trellis.codes(sym, np.concatenate([esc, esc[:1]]), got_sym, got_esc) == -1
    if t_n > 1:  # an escaped k whose code 2k does not fit int16
        sym = np.full((1, t_n), ops.ZERO, np.uint8)  # k = 0 keeps state 0: Q0 codes 2k
        sym[0, 1] = ops.ESC
        out_sym, out_esc = np.empty_like(sym), np.empty(t_n, np.int16)
        assert _codes_reference(sym, np.array([16384], np.int16), out_sym, out_esc) == -2
        assert trellis.codes(sym, np.array([16384], np.int16), out_sym, out_esc) == -2
