"""Timed requests of our own for what the bench harness cannot see per request.

- ``probe_prompts``: token-exact prompts cut from real license texts on this machine, each
  ``chunks * chunk_size + 1`` tokens long (a remote hit covers every full chunk and leaves exactly one
  token to compute), with pairwise-distinct first chunks.
- ``fetch_probe``: sends them one at a time and reads the server's remote-tier metrics before and
  after each, which yields that request's store fetch time (``sglang:remote_kv_fetch_seconds``),
  its compressed bytes, hit tokens and the policy's path; the wire floor is bytes / link rate. Right
  after each, the same prompt again (now in the device radix cache: a local hit, ``local_hit_s``) and
  the same prompt with a fresh random first token (a prefix nobody has: local and remote miss) are
  timed as the side-by-side references (``recompute_ref_s``), so the fetch's latency can be compared
  with a local hit and a recompute measured at the same moment on a loaded machine.
- ``interference``: one long streaming decode; its inter-token gaps alone (unloaded TPOT) and while
  probe requests fetch (loaded TPOT).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.e2e_server import decisions, delta, metric, scrape

logger = logging.getLogger(__name__)

TEXTS = (
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/MPL-2.0",
    "/usr/share/common-licenses/GFDL-1.3",
    "/usr/share/common-licenses/LGPL-2.1",
    "/usr/share/common-licenses/Artistic",
)


def probe_prompts(model_path: str, n: int, chunks: int, chunk_size: int = 256) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ids: list[int] = []
    for p in TEXTS:
        if Path(p).exists():
            ids += tok(Path(p).read_text(errors="replace"))["input_ids"]
    length = chunks * chunk_size + 1
    stride = max(chunk_size, (len(ids) - length) // max(n - 1, 1))
    out = [ids[i * stride : i * stride + length] for i in range(n)]
    out = [p for p in out if len(p) == length]
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} probe prompts of {length} tokens from {len(ids)} tokens of text")
    return out


def generate(
    base_url: str, input_ids: list[int], max_new_tokens: int = 1, timeout: float = 600, **sampling
) -> dict:
    """Greedy ``/generate`` of ``max_new_tokens`` (EOS ignored); ``sampling``: more sampling params."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **sampling,
        },
    }
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def fetch_probe(
    base_url: str, prompts: list[list[int]], rate_mbit: float | None, wire_bytes=None
) -> list[dict]:
    """One request at a time; per request: latency, fetch time, bytes, wire floor, path taken.

    ``wire_bytes()`` (the veth's received-bytes counter) measures what crossed the shaped link for
    the request, headers included; the server's ``fetched_bytes`` counter is the payload as the
    in-process backend saw it (the DPU backend does not report it per job). The floor uses the
    payload when known, else the wire count. ``fetch_s`` is the backend's own time (store get for
    in-process; the whole pipelined job for the DPU); ``kv_wait_s`` is park-to-release as the request
    lived it (lookup + fetch + decode + install).
    """
    rows = []
    rng = random.Random()
    for ids in prompts:
        before, w0 = scrape(base_url), wire_bytes() if wire_bytes else 0
        t0 = time.perf_counter()
        out = generate(base_url, ids)
        latency = time.perf_counter() - t0
        time.sleep(0.3)  # metrics are updated by the scheduler after the request was released
        d = delta(scrape(base_url), before)
        wire = wire_bytes() - w0 if wire_bytes else None
        t1 = time.perf_counter()
        local = generate(base_url, ids)  # the same prompt: its prefix is in the device radix cache now
        local_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        generate(base_url, [rng.randrange(1000, 40000), *ids[1:]])  # fresh prefix: a full recompute
        ref_s = time.perf_counter() - t1
        hit = metric(d, "remote_kv_hit_tokens_total")
        payload = metric(d, "remote_kv_fetched_bytes_total") or None
        nbytes = payload or (wire if hit else None)
        fetch_s = metric(d, "remote_kv_fetch_seconds_sum") if hit else None
        wait_s = metric(d, "remote_kv_kv_wait_seconds_sum") if hit else None
        floor = nbytes * 8 / (rate_mbit * 1e6) if rate_mbit and nbytes else None
        meta = out.get("meta_info", {})
        rows.append(
            {
                "prompt_tokens": len(ids),
                "latency_s": latency,
                "recompute_ref_s": ref_s,
                "local_hit_s": local_s,
                "local_hit_cached_tokens": local.get("meta_info", {}).get("cached_tokens"),
                "cached_tokens": meta.get("cached_tokens"),
                "cached_tokens_details": meta.get("cached_tokens_details"),
                "remote_hit_tokens": hit,
                "payload_bytes": payload,
                "wire_bytes": wire,
                "fetched_bytes": nbytes or 0,
                "decoded_bytes": metric(d, "remote_kv_decoded_bytes_total"),
                "fetch_s": fetch_s,
                "decode_s": metric(d, "remote_kv_decode_seconds_sum") if hit else None,
                "kv_wait_s": wait_s,
                "wire_floor_s": floor,
                "fetch_over_floor": fetch_s / floor if floor and fetch_s else None,
                "kv_wait_over_floor": wait_s / floor if floor and wait_s else None,
                "paths": decisions(d),
                "failures": {k: v for k, v in d.items() if "failures" in k},
            }
        )
    return rows


def _stream_decode(base_url: str, n_tokens: int, stamps: list[float]) -> None:
    body = {
        "text": "Write a long story about a lighthouse keeper.",
        "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.perf_counter())


def _gaps(stamps: list[float], windows: list[tuple[float, float]] | None) -> list[float]:
    gaps = []
    for a, b in zip(stamps[1:-1], stamps[2:], strict=True):  # skip the first token (TTFT)
        if windows is None or any(s <= b and a <= e for s, e in windows):
            gaps.append(b - a)
    return gaps


def _summ(gaps: list[float]) -> dict:
    if not gaps:
        return {"n": 0}
    return {"n": len(gaps), "mean_s": statistics.fmean(gaps), "median_s": statistics.median(gaps)}


def interference(
    base_url: str, prompts: list[list[int]], n_tokens: int, flush, device_hits: bool = False
) -> dict:
    """TPOT of a running decode alone and while ``prompts`` are served one after another.

    ``flush()`` empties the device cache before the loaded phase, so each prompt is a remote fetch
    in remote configurations (and a full prefill in local ones). ``device_hits``: the baseline instead:
    every prompt is served once first and the cache is not flushed, so each background request is a
    device (radix) hit: what remains of the slowdown is the cost of a request joining the batch, not
    of getting its KV.
    """
    alone: list[float] = []
    _stream_decode(base_url, n_tokens, alone)
    flush()
    if device_hits:
        for ids in prompts:
            generate(base_url, ids)
    stamps: list[float] = []
    t = threading.Thread(target=_stream_decode, args=(base_url, n_tokens, stamps), daemon=True)
    t.start()
    while len(stamps) < 3 and t.is_alive():
        time.sleep(0.02)
    windows, before = [], scrape(base_url)
    for ids in prompts:
        if not t.is_alive():
            break
        t0 = time.perf_counter()
        generate(base_url, ids)
        windows.append((t0, time.perf_counter()))
    d = delta(scrape(base_url), before)
    t.join()
    unloaded, loaded = _summ(_gaps(alone, None)), _summ(_gaps(stamps, windows))
    ratio = loaded["mean_s"] / unloaded["mean_s"] if loaded["n"] and unloaded["n"] else None
    return {
        "decode_tokens": n_tokens,
        "background_requests": len(windows),
        "unloaded_tpot": unloaded,
        "loaded_tpot": loaded,
        "loaded_over_unloaded": ratio,
        "paths": decisions(d),
        "remote_hit_tokens": metric(d, "remote_kv_hit_tokens_total"),
        # the DPU client's receiver thread writing fetched layers into the pool (scheduler-side cost)
        "client_write_s": metric(d, "remote_kv_dataplane_write_seconds_total"),
        "client_write_layers": metric(d, "remote_kv_dataplane_write_layers_total"),
    }
