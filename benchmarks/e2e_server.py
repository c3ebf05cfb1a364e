"""Pieces of the end-to-end benchmark that talk to servers: configurations, the shaped Redis store,
Prometheus scraping of the ``sglang:remote_kv_*`` metrics, and the SGLang bench harness runner.

Every number the benchmark reports comes from one of three places: the harness's ``--output-file``
JSONL (TTFT/TPOT/throughput, as SGLang's own harness computes them), the server's ``/metrics``
(remote-tier counters, fetch-time histograms, policy decisions by path), or our own timed HTTP
requests (``e2e_probe.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.netshape import ShapedLink, shaped_link
from benchmarks.redis_server import RedisServer

logger = logging.getLogger(__name__)

REDIS_PORT = 6379


@dataclass(frozen=True)
class Config:
    """One server configuration of the benchmark."""

    name: str
    args: tuple[str, ...]
    remote: bool  # uses the remote tier (needs the shaped store, warm-up, flush)
    expect_path: str | None = None  # policy path this config is meant to exercise
    note: str = ""
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the server's processes


CONFIGS = {
    "recompute": Config("recompute", ("--disable-radix-cache",), False, note="prefix cache disabled"),
    "device": Config("device", (), False, note="SGLang's device radix cache only (cold at start)"),
    "raw": Config(
        "raw",
        ("--remote-kv", "dpu", "--remote-kv-codec", "lossless"),
        True,
        None,
        "remote tier, lossless codec (exact bf16 bytes, byte-shuffled Deflate)",
    ),
    "dpu": Config("dpu", ("--remote-kv", "dpu"), True, "dpu", "default quantized codec, DPU path"),
    "nvdec": Config("nvdec", ("--remote-kv", "nvdec"), True, "nvdec", "NVDEC (HEVC) path"),
    "auto": Config("auto", ("--remote-kv", "auto"), True, None, "policy picks per request"),
    # The data paths without the policy (it would recompute where fetching loses): every remote hit
    # is fetched, so fetch time vs wire floor and interference are measured at every rate.
    "dpu_fetch": Config(
        "dpu_fetch",
        ("--remote-kv", "dpu", "--remote-kv-policy-margin", "1e9"),
        True,
        "dpu",
        "DPU path, always fetch",
    ),
    # The same with the data plane's previous order (a round decoded only after its last fetch): side by
    # side with dpu_fetch, what decoding chunks as they arrive changes end to end.
    "dpu_fetch_barrier": Config(
        "dpu_fetch_barrier",
        (
            "--remote-kv",
            "dpu",
            "--remote-kv-policy-margin",
            "1e9",
            "--remote-kv-dpu-args=--ablation-round-barrier",
        ),
        True,
        "dpu",
        "DPU path, always fetch, data plane ablation --ablation-round-barrier (the previous order)",
    ),
    # The same with every fetch worker in the store at once (the fetch gate off): side by side with
    # dpu_fetch, what adaptive fetch concurrency changes end to end.
    "dpu_fetch_fixed": Config(
        "dpu_fetch_fixed",
        (
            "--remote-kv",
            "dpu",
            "--remote-kv-policy-margin",
            "1e9",
            "--remote-kv-dpu-args=--fetch-concurrency fixed",
        ),
        True,
        "dpu",
        "DPU path, always fetch, data plane --fetch-concurrency fixed (two fetches at once, as before)",
    ),
    # The same with whole-value store reads (no streamed gets): side by side with dpu_fetch, what decoding
    # a chunk while its bytes arrive changes end to end.
    "dpu_fetch_whole": Config(
        "dpu_fetch_whole",
        (
            "--remote-kv",
            "dpu",
            "--remote-kv-policy-margin",
            "1e9",
            "--remote-kv-dpu-args=--stream-piece-kib 0",
        ),
        True,
        "dpu",
        "DPU path, always fetch, data plane --stream-piece-kib 0 (whole-value gets, as before)",
    ),
    # The same without a transform-codec calibration (an empty cache directory): the server writes the
    # previous default, quant_deflate; side by side with dpu_fetch, the codec change end to end.
    "dpu_fetch_nocal": Config(
        "dpu_fetch_nocal",
        ("--remote-kv", "dpu", "--remote-kv-policy-margin", "1e9"),
        True,
        "dpu",
        "DPU path, always fetch, no calibration: the previous default codec (quant_deflate)",
        env=(("SRKV_CACHE_DIR", "/tmp/srkv-bench-no-calibration"),),
    ),
    "inproc_fetch": Config(
        "inproc_fetch",
        ("--remote-kv", "inproc", "--remote-kv-policy-margin", "1e9"),
        True,
        "inproc",
        "in-process decode, always fetch",
    ),
    # The in-process decode baseline (CacheGen-Async-like): fetch + decode on a worker thread of the
    # serving process, competing with the forward pass for its core (and the GIL).
    "inproc": Config(
        "inproc", ("--remote-kv", "inproc"), True, "inproc", "decode inside the serving process (baseline)"
    ),
}


# -- CPU pinning (emulating a DPU's own cores on this 2-core box) ---------------------------------
def pin_server(root_pid: int, serve_cpus: set[int]) -> dict:
    """Pin every thread of the server's scheduler process(es) to ``serve_cpus`` (threads it starts
    later inherit it). The DPU data plane pins itself (``--remote-kv-dpu-cpus``); the HTTP/tokenizer
    processes, Redis and the bench client stay unpinned. Returns each server process's affinity."""
    import psutil

    out = {}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            name, cmd = proc.name(), " ".join(proc.cmdline())
            if "scheduler" in name or "scheduler" in cmd:
                for tid in os.listdir(f"/proc/{proc.pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(tid), serve_cpus)
            role = "data_plane" if "sgl_remote_kv.dpu" in cmd else name
            out[f"{role}:{proc.pid}"] = sorted(os.sched_getaffinity(proc.pid))
        except (psutil.Error, OSError) as e:
            logger.warning("pinning %s: %r", proc.pid, e)
    return out


# -- Prometheus ------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(base_url: str) -> dict[str, float]:
    """``sglang:remote_kv_*`` samples as {"name{labels}": value} (empty if metrics are off)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        logger.warning("metrics scrape failed: %r", e)
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if "remote_kv" not in line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m:
            labels = re.sub(
                r',?(tp_rank|pp_rank|engine_type|model_name|moe_ep_rank)="[^"]*"', "", m.group(2) or ""
            )
            key = m.group(1) + ("" if labels in ("{}", "") else labels.replace("{,", "{"))
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) != 0}


def metric(d: dict[str, float], name: str) -> float:
    """Sum of every sample whose name (without labels) ends with ``name``."""
    return sum(v for k, v in d.items() if k.split("{")[0].endswith(name))


def decisions(d: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if k.split("{")[0].endswith("remote_kv_decisions_total"):
            m = re.search(r'path="([^"]+)"', k)
            out[m.group(1) if m else "?"] = v
    return out


def wait_writeback_idle(base_url: str, quiet_s: float = 4.0, timeout_s: float = 300.0) -> float:
    """Wait until the written-chunk counter stops moving for ``quiet_s``; returns written bytes."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        w = metric(scrape(base_url), "remote_kv_written_bytes_total")
        if w != last:
            last, since = w, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return w or 0.0
        time.sleep(1.0)
    logger.warning("write-back still moving after %.0fs", timeout_s)
    return last or 0.0


def chunks_done(base_url: str) -> float:
    """Chunks the write-back is done with: stored, or found already in the store (``present``)."""
    m = scrape(base_url)
    present = sum(v for k, v in m.items() if "writeback_skipped" in k and 'reason="present"' in k)
    return metric(m, "remote_kv_written_chunks_total") + present


def wait_written(
    base_url: str, chunks: float, timeout_s: float = 300.0, idle_timeout_s: float | None = None
) -> float:
    """Until ``chunks_done`` reaches ``chunks`` (the full chunks of what was sent; a paced write-back can be
    still for longer than ``wait_writeback_idle``'s quiet time between them), at most ``timeout_s``, then until
    the written bytes stand still for 3 s (the tail sub-chunks), at most ``idle_timeout_s`` (None: what is
    left of ``timeout_s``, at least 5 s). Returns the written bytes."""
    deadline = time.monotonic() + timeout_s
    while chunks_done(base_url) < chunks and time.monotonic() < deadline:
        time.sleep(0.5)
    if idle_timeout_s is None:
        idle_timeout_s = max(5.0, deadline - time.monotonic())
    return wait_writeback_idle(base_url, quiet_s=3.0, timeout_s=idle_timeout_s)


def stream_generate(
    base_url: str, ids: list[int], new_tokens: int, timeout_s: float = 900, ignore_eos: bool = False
) -> dict:
    """Streamed greedy /generate: TTFT (first chunk), total time, the arrival time (``perf_counter``) of each
    output token, output ids (SGLang streams them cumulative unless ``--incremental-streaming-output``),
    storage tokens."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, **({"ignore_eos": True} if ignore_eos else {})}
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, last, arrivals = None, None, []
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            last = json.loads(line[5:])
            arrivals += [now] * max(0, len(last.get("output_ids") or []) - len(arrivals))
    total = time.perf_counter() - t0
    meta = (last or {}).get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "total_s": total,
        "arrivals": arrivals,
        "output_ids": list((last or {}).get("output_ids", [])),
        "storage_tokens": int(details.get("storage") or 0),
    }


def flush_device_cache(base_url: str) -> None:
    req = urllib.request.Request(base_url + "/flush_cache", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


# -- shaped Redis --------------------------------------------------------------------------------
@dataclass
class ShapedStore:
    link: ShapedLink
    redis: RedisServer
    rate_mbit: float | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.link.ns_addr}:{REDIS_PORT}/0"

    def set_rate(self, rate_mbit: float | None) -> None:
        self.link.set_rate(rate_mbit)
        self.rate_mbit = rate_mbit

    def wire_bytes(self) -> int:
        """Bytes received so far on our side of the veth (store -> server: the fetch direction)."""
        return int(Path(f"/sys/class/net/{self.link.host_if}/statistics/rx_bytes").read_text())

    def flushall(self) -> None:
        cmd = ["ip", "netns", "exec", self.link.netns, "redis-cli", "-h", self.link.ns_addr]
        subprocess.run([*cmd, "-p", str(REDIS_PORT), "flushall"], check=True, capture_output=True)


@contextlib.contextmanager
def shaped_store(workdir: Path) -> Iterator[ShapedStore]:
    """redis-server inside its own netns behind a tbf-shaped veth; everything deleted on exit."""
    with shaped_link(None) as link:
        redis = RedisServer(workdir / "redis-netns", REDIS_PORT, host=link.ns_addr, netns=link.netns)
        redis.start()
        try:
            yield ShapedStore(link, redis)
        finally:
            redis.stop()


# -- the bench harness ---------------------------------------------------------------------------
@dataclass
class Workload:
    """``generated-shared-prefix`` parameters (offline; random token text from a seed)."""

    groups: int = 4
    per_group: int = 1
    system_len: int = 1024
    question_len: int = 64
    output_len: int = 16
    turns: int = 1
    seed: int = 1
    extra: tuple[str, ...] = field(default_factory=tuple)

    def args(self) -> list[str]:
        a = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(self.groups)]
        a += ["--gsp-prompts-per-group", str(self.per_group), "--gsp-system-prompt-len", str(self.system_len)]
        a += ["--gsp-question-len", str(self.question_len), "--gsp-output-len", str(self.output_len)]
        a += ["--gsp-range-ratio", "1.0", "--seed", str(self.seed), *self.extra]
        if self.turns > 1:
            a += ["--gsp-num-turns", str(self.turns)]
        return a


def run_harness(
    base_url: str, model: str, wl: Workload, out: Path, request_rate: float, flush: bool, log: Path
) -> dict:
    """One ``python -m sglang.benchmark.serving`` run; returns its JSONL summary line."""
    backend = "sglang-oai-chat" if wl.turns > 1 else "sglang"  # the harness's multi-turn needs chat
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", backend, "--base-url", base_url]
    cmd += ["--model", model, "--tokenizer", model, *wl.args(), "--request-rate", str(request_rate)]
    cmd += ["--output-file", str(out), "--output-details", "--cache-report", "--disable-tqdm"]
    cmd += ["--warmup-requests", "0"] + (["--flush-cache"] if flush else [])
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench harness failed ({p.returncode}); see {log}")
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    res = lines[-1]
    res["_wall_s"] = time.monotonic() - t0
    return res
