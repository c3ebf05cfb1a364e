"""``benchmarks.e2e_derive``: the probe rows' ratios, including the wire floor of a remote hit."""

from __future__ import annotations

import pytest

from benchmarks.e2e_derive import probe_vs_recompute


def _probe(latency: float, local: float | None, floor: float | None, tokens: int = 1024) -> dict:
    return {
        "latency_s": latency,
        "recompute_ref_s": 2.0,
        "local_hit_s": local,
        "wire_floor_s": floor,
        "remote_hit_tokens": tokens,
        "paths": {"dpu": 1.0} if tokens else {"recompute": 1.0},
    }


def test_remote_over_local_and_its_wire_floor() -> None:
    result = {
        "configs": {
            "dpu": {
                "runs": [
                    {"rate_mbit": 640.0, "probe": [_probe(0.3, 0.1, 0.1), _probe(0.5, 0.1, 0.3)]},
                    {"rate_mbit": 40.0, "probe": [_probe(1.6, None, None, tokens=0)]},
                ]
            },
            "recompute": {"status": "skipped"},
        }
    }
    got = probe_vs_recompute(result)["dpu"]
    fast = got["640.0"]
    assert fast["fetched"] == 2
    assert fast["median_remote_over_local_hit"] == pytest.approx((3.0 + 5.0) / 2)
    # local + floor over local: 2.0 and 4.0; the remote hit over local + floor: 1.5 and 1.25
    assert fast["median_wire_floor_over_local_hit"] == pytest.approx(3.0)
    assert fast["median_remote_over_local_plus_wire"] == pytest.approx(1.375)
    slow = got["40.0"]  # recomputed by the policy: no remote hit, so no local-hit ratios
    assert slow["fetched"] == 0 and slow["median_wire_floor_over_local_hit"] is None
    assert slow["median_ratio"] == pytest.approx(0.8)
