"""A whole SGLang server with the remote tier, measured: recompute vs remote-hit TTFT, token identity, TPOT.

    python scripts/gpu_server_check.py --out gpu_server.json --work DIR [--rehearsal] [--deadline-s 450]

Run by ``scripts/gpu_server_check.sh`` (which sets up the wheels, the ``sgl_kernel`` stand-ins and SGLang's
environment); not meant to be started alone. For each model of the plan (``MODELS``: a Llama-3-8B shape on
a GPU, SmolLM2-135M's in the rehearsal; random weights from SGLang's ``--load-format dummy``, prompts are
token ids) and each read path (``PATHS``), one DPU-mode server is started with a file store on local disk behind
an emulated link (``faulty+file://...?control=``: ``link_gbps`` paces what the store returns, changed
between rows through the control file). Per prompt length:

- ``ttft_recompute_s``: a cold prompt (nothing of it cached anywhere), greedy;
- then, once its write-back is idle, for each link rate: ``/flush_cache`` (device cache only), the same
  prompt again: ``ttft_remote_s``, ``storage_tokens`` (tokens SGLang says came from the tier), the policy's
  decisions, and ``tokens_identical`` (the answer equals the recompute's; expected for ``lossless``).

Then TPOT of a running decode while other requests fetch (remote hits), against the same while other
requests recompute, and with nothing else running. Rows are written to ``--out`` as they come (a timeout
still leaves them); no new row starts after ``--deadline-s``. ``--rehearsal``: the CPU platform plugin, the
small model only, shorter prompts (``make gpu-server-rehearsal``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # benchmarks/ and tests/ from the tree; sgl_remote_kv from the installed wheel

from benchmarks.e2e_server import (  # noqa: E402
    chunks_done,
    decisions,
    delta,
    flush_device_cache,
    scrape,
    stream_generate,
    wait_written,
)
from benchmarks.launcher import ServerSpec, SGLangServer  # noqa: E402

# Random-weight models: SGLang builds the weights from config.json (--load-format dummy, seeded).
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "use_cache": True,
}
MODELS = {
    # SmolLM2-135M's shape (the CPU twin's model): the fast first pass
    "smollm2-135m-shape": {
        **LLAMA,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 65536,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    # Llama-3-8B's shape: 32 layers, 8 KV heads of 128 (128 KiB of bf16 KV per token)
    "llama3-8b-shape": {
        **LLAMA,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
    },
}
# read paths: --remote-kv dpu with the data plane handing codes to the device (the default `auto`), handing
# it KV (host decode), and the lossless codec (answers must equal recompute's)
PATHS = {
    "dpu-codes": ["--remote-kv-dpu-output", "auto"],
    "dpu-kv": ["--remote-kv-dpu-output", "kv"],
    "dpu-lossless": ["--remote-kv-codec", "lossless"],
}
# (model, path, prompt lengths, link rates): in priority order, the goal row first
PLANS = {}
# (the SmolLM2 shape's fast first pass left the GPU plan once the first H200 run had served it: the 8B
# shape's rows are the ones that decide, and each server start costs ~60 s of the call)
PLANS["gpu"] = GPU_PLAN = [
    ("llama3-8b-shape", "dpu-codes", [32768, 8192], [25, 10, 100]),
    ("llama3-8b-shape", "dpu-lossless", [8192], [25]),
    ("llama3-8b-shape", "dpu-kv", [8192], [25]),
]
# a second call in one device session (--plan gpu-paths): the 8B shape's read paths, one rate, no TPOT
PLANS["gpu-paths"] = [
    ("llama3-8b-shape", "dpu-codes", [32768, 8192], [25, 100]),
    ("llama3-8b-shape", "dpu-lossless", [8192], [25]),
    ("llama3-8b-shape", "dpu-kv", [8192], [25]),
]
PLANS["rehearsal"] = REHEARSAL_PLAN = [
    ("smollm2-135m-shape", "dpu-codes", [2048, 1024], [25, 10]),
    ("smollm2-135m-shape", "dpu-lossless", [1024], [25]),
    ("smollm2-135m-shape", "dpu-kv", [1024], [25]),
]
TPOT = {
    "gpu": ("llama3-8b-shape", "dpu-codes", 8192, 25),
    "rehearsal": ("smollm2-135m-shape", "dpu-codes", 512, 25),
}
NEW_TOKENS = 8
CHUNK = 256  # the tier's default chunk (--remote-kv-chunk-size)


class Report:
    """The JSON file, rewritten after every row."""

    def __init__(self, path: Path, rehearsal: bool, work: Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        site = [(p, "$GPU_SERVER_SITE") for p in os.environ.get("PYTHONPATH", "").split(":") if "site" in p]
        self.redact = [
            (str(work), "$GPU_SERVER_WORK"),
            (str(ROOT) + "/", ""),
            (str(ROOT), "."),
            *site,
            (sys.prefix, "$PYTHON_PREFIX"),
        ]
        self.data: dict = {
            "schema": 1,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rehearsal": rehearsal,
            "ok": False,
            "machine": {},
            "sglang": {},
            "rows": [],
            "tpot": {},
            "servers": [],
            "errors": [],
        }

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.t0, 1)
        text = json.dumps(self.data, indent=1) + "\n"
        for path, name in self.redact:  # the report names the repo's own paths only
            text = text.replace(path, name)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.path)


def machine_block() -> dict:
    try:
        from tests.gpu_report import machine_info

        return machine_info()
    except Exception as e:  # the report must still be written
        return {"error": f"{type(e).__name__}: {e}"}


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


# greedy, every new token generated (random weights may pick EOS early), each token's arrival time
stream = functools.partial(stream_generate, timeout_s=600, ignore_eos=True)


def set_link(control: Path, gbps: float) -> None:
    tmp = control.with_suffix(".tmp")
    tmp.write_text(json.dumps({"link_gbps": gbps}))
    tmp.replace(control)
    time.sleep(0.05)  # a new mtime for the store's next check


class Check:
    def __init__(self, args) -> None:
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.work / "store", ignore_errors=True)  # every prompt is cold once: an empty store
        self.report = Report(Path(args.out), args.rehearsal, self.work.resolve())
        self.deadline = time.monotonic() + args.deadline_s
        self.control = self.work / "link.json"
        self.seed = 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def model_dir(self, name: str) -> Path:
        d = self.work / "models" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(MODELS[name], indent=1))
        return d

    def server(self, model: str, path: str) -> SGLangServer:
        store = self.work / "store" / model  # one store per model: paths of a model share what is written
        set_link(self.control, 0)
        rehearsal = self.args.rehearsal
        extra = [
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--sampling-backend",
            "pytorch",
            "--grammar-backend",
            "none",
            "--enable-metrics",
            "--remote-kv",
            "dpu",
            "--remote-kv-store",
            f"faulty+file://{store}?control={self.control}",
            "--remote-kv-writeback-queue-mb",
            "16384",
            *PATHS[path],
        ]
        if not rehearsal:
            extra += [
                "--context-length",
                "40000",
                "--attention-backend",
                "triton",
                "--cuda-graph-backend-decode",
                "disabled",
                "--cuda-graph-backend-prefill",
                "disabled",
                "--mem-fraction-static",
                "0.8",
            ]
        spec = ServerSpec(
            model_path=str(self.model_dir(model)),
            extra_args=tuple(extra),
            dtype="bfloat16",
            max_total_tokens=16384 if rehearsal else 131072,
            cpu=rehearsal,
            log_path=str(self.work / f"server-{model}-{path}.log"),
            startup_timeout_s=max(60.0, min(300.0, self.left())),
        )
        return SGLangServer(spec)

    def run(self) -> int:
        r = self.report
        r.data["machine"] = machine_block()
        r.data["sglang"] = sglang_block()
        if self.args.audit:
            try:
                r.data["audit"] = json.loads(Path(self.args.audit).read_text())
            except (OSError, ValueError) as e:
                r.data["audit"] = {"ok": False, "error": str(e)}
            if not r.data["audit"].get("ok"):
                r.data["errors"].append("the stand-in audit failed (see audit)")
        r.save()
        name = "rehearsal" if self.args.rehearsal else self.args.plan
        plan = PLANS[name]
        r.data["plan"] = name
        tpot_model, tpot_path, tpot_tokens, tpot_gbps = TPOT.get(name, (None, None, 0, 0))
        for model, path, sizes, rates in plan:
            if self.left() < 60:
                r.data["errors"].append(f"deadline: {model} {path} not started")
                break
            t0 = time.monotonic()
            entry = {"model": model, "path": path, "started": True}
            r.data["servers"].append(entry)
            try:
                with self.server(model, path) as srv:
                    entry["startup_s"] = round(time.monotonic() - t0, 1)
                    entry["tier"] = tier_lines(srv.log_text())
                    r.save()
                    self.rows(srv, model, path, sizes, rates)
                    if (model, path) == (tpot_model, tpot_path) and self.left() > 60:
                        r.data["tpot"] = self.tpot(srv, model, tpot_tokens, tpot_gbps)
                        r.save()
            except Exception as e:  # a server that fails: its error and log tail, then the next plan line
                entry["error"] = f"{type(e).__name__}: {e}"[-4000:]
                r.data["errors"].append(f"{model} {path}: {type(e).__name__}: {str(e)[:300]}")
            entry["wall_s"] = round(time.monotonic() - t0, 1)
            r.save()
        rows = r.data["rows"]
        r.data["ok"] = (
            bool(rows)
            and not r.data["errors"]
            and all(row["storage_tokens"] > 0 and row["recompute_storage_tokens"] == 0 for row in rows)
            and all(row["tokens_identical"] for row in rows if row["path"] == "dpu-lossless")
        )
        r.data["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        r.save()
        summary(r.data)
        return 0 if r.data["ok"] else 1

    def rows(self, srv: SGLangServer, model: str, path: str, sizes: list[int], rates: list[float]) -> None:
        vocab = MODELS[model]["vocab_size"]
        url = srv.base_url
        for n in sizes:
            if self.left() < 30:
                self.report.data["errors"].append(f"deadline: {model} {path} {n} tokens not measured")
                return
            self.seed += 1
            before = chunks_done(url)
            stream(url, prompt(vocab, n, 10_000 + self.seed), 2)  # compile this length's kernels
            # its write-back done first: the cold run must not share the host with another prompt's encode
            # (that slowed the first H200 run's recompute rows, docs/RESULTS.md)
            self.wait_written(url, before + n // CHUNK - 1)
            self.seed += 1
            ids = prompt(vocab, n, self.seed)
            before = chunks_done(url)
            cold = stream(url, ids, NEW_TOKENS)
            written = self.wait_written(url, before + n // CHUNK - 1)
            for gbps in rates:
                if self.left() < 20:
                    self.report.data["errors"].append(f"deadline: {model} {path} {n} @ {gbps} not measured")
                    return
                set_link(self.control, gbps)
                flush_device_cache(url)
                before = scrape(url)
                hit = stream(url, ids, NEW_TOKENS)
                d = delta(scrape(url), before)
                self.report.data["rows"].append(
                    {
                        "model": model,
                        "tokens": n,
                        "gbps": gbps,
                        "path": path,
                        "ttft_recompute_s": round(cold["ttft_s"], 4),
                        "ttft_remote_s": round(hit["ttft_s"], 4),
                        "ratio": round(hit["ttft_s"] / cold["ttft_s"], 3),
                        "tokens_identical": hit["output_ids"] == cold["output_ids"],
                        "storage_tokens": hit["storage_tokens"],
                        "recompute_storage_tokens": cold["storage_tokens"],  # 0: the cold run was cold
                        "decisions": decisions(d),
                        "breakdown": breakdown(d),
                        "written_bytes_total": written,
                    }
                )
                self.report.save()
            set_link(self.control, 0)

    def wait_written(self, url: str, chunks: float) -> float:
        """``e2e_server.wait_written``, bounded by the deadline. Returns the written bytes."""
        return wait_written(url, chunks, max(10.0, min(180.0, self.left() - 20)))

    def tpot(self, srv: SGLangServer, model: str, n: int, gbps: float, k: int = 3) -> dict:
        """Inter-token time of one running decode while k other requests fetch their prefix from the tier,
        against the same while k other requests recompute theirs, and with nothing else running."""
        vocab, url = MODELS[model]["vocab_size"], srv.base_url
        base = 50_000 + self.seed
        fetched = [prompt(vocab, n, base + i) for i in range(k)]
        before = chunks_done(url)
        for ids in fetched:  # into the tier
            stream(url, ids, 1)
        self.wait_written(url, before + k * (n // CHUNK) - k)
        flush_device_cache(url)
        set_link(self.control, gbps)
        out = {"model": model, "prompt_tokens": n, "gbps": gbps, "others": k}
        decode_len = 64 if self.args.rehearsal else 256
        for label, others in (
            ("fetch", fetched),
            ("recompute", [prompt(vocab, n, base + 100 + i) for i in range(k)]),
        ):
            res, window, served = self._decode_during(url, vocab, decode_len, others)
            steps = list(itertools.pairwise(res["arrivals"]))
            gaps = [b - a for a, b in steps if window[0] <= a and b <= window[1]]
            idle = [b - a for a, b in steps if b <= window[0] or a >= window[1]]
            out[f"tpot_{label}_s"] = round(statistics.median(gaps), 5) if gaps else None
            out[f"tpot_idle_during_{label}_run_s"] = round(statistics.median(idle), 5) if idle else None
            out[f"gaps_{label}"] = len(gaps)
            out[f"storage_tokens_{label}"] = served  # the others' tokens served by the tier
        set_link(self.control, 0)
        if out.get("tpot_fetch_s") and out.get("tpot_recompute_s"):
            out["ratio"] = round(out["tpot_fetch_s"] / out["tpot_recompute_s"], 3)
        return out

    def _decode_during(self, url: str, vocab: int, decode_len: int, others: list[list[int]]):
        self.seed += 1
        box: dict = {}
        t = threading.Thread(
            target=lambda: box.update(stream(url, prompt(vocab, 64, 90_000 + self.seed), decode_len))
        )
        t.start()
        time.sleep(1.0)  # the decode is running
        start = time.perf_counter()
        served = sum(stream(url, ids, 1)["storage_tokens"] for ids in others)
        end = time.perf_counter()
        t.join()
        return box, (start, end), served


def sglang_block() -> dict:
    out = {"standins": None, "env": {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}}
    try:
        import importlib.metadata

        out["sglang"] = importlib.metadata.version("sglang")
        import sgl_kernel

        out["standins"] = bool(getattr(sgl_kernel, "STANDIN", False))
        out["sgl_kernel"] = getattr(sgl_kernel, "__version__", "?")
        if out["standins"]:
            out["standin_ops"] = list(sgl_kernel.IMPLEMENTED) + ["utils.is_arch_support_pdl"]
            out["stubbed"] = list(sgl_kernel.STUBBED)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def summary(d: dict) -> None:
    for r in d["rows"]:
        print(
            f"  {r['model']:<20} {r['path']:<13} {r['tokens']:>6} tok {r['gbps']:>5g} Gbit/s  recompute "
            f"{r['ttft_recompute_s']:.3f} s  remote {r['ttft_remote_s']:.3f} s  x{r['ratio']}  storage "
            f"{r['storage_tokens']}  identical {r['tokens_identical']}"
        )
    print("  tpot:", json.dumps({k: v for k, v in d["tpot"].items() if not k.startswith("gaps")}))
    for e in d["errors"]:
        print("  error:", e[:300])
    print(f"  ok: {d['ok']} ({d['seconds']} s)")


# where a remote hit's time went, from the tier's /metrics (deltas over the hit): the wait in
# waiting_for_KV, the fetch (on the DPU path the data plane's whole job), the receiver's staging writes,
# the wait for staging rows, and the bytes fetched and decoded
BREAKDOWN = (
    "kv_wait_seconds_sum",
    "fetch_seconds_sum",
    "dataplane_write_seconds_total",
    "dataplane_write_layers_total",
    "slot_wait_seconds_sum",
    "fetched_bytes_total",
    "decoded_bytes_total",
)


def breakdown(d: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        name = k.split("{")[0]
        for want in BREAKDOWN:
            if name.endswith("remote_kv_" + want):
                out[want] = round(out.get(want, 0.0) + v, 4)
    return out


def tier_lines(log: str) -> list[str]:
    """The tier's start-up lines (paths, codec, staging): what the rows were measured with."""
    keys = (
        "remote KV tier ready",
        "remote KV staging",
        "remote KV fetch paths",
        "cannot deliver codes",
        "decode on the",
        "DPU data plane started",
    )
    return [line.split("] ", 1)[-1][:400] for line in log.splitlines() if any(k in line for k in keys)][:8]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rehearsal", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=450.0)
    ap.add_argument("--plan", choices=sorted(p for p in PLANS if p != "rehearsal"), default="gpu")
    ap.add_argument("--audit", help="scripts/gpu_standins/audit.py's report, included (rehearsal)")
    return Check(ap.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
