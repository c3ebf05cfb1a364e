"""End to end, layer-wise pipelining (``--remote-kv-layerwise``): real CPU SGLang servers, real SmolLM2
(float32), real embedded store, lossless codec; the in-process fetch path (``--remote-kv nvdec`` with a
non-hevc codec falls back to it) and the DPU path (``--remote-kv dpu``).

One long prompt: a cold run (the baseline) writes it back; ``/flush_cache`` empties the local cache and
the same prompt is a remote hit *without* pipelining; a second server with ``--remote-kv-layerwise``
serves it as a remote hit admitted early (``layerwise_admissions``). One output token (TTFT): both
remote answers must equal the baseline's token and its logprob (a wrong layer of KV would move it); the
TTFTs and the time spent in waiting_for_KV are printed (the measurement for docs/INTEGRATION.md).
"""

from __future__ import annotations

import time

import pytest

from tests.fixtures.faults import wait_written
from tests.fixtures.remote_kv_server import (
    CHUNK,
    flush_cache,
    kill_data_plane_during,
    metrics,
    post,
    remote_kv_server,
    storage_tokens,
)

LW_ADMITTED = "sglang:remote_kv_layerwise_admissions_total"
LW_FALLBACK = 'sglang:remote_kv_failures_total{kind="layerwise_fallback"}'
ALWAYS_FETCH = ("--remote-kv-policy-margin", "1e9")
RUNS = 4  # remote hits per server; the first warms the long-prefix path

pytestmark = pytest.mark.e2e

DOC = " ".join(
    f"Section {i}: the quick brown fox number {i} jumps over the lazy dog and studies topic {i * 7 % 13}."
    for i in range(64)
)
ARGS = ("--chunked-prefill-size", "4096")


def _first_token(srv, ids: list[int]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    payload = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True,
    }
    out = post(srv.base_url + "/generate", payload)
    return out, time.perf_counter() - t0


def _logprob(out: dict) -> float:
    return float(out["meta_info"]["output_token_logprobs"][0][0])


def _kv_wait(srv) -> float:
    return metrics(srv).get("sglang:remote_kv_kv_wait_seconds_sum", 0.0)


@pytest.mark.slow  # two servers, ~70 s: the in-process path's TTFT table; its installs: test_integration_layerwise.py
def test_layerwise_remote_hit_exact_and_ttft(model_dir, tmp_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(DOC + "\nWhat does the fox do?", add_special_tokens=False)[
        "input_ids"
    ]
    usable = (len(ids) - 1) // CHUNK * CHUNK
    store = f"file://{tmp_path / 'store'}"
    with remote_kv_server(model_dir, store, *ARGS, mode="nvdec") as s1:
        base, t_cold = _first_token(s1, ids)
        wait_written(s1, 0, usable // CHUNK, 180)
        offs = []
        for _ in range(2):  # the 2nd one is the measurement (the 1st warms the long-prefix path)
            flush_cache(s1)
            offs.append(_first_token(s1, ids))
        w_off = _kv_wait(s1)
    with remote_kv_server(model_dir, store, *ARGS, "--remote-kv-layerwise", mode="nvdec") as s2:
        ons = []
        for _ in range(2):
            flush_cache(s2)
            ons.append(_first_token(s2, ids))
        w_on = _kv_wait(s2)
        m = metrics(s2)
    for out, _ in offs + ons:
        assert storage_tokens(out) == usable and out["output_ids"] == base["output_ids"]
        assert abs(_logprob(out) - _logprob(base)) < 1e-3
    assert m.get("sglang:remote_kv_layerwise_admissions_total", 0) == 2, m
    assert m.get('sglang:remote_kv_failures_total{kind="layerwise_fallback"}', 0) == 0
    stalled = m.get("sglang:remote_kv_layerwise_wait_seconds_total", 0)
    print(
        f"\n{len(ids)}-token prompt, remote hit {usable} tokens, TTFT: cold {t_cold:.2f} s; remote hit "
        f"without layer-wise {offs[0][1]:.2f} / {offs[1][1]:.2f} s (waiting_for_KV total {w_off:.2f} s), "
        f"with layer-wise {ons[0][1]:.2f} / {ons[1][1]:.2f} s (waiting_for_KV total {w_on:.2f} s, "
        f"forward waited on layers {stalled:.2f} s)"
    )


def _remote_hits(srv, ids: list[int], n: int = 2) -> list[tuple[dict, float]]:
    out = []
    for _ in range(n):
        flush_cache(srv)
        out.append(_first_token(srv, ids))
    return out


def _kill_data_plane_after_admission(srv, ids: list[int]) -> dict:
    """Send ``ids``; SIGKILL the data plane as soon as the request was admitted at "verified" (its
    DMA is slowed down, so layers are still missing); return the response."""
    return kill_data_plane_during(
        srv, lambda: _first_token(srv, ids)[0], LW_ADMITTED, wait_s=120, poll_s=0.03
    )


def _prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok(DOC + "\nWhat does the fox do?", add_special_tokens=False)["input_ids"]


def _assert_exact(out: dict, base: dict, usable: int) -> None:
    assert storage_tokens(out) == usable and out["output_ids"] == base["output_ids"]
    assert abs(_logprob(out) - _logprob(base)) < 1e-3


# make test-slow (default run kept near 30 min): ~70 s; data-plane SIGKILLs: test_dpu_process, test_faults_server
@pytest.mark.slow
def test_dpu_layerwise_exact_survives_data_plane_kill(model_dir, tmp_path):
    """``--remote-kv dpu --remote-kv-layerwise``, one server (DMA slowed down so layers are still
    missing at admission): a remote hit admitted at "verified" gives the cold run's token and logprob;
    SIGKILL of the data plane after the next admission: still exact (the host decodes the rest from its
    blob copies), and the server keeps serving (a new data plane). TTFT: ``test_dpu_layerwise_ttft``."""
    ids = _prompt_ids(model_dir)
    usable = (len(ids) - 1) // CHUNK * CHUNK
    store = f"file://{tmp_path / 'store'}"
    slow_dma = ("--remote-kv-layerwise", "--remote-kv-dpu-args", "--dma-delay-s 0.05")
    with remote_kv_server(model_dir, store, *ARGS, *ALWAYS_FETCH, *slow_dma, mode="dpu") as srv:
        base, _ = _first_token(srv, ids)  # cold: recomputed, written back
        wait_written(srv, 0, usable // CHUNK, 180)
        ((hit, _),) = _remote_hits(srv, ids, 1)
        m = metrics(srv)
        killed = _kill_data_plane_after_admission(srv, ids)
        m2 = metrics(srv)
        again, _ = _first_token(srv, ids)  # the server is still up (and has a new data plane)
    _assert_exact(hit, base, usable)
    assert m.get(LW_ADMITTED, 0) == 1 and m.get(LW_FALLBACK, 0) == 0, m
    _assert_exact(killed, base, usable)
    assert m2.get(LW_ADMITTED, 0) == 2 and m2.get(LW_FALLBACK, 0) == 1, m2
    assert again["output_ids"] == base["output_ids"]


@pytest.mark.slow  # two servers, 2 x RUNS remote hits: ~5 min on 2 cores
def test_dpu_layerwise_ttft(model_dir, tmp_path):
    """TTFT of remote hits on the DPU path with layer-wise off / on (every answer exact); prints the
    table of docs/INTEGRATION.md."""
    ids = _prompt_ids(model_dir)
    usable = (len(ids) - 1) // CHUNK * CHUNK
    store = f"file://{tmp_path / 'store'}"
    with remote_kv_server(model_dir, store, *ARGS, *ALWAYS_FETCH, mode="dpu") as s1:
        base, t_cold = _first_token(s1, ids)
        wait_written(s1, 0, usable // CHUNK, 180)
        offs = _remote_hits(s1, ids, RUNS)
    with remote_kv_server(model_dir, store, *ARGS, *ALWAYS_FETCH, "--remote-kv-layerwise", mode="dpu") as s2:
        ons = _remote_hits(s2, ids, RUNS)
        m = metrics(s2)
    for out, _ in offs + ons:
        _assert_exact(out, base, usable)
    assert m.get(LW_ADMITTED, 0) == RUNS and m.get(LW_FALLBACK, 0) == 0, m
    waited = m.get("sglang:remote_kv_layerwise_wait_seconds_total", 0)
    print(
        f"\nDPU path, {len(ids)}-token prompt, remote hit {usable} tokens, first token only; cold {t_cold:.2f} s"
    )
    print("| run | TTFT layer-wise off | TTFT layer-wise on | ratio on/off |")
    print("|---|---|---|---|")
    for i, ((_, off), (_, on)) in enumerate(zip(offs, ons, strict=True)):
        print(f"| {i + 1}{' (warm-up)' if i == 0 else ''} | {off:.2f} s | {on:.2f} s | {on / off:.2f} |")
    print(f"(with layer-wise the forward pass waited {waited:.2f} s in total on layers)")
