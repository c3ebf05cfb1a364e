"""Start-up warm-up of the device writer's kernels (``sgl_remote_kv.kvpool.warmup``), against the strict
CPU double: every kind of write the server can issue runs once through the writer's own code, on scratch
planes (the pool is never written), and host pools do nothing. The Triton compile itself only happens on
a GPU (the GPU suite records its cold-compile time); here the double runs the kernels' torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from calibration_helpers import make_calibration

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.kvpool.warmup import COPIES, TIMED_RUNS, warm_up
from sgl_remote_kv.types import RopeSpec
from tests.strict_device import StrictDevice, StrictKVPool

TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture
def dev():
    d = StrictDevice(delay_s=0.0)
    yield d
    d.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_write_kind_runs_once_on_scratch_planes_never_the_pool(dev, dtype, monkeypatch):
    fp = synthetic.fingerprint(num_layers=3, dtype=dtype)
    lay = fp.layout
    cal = make_calibration(fp, rope=RopeSpec(10000.0, lay.head_dim, "neox"))
    codecs = [
        get_codec("transform", calibration=cal.calib_id.hex(), quality="0.0005"),
        get_codec("quant_deflate", k_bins="64", granularity="head", k_channel_scale=True),
        get_codec("lossless"),  # no device dequant stage: its chunks arrive as KV (the plain write)
    ]
    pool = StrictKVPool(dev, lay, 64, TD[dtype])
    w = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay, 10.0, ops=dev)
    calls = {"scatter": 0, "dequant": 0, "inverse_transform": 0}
    chunks: list[int] = []
    for name in calls:
        real = getattr(dev, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            if _name == "inverse_transform":
                chunks.append(len(a[0]))  # the chunks of one call
            return _real(*a, **kw)

        monkeypatch.setattr(dev, name, spy)
    warm = warm_up(w, codecs, fp)
    assert warm.writes == ("kv", "codes:transform", "codes:quant_deflate")
    assert warm.encodes == ("encode:transform", "encode:quant_deflate")  # the write-back's device encodes
    assert warm.seconds > 0
    # each kind once at 16 tokens, then timed: its first launch at the timed size and TIMED_RUNS more
    timed = 1 + TIMED_RUNS
    assert calls["scatter"] == 3 * (1 + timed)
    assert chunks == [1] + [COPIES] * timed  # one call per layer write, its chunks together
    assert calls["dequant"] >= 2 * (1 + timed)
    assert set(warm.load_bps) == set(warm.writes) and all(r > 0 for r in warm.load_bps.values())
    for layer in range(lay.num_layers):  # strict reads: nothing pending, nothing written
        assert not pool.get_key_buffer(layer).cpu().any() and not pool.get_value_buffer(layer).cpu().any()
    assert w.stats["writes"] == 0  # the real writer wrote nothing
    assert (
        len(w._consts) == 2
    )  # layer 0's transform constants (decode, encode) stay uploaded for the real writer


def test_host_pools_compile_nothing():
    fp = synthetic.fingerprint(num_layers=2, dtype="float32")
    lay = fp.layout
    planes = [torch.zeros(8, lay.num_kv_heads, lay.head_dim) for _ in range(2)]
    w = writer_for(PoolTensors(planes[:1] * 2, planes[1:] * 2), lay)
    warm = warm_up(w, [get_codec("quant_deflate")], fp)
    assert warm.writes == () and warm.seconds == 0.0 and warm.load_bps == {}
    assert not np.any([p.numpy().any() for p in planes])
