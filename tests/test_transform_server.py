"""A real ``--remote-kv dpu --remote-kv-codec transform`` server with the model's real calibration
(``make calibration``, which ``make test`` runs first): remote hits are served by the transform codec
through the DPU data plane, and ``/metrics`` says which quality level served them; also with the data
plane shipping codes that the server's KV writer inverse-transforms (``--remote-kv-dpu-output codes``,
here on the CPU pool), same tokens; and with the trellis quantizer (``--remote-kv-quantizer trellis``)."""

from __future__ import annotations

import pytest

from tests.fixtures.faults import gen, make_case, metric, wait_written
from tests.fixtures.remote_kv_server import CHUNK, flush_cache, remote_kv_server, storage_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # ~40 s; the default path is in test_exact_kv_server


@pytest.mark.parametrize("output,quantizer", [("auto", "scalar"), ("codes", "scalar"), ("codes", "trellis")])
def test_transform_codec_serves_remote_hits_at_its_level(model_dir, tmp_path, output, quantizer):
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from sgl_remote_kv.codec import calibration
    from sgl_remote_kv.codec.calibration.cli import fingerprint_for

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    calibration.find_for(fingerprint_for(Path(model_dir), cfg), "0.002")  # `make calibration` ran
    tok = AutoTokenizer.from_pretrained(model_dir)
    extra = (
        "--remote-kv-policy-margin",
        "1e9",
        "--remote-kv-quality",
        "0.002",
        "--remote-kv-dpu-output",
        output,
        "--remote-kv-quantizer",
        quantizer,
    )
    with remote_kv_server(model_dir, f"file://{tmp_path}/store", *extra, codec="transform") as srv:
        case = make_case(tok, "transform-codec")
        flush_cache(srv)
        before = metric(srv, "written_chunks")
        cold = gen(srv, case.ids)
        assert storage_tokens(cold) == 0
        wait_written(srv, before, case.chunks)
        flush_cache(srv)
        warm = gen(srv, case.ids)
        assert storage_tokens(warm) == case.chunks * CHUNK
        assert metric(srv, "hit_tokens", codec="transform") >= case.chunks * CHUNK
        assert metric(srv, "hit_tokens_by_quality", quality="0.002") >= case.chunks * CHUNK
        assert metric(srv, "hit_tokens_by_quality", quality="0.001") == 0
        assert len(warm["output_ids"]) == len(cold["output_ids"]) == 8
        wrote = "codes" if output == "codes" else "kv"  # a CPU pool: auto = kv
        assert metric(srv, "dataplane_write_layers", output=wrote) > 0
        assert metric(srv, "dataplane_write_layers", output="codes" if wrote == "kv" else "kv") == 0
