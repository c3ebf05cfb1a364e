"""End-to-end benchmark with SGLang's own harness against real CPU servers (issue 8).

For each configuration (``e2e_server.CONFIGS``: recompute, device, raw, dpu, nvdec, inproc, auto) one real
SGLang server is started (``SGLangServer``). Remote configurations use Redis inside a network
namespace behind a ``tc tbf``-shaped veth (``benchmarks/netshape.py``) and go through:

Pinning (``--pin 0:1``, the default on >= 2 cores): the scheduler process runs on core 0 and the DPU
data plane on core 1, emulating a DPU's own cores; the in-process baseline (``inproc``) decodes on the
scheduler's core 0. The HTTP/tokenizer processes, Redis, the harness and whatever else runs on the
machine are not pinned, so core 1 is the data plane's own only in the sense that serving never runs
there.

1. **warm-up** on the unshaped link: the harness's workload and our probe prompts are served once,
   so write-back fills the store; we wait until the written-bytes counter stops moving;
2. for every link rate: ``tc`` rate set, then ``python -m sglang.benchmark.serving`` with
   ``--flush-cache`` (the device radix cache is emptied, the store keeps the prefixes: every shared
   prefix must come back through the link), then the per-request **fetch probe** (sequential
   requests after another flush; fetch time vs wire floor from ``/metrics``);
3. the **load-latency curve** (request rates at one link rate), one multi-turn run
   (``--gsp-num-turns``) and the **interference** measurement (TPOT of a decode while other requests
   fetch).

Local configurations (recompute, device) run the same workload, curve and interference without a
link. Results: ``docs/results/e2e.json`` (+ PNGs from ``e2e_plots.py``); harness JSONL files and
server logs stay in ``--workdir``. A configuration whose path the server does not actually take
(per its ``sglang:remote_kv_decisions`` metric) is recorded with a ``status`` saying so.

``--quick`` finishes in ~30 min on an idle 2-core machine (fewer configs, rates and prompts); the
run in docs/RESULTS.md (all configs) took ~60 min with the arguments it lists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import e2e_derive, e2e_plots
from benchmarks.e2e_probe import fetch_probe, generate, interference, probe_prompts
from benchmarks.e2e_server import (
    CONFIGS,
    Config,
    Workload,
    decisions,
    delta,
    flush_device_cache,
    metric,
    pin_server,
    run_harness,
    scrape,
    shaped_store,
    wait_writeback_idle,
)
from benchmarks.launcher import ServerSpec, SGLangServer
from benchmarks.netshape import netns_supported
from sgl_remote_kv.model import ensure_model

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
SUMMARY_KEYS = (
    "completed",
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "mean_itl_ms",
    "mean_e2e_latency_ms",
    "duration",
)


def summarize(res: dict) -> dict:
    out = {k: res.get(k) for k in SUMMARY_KEYS}
    out["cache_report"] = res.get("cache_report")
    out["ttfts_s"] = res.get("ttfts")
    out["cached_tokens_details"] = res.get("cached_tokens_details")
    out["errors"] = [e for e in res.get("errors") or [] if e]
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.model = str(ensure_model(args.dtype))
        self.work = Path(args.workdir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.wl = Workload(args.groups, args.per_group, args.system_len, args.question_len, args.output_len)
        self.prompts = probe_prompts(self.model, args.probes, args.probe_chunks)
        self.store = None

    # -- one harness run with metric deltas --------------------------------------------------------
    def harness(self, srv, tag: str, wl: Workload, rate_req: float, flush: bool) -> dict:
        before = scrape(srv.base_url)
        res = run_harness(srv.base_url, self.model, wl, self.work / f"{tag}.jsonl", rate_req, flush, self.log)
        time.sleep(0.5)
        d = delta(scrape(srv.base_url), before)
        out = summarize(res)
        out["remote"] = {
            "hit_tokens": metric(d, "remote_kv_hit_tokens_total"),
            "fetched_bytes": metric(d, "remote_kv_fetched_bytes_total"),
            "decoded_bytes": metric(d, "remote_kv_decoded_bytes_total"),
            "fetches": metric(d, "remote_kv_fetch_seconds_count"),
            "fetch_s_sum": metric(d, "remote_kv_fetch_seconds_sum"),
            "paths": decisions(d),
            "failures": {k: v for k, v in d.items() if "failures" in k},
        }
        logger.info(
            "%s: TTFT mean %.0f ms p90 %.0f ms, TPOT %.1f ms, %.3f req/s, remote hit %d tok, paths %s",
            tag,
            out["mean_ttft_ms"] or 0,
            out["p90_ttft_ms"] or 0,
            out["mean_tpot_ms"] or 0,
            out["request_throughput"] or 0,
            out["remote"]["hit_tokens"],
            out["remote"]["paths"],
        )
        return out

    def warm(self, srv) -> dict:
        """Unshaped: serve the workloads and probe prompts once so write-back fills the store."""
        self.store.set_rate(None)
        t0 = time.monotonic()
        self.harness(srv, "warm", self.wl, float("inf"), flush=False)
        if self.a.turns > 1 and self.cfg_name in self.a.mt_configs:
            self.harness(srv, "warm-mt", self.multi_turn_wl(), float("inf"), flush=False)
        for ids in self.prompts:
            generate(srv.base_url, ids)
        written = wait_writeback_idle(srv.base_url)
        return {"written_bytes": written, "seconds": time.monotonic() - t0}

    def multi_turn_wl(self) -> Workload:
        wl = Workload(**asdict(self.wl))
        wl.turns, wl.seed = self.a.turns, self.wl.seed + 1
        return wl

    # -- one configuration ---------------------------------------------------------------------------
    def server_spec(self, cfg: Config) -> ServerSpec:
        extra = (*cfg.args, "--enable-metrics", "--enable-cache-report")
        if cfg.remote:
            extra += ("--remote-kv-store", self.store.url)
            if self.a.pin:  # the data plane (dpu/raw/auto) gets its own core, like a DPU's
                extra += ("--remote-kv-dpu-cpus", ",".join(map(str, self.a.pin[1])))
        return ServerSpec(
            self.model,
            extra_args=extra,
            dtype=self.a.dtype,
            max_total_tokens=self.a.max_total_tokens,
            log_path=str(self.work / f"{cfg.name}-server.log"),
            env={**({"OMP_NUM_THREADS": str(self.a.threads)} if self.a.threads else {}), **dict(cfg.env)},
        )

    def run_config(self, cfg: Config) -> dict:
        out: dict = {"config": cfg.name, "server_args": list(cfg.args), "note": cfg.note, "runs": []}
        self.log = self.work / f"{cfg.name}-harness.log"
        self.cfg_name = cfg.name
        if cfg.remote:
            self.store.flushall()
        t0 = time.monotonic()
        with running(self.server_spec(cfg)) as srv:
            out["startup_s"] = time.monotonic() - t0
            if self.a.pin:
                out["affinity"] = pin_server(srv.proc.pid, self.a.pin[0])
            tier = [x for x in srv.log_text().splitlines() if "remote KV tier ready" in x]
            out["tier"] = tier[-1].split("] ", 1)[-1] if tier else None  # store, path and codec used
            if cfg.remote:
                out["warm"] = self.warm(srv)
            if self.a.interference_first:  # before slow links can teach the policy to recompute
                out["interference"] = self.interference(srv, cfg)
            for rate in self.a.rates if cfg.remote else [None]:
                out["runs"].append(self.run_rate(srv, cfg, rate))
            if cfg.name in self.a.curve_configs:
                out["load_latency"] = self.load_curve(srv, cfg)
            if self.a.turns > 1 and cfg.name in self.a.mt_configs:
                out["multi_turn"] = self.harness(
                    srv, f"{cfg.name}-mt", self.multi_turn_wl(), float("inf"), True
                )
            if not self.a.interference_first:
                out["interference"] = self.interference(srv, cfg)
        out["order"] = (
            "interference, rates, curve" if self.a.interference_first else "rates, curve, interference"
        )
        out["status"] = self.status(cfg, out)
        return out

    def run_rate(self, srv, cfg: Config, rate: float | None) -> dict:
        if cfg.remote:
            self.store.set_rate(rate)
        tag = f"{cfg.name}-{rate or 'local'}"
        run = {"rate_mbit": rate, "harness": self.harness(srv, tag, self.wl, float("inf"), flush=True)}
        if cfg.name == "device":  # same workload again on the now-warm device cache: the ceiling
            run["device_warm"] = self.harness(srv, "device-warm", self.wl, float("inf"), flush=False)
        flush_device_cache(srv.base_url)
        wire = self.store.wire_bytes if cfg.remote else None
        run["probe"] = fetch_probe(srv.base_url, self.prompts, rate, wire)
        return run

    def load_curve(self, srv, cfg: Config) -> dict:
        rate = self.a.curve_link_rate
        if cfg.remote:
            self.store.set_rate(rate)
        points = []
        for rr in self.a.request_rates:
            h = self.harness(srv, f"{cfg.name}-curve-{rr}", self.wl, rr, flush=True)
            points.append({"request_rate": rr, **h})
        return {"link_rate_mbit": rate if cfg.remote else None, "points": points}

    def interference(self, srv, cfg: Config) -> dict:
        """The loaded / unloaded TPOT ratio, and beside it (same server, prompts and decode) the same with
        every background request a device hit: the remainder of the first over the second is what getting
        the KV (fetch, install; or prefill) costs the running decode."""
        if cfg.remote:
            self.store.set_rate(self.a.curve_link_rate)
        flush = lambda: flush_device_cache(srv.base_url)  # noqa: E731
        res = interference(srv.base_url, self.prompts, self.a.decode_tokens, flush)
        res["link_rate_mbit"] = self.a.curve_link_rate if cfg.remote else None
        res["device_hit_baseline"] = interference(
            srv.base_url, self.prompts, self.a.decode_tokens, flush, device_hits=True
        )
        return res

    @staticmethod
    def status(cfg: Config, out: dict) -> str:
        if not cfg.remote:
            return "ok"
        seen: set[str] = set()
        for r in out["runs"]:
            seen |= set(r["harness"]["remote"]["paths"]) | {p for x in r["probe"] for p in x["paths"]}
        hits = sum(r["harness"]["remote"]["hit_tokens"] for r in out["runs"])
        if cfg.expect_path and cfg.expect_path not in seen:
            return (
                f"not run as '{cfg.expect_path}': the server's policy decisions were {sorted(seen)}; "
                "the numbers below are what that path measured"
            )
        return "ok" if hits else "ran, but no remote hits were recorded"


@contextlib.contextmanager
def running(spec: ServerSpec):
    """Like ``with SGLangServer(spec)``, but also stops a server interrupted while starting up."""
    srv = SGLangServer(spec)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def environment() -> dict:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    return {
        "commit": head.stdout.strip() or os.environ.get("SRKV_BENCH_COMMIT"),  # snapshot dirs have no .git
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _in_repo(value):
    """An argument as results may record it: a path outside this repository (the work directory: server
    logs, harness files) becomes a note; results name no path outside the repo."""
    if isinstance(value, (str, Path)) and Path(value).is_absolute():
        root = Path(__file__).resolve().parent.parent
        try:
            return str(Path(value).resolve().relative_to(root))
        except ValueError:
            return "(outside the repo)"
    return value


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """From the model's config.json: layers x (K and V) x KV heads x head dim x element size."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    size = 4 if dtype == "float32" else 2
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * size


def run(args: argparse.Namespace) -> dict:
    bench = Bench(args)
    previous = json.loads((args.out / "e2e.json").read_text()) if args.merge else {}
    result = {
        "env": environment(),
        "args": {k: _in_repo(v) for k, v in vars(args).items() if k != "func"},
        "workload": asdict(bench.wl),
        "probe_prompt_tokens": len(bench.prompts[0]),
        "configs": dict(previous.get("configs", {})),
    }
    if previous:  # --merge: keep the other configurations' results and say which run made which
        earlier = {
            "env": previous.get("env"),
            "args": previous.get("args"),
            "configs": list(previous["configs"]),
        }
        result["merged_from"] = [earlier, *previous.get("merged_from", [])]
    for name in args.configs:
        result["configs"].pop(name + args.tag, None)
    ok, reason = netns_supported()
    remote_names = [c for c in args.configs if CONFIGS[c].remote]
    if remote_names and not ok:
        for c in remote_names:
            result["configs"][c] = {"status": f"not run: network namespaces not permitted ({reason})"}
    for item in args.not_run:
        name, _, reason = item.partition("=")
        result["configs"][name] = {"status": f"not run: {reason}"}
    for name in args.configs:
        key = name + args.tag  # --tag: keep several runs of one configuration side by side
        if key in result["configs"]:
            continue
        cfg = CONFIGS[name]
        logger.info("=== config %s (%s)", name, " ".join(cfg.args))
        try:
            if cfg.remote:
                with shaped_store(bench.work) as bench.store:
                    result["configs"][key] = bench.run_config(cfg)
            else:
                result["configs"][key] = bench.run_config(cfg)
        except Exception as e:  # a broken configuration is recorded, the others still run
            logger.exception("config %s failed", name)
            result["configs"][key] = {"status": f"not run: {type(e).__name__}: {e}"[:2000]}
        result["env"]["loadavg_after_" + key] = os.getloadavg()
        write(result, args.out)  # partial results survive a later failure
    return result


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(result, indent=1, default=str))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (~30 min on an idle machine)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None)
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="link rates, Mbit/s")
    ap.add_argument("--request-rates", type=float, nargs="+", default=None, help="load-latency curve, req/s")
    ap.add_argument("--curve-configs", nargs="+", default=["recompute", "dpu_fetch", "inproc_fetch", "dpu"])
    ap.add_argument("--mt-configs", nargs="+", default=["device", "dpu", "inproc"], help="multi-turn runs")
    ap.add_argument("--tag", default="", help="suffix for the result keys (e.g. _curve160)")
    ap.add_argument("--merge", action="store_true", help="add to/replace configs in an existing e2e.json")
    ap.add_argument("--interference-first", action="store_true", help="measure interference before rates")
    ap.add_argument("--not-run", nargs="*", default=[], metavar="NAME=REASON", help="record a skipped config")
    ap.add_argument("--curve-link-rate", type=float, default=640.0, help="Mbit/s for curve/interference")
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--per-group", type=int, default=1)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--turns", type=int, default=None, help="multi-turn run (--gsp-num-turns); 1 = skip")
    ap.add_argument("--probes", type=int, default=None, help="sequential fetch-probe requests")
    ap.add_argument("--probe-chunks", type=int, default=4, help="chunks of 256 tokens per probe prompt")
    ap.add_argument("--decode-tokens", type=int, default=None, help="interference decode length")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS for the server (0: torch default)"
    )
    ap.add_argument(
        "--pin",
        default="0:1" if (os.cpu_count() or 1) >= 2 else "none",
        help="SERVE:DPU core lists (e.g. 0:1): pin the scheduler process to SERVE and the DPU data plane "
        "to DPU (emulates a DPU's own cores); 'none' leaves everything unpinned",
    )
    ap.add_argument("--max-total-tokens", type=int, default=24576)
    ap.add_argument("--workdir", default="/tmp/srkv-bench-e2e")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    q = a.quick
    quick_cfgs = ["dpu_fetch", "inproc_fetch", "recompute", "dpu", "auto"]
    a.configs = a.configs or (quick_cfgs if q else list(CONFIGS))
    # descending: the link degrades (the policy must notice), then the curve at a fast rate (recovery)
    a.rates = a.rates or ([640.0, 160.0, 40.0, 10.0] if q else [640.0, 320.0, 160.0, 80.0, 40.0, 10.0])
    a.request_rates = a.request_rates or ([0.05, float("inf")] if q else [0.05, 0.1, 0.2, float("inf")])
    a.groups = a.groups or (3 if q else 6)
    a.turns = a.turns or 2
    a.probes = a.probes or (2 if q else 4)
    a.decode_tokens = a.decode_tokens or (48 if q else 128)
    a.pin = None if a.pin == "none" else tuple({int(c) for c in part.split(",")} for part in a.pin.split(":"))
    return a


def main(argv: list[str] | None = None) -> None:
    # SIGTERM unwinds like Ctrl-C, so servers, redis and the namespace are removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    result = run(args)
    result["derived"] = e2e_derive.derive(
        result, kv_bytes_per_token(str(ensure_model(args.dtype)), args.dtype)
    )
    write(result, args.out)
    e2e_plots.plot_all(result, args.out)
    logger.info("wrote %s", args.out / "e2e.json")


if __name__ == "__main__":
    main()
