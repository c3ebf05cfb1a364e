"""The calibration command and the real model's calibration (``make calibration``, which ``make test``
runs first): its levels hold on a text it never saw, and it beats the previous default's size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec.base import default_codec, get_codec
from sgl_remote_kv.codec.calibration import cli as calibrate
from sgl_remote_kv.codec.calibration import texts as calibration_texts
from sgl_remote_kv.codec.calibration.scorer import Scorer
from sgl_remote_kv.types import KVLayout, ModelFingerprint

HELD_OUT = Path("/usr/share/common-licenses/Apache-2.0")  # not a calibration text


def _bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _fp(model_dir):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return calibrate.fingerprint_for(Path(model_dir), cfg), cfg


def test_cli_refuses_bad_input_with_one_clear_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--model-path", str(tmp_path)])
    assert e.value.code == 2 and "not a model directory" in capsys.readouterr().err


def test_cli_refuses_bad_levels_texts_and_tp(model_dir, tmp_path, capsys):
    for argv, needle in (
        (["--levels", "0.3"], "levels must be among"),
        (["--text", str(tmp_path / "missing.txt")], "calibration text missing"),
        (["--tp", "2"], "do not split over --tp 2"),
    ):
        with pytest.raises(SystemExit) as e:
            calibrate.main(["--model-path", model_dir, *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_if_missing_finds_the_real_calibration(model_dir, capsys):
    assert calibrate.main(["--model-path", model_dir, "--if-missing"]) == 0
    assert "exists for this model" in capsys.readouterr().out


def test_real_calibration_holds_on_a_held_out_text(model_dir):
    if not HELD_OUT.is_file():
        pytest.skip(f"{HELD_OUT} not on this machine")
    fp, cfg = _fp(model_dir)
    cal = cm.find_for(fp, cm.DEFAULT_LEVEL)
    report = json.loads(cal.report)
    assert HELD_OUT.name not in report["texts"]
    assert [r["level"] for r in report["levels"]] == list(cal.levels)
    scorer = Scorer(Path(model_dir))
    text = scorer.text(HELD_OUT.name, HELD_OUT.read_text())
    lay = fp.layout
    bfp = ModelFingerprint(
        fp.architecture, KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, "bfloat16"), fp.weights_id
    )
    k16, v16 = _bf16(text.k), _bf16(text.v)
    sizes, decoded = {}, {}
    codecs = {
        "transform": get_codec(
            "transform", calibration=cal.calib_id.hex(), quality=cm.DEFAULT_LEVEL, entropy="deflate"
        ),
        "quant_deflate": default_codec(),
    }
    for name, codec in codecs.items():
        ks, vs, n = [], [], 0
        for s in range(0, k16.shape[1], 256):
            blob = codec.encode(
                np.ascontiguousarray(k16[:, s : s + 256]),
                np.ascontiguousarray(v16[:, s : s + 256]),
                bfp,
                start=s,
            )
            n += len(blob)
            k, v = codec.decode(blob, bfp)
            ks.append(k)
            vs.append(v)
        sizes[name] = n
        decoded[name] = [
            (np.concatenate(x, axis=1).astype(np.uint32) << 16).view(np.float32) for x in (ks, vs)
        ]
    kl, top1 = scorer.kl(text, *decoded["transform"])
    assert kl <= 0.001 and top1 >= 0.95, (kl, top1)
    assert sizes["transform"] < sizes["quant_deflate"] * 0.9, sizes


@pytest.mark.slow
def test_the_command_fits_a_calibration_end_to_end(model_dir, tmp_path):
    """~3 min: one text, one level, into a directory of its own; the result loads and codes."""
    text = calibration_texts.SOURCES["gpl3"].path
    assert (
        calibrate.main(
            ["--model-path", model_dir, "--text", str(text), "--levels", "0.01", "--out", str(tmp_path)]
        )
        == 0
    )
    (path,) = tmp_path.glob("*.npz")
    cal = cm.Calibration.load(path)
    assert cal.levels == ("0.01",) and cal.model_key == cm.model_key(_fp(model_dir)[0])
    assert (
        calibrate.main(
            [
                "--model-path",
                model_dir,
                "--text",
                str(text),
                "--levels",
                "0.01",
                "--out",
                str(tmp_path),
                "--if-missing",
            ]
        )
        == 0
    )
    assert len(list(tmp_path.glob("*.npz"))) == 1
