"""The first remote hit of a fresh server does not pay for loading the codec's kernels.

Measured before the fix (docs/RESULTS.md): a fresh server's first DPU fetch took ~0.43 s against ~0.1 s for
the next ones, the difference being numba kernels loaded (from their disk cache) on the first decode. Now
the host tells the data plane its codec and model (``--warm``, a typed ``protocol.Warmup``) and it decodes
one synthetic chunk before it answers its first ping, so ``DpuClient.start`` returns a warm data plane;
the in-process path warms up the same way when it is built. What is checked here (no timings): the
warm-up reaches the kernels a decode uses, the data plane logs it before serving, bad ``--warm`` is a
clean exit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from dpu_helpers import CHUNK, FP, codecs
from sgl_remote_kv.dpu.__main__ import build_parser, config_from_args

from sgl_remote_kv.codec.base import default_codec
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

_FRESH = """
from sgl_remote_kv.codec import quant
from sgl_remote_kv.codec.base import default_codec
from sgl_remote_kv.types import KVLayout, ModelFingerprint
assert not quant.dequant_rows.signatures, "compiled before the warm-up"
default_codec().warm_up(ModelFingerprint("LlamaForCausalLM", KVLayout(4, 2, 64, "float32"), "w"))
print(len(quant.dequant_rows.signatures))
"""


def test_warm_up_loads_the_decode_kernels_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 1


def test_the_data_plane_is_warm_when_the_client_starts(tmp_path, capfd):
    codec = default_codec()
    spec = DataPlaneSettings(
        workers=(1, 1, 1, 1),
        layer_group=2,
        slots=2,
        slot_bytes=2 * chunk_bytes(FP.layout, CHUNK),
        log_level="INFO",
    )
    cfg = DpuClientConfig(
        f"file://{tmp_path / 'store'}",
        dest_slots=2,
        dest_slot_bytes=chunk_bytes(FP.layout, CHUNK),
        process=spec,
    )
    c = DpuClient(cfg, FP, codec)
    c.start()
    c.close()
    log = capfd.readouterr().err  # the data plane logs to its host's stderr
    (start,) = [ln for ln in log.splitlines() if " dpu[" in ln and "serving on" in ln]
    assert f"codec {codec.name} warmed up in" in start, log  # warmed up before it served


def test_bad_warm_flag_is_a_clean_exit():
    args = ["--endpoint", "ipc:///tmp/x", "--store", "file:///tmp/x"]
    with pytest.raises(SystemExit, match="bad --warm"):
        config_from_args(build_parser().parse_args([*args, "--warm", '{"codec": "lossless"}']))
    good = P.Warmup(
        "lossless",
        codecs()["lossless"].params_bytes().decode(),
        P.Fingerprint(FP.architecture, P.Layout(2, 1, 8, "float32"), FP.weights_id, 0, 1, FP.digest()),
    )
    cfg = config_from_args(build_parser().parse_args([*args, "--warm", P.encode_warmup(good)]))
    assert cfg.warm == good
