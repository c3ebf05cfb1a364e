"""The two integrations side by side: remote-hit TTFT and tokens through the seam integration (our radix
cache backend installs fetched chunks) and the linker integration (SGLang's ``UnifiedCacheLinker`` loads
staged chunks), on the same store, in one run. Writes docs/results/integration_linker.json.

Setup: real CPU SGLang servers, the real model (float32) and the lossless codec, so every remote hit must
give the cold answer token for token. A writer server (seam) computes every prompt cold (the reference
answers) and writes it back; then, for each repetition, for each integration (the order alternates per
repetition) and each fetch path, a fresh server (empty local cache) serves every prompt once: each is a
remote hit of all its full chunks. TTFT is the time to the first streamed token.

Usage: ``python -m benchmarks.bench_integration [--reps 2] [--prompts 4] [--modes inproc dpu]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.e2e_server import metric, scrape, stream_generate
from sgl_remote_kv.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.model import ensure_model

logger = logging.getLogger("bench_integration")
OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "integration_linker.json"
CHUNK = 64
INTEGRATIONS = ("seam", "linker")


def prompts(tok, n: int, tokens: int) -> list[list[int]]:
    topics = ["harbours", "looms", "comets", "ledgers", "orchards", "foundries", "tides", "archives"]
    out = []
    for i in range(n):
        words, k = [], 0
        while True:
            words.append(
                f"Note {k} on {topics[i % len(topics)]} ({i}): entry {k * 7 + i} is filed under {k % 13}."
            )
            ids = tok(" ".join(words) + "\nWhich entry was filed last?", add_special_tokens=False)[
                "input_ids"
            ]
            if len(ids) >= tokens:
                out.append(ids)
                break
            k += 1
    return out


def spec(model: str, store: str, mode: str, integration: str, log: str) -> ServerSpec:
    extra = ("--enable-metrics", "--enable-cache-report", "--attention-backend", "torch_native")
    extra += ("--remote-kv", mode, "--remote-kv-store", store, "--remote-kv-chunk-size", str(CHUNK))
    extra += ("--remote-kv-codec", "lossless", "--remote-kv-policy-margin", "1e9")
    extra += ("--remote-kv-integration", integration)
    return ServerSpec(model_path=model, extra_args=extra, max_total_tokens=16384, log_path=log)


def written(base_url: str) -> float:
    return metric(scrape(base_url), "remote_kv_written_chunks_total")


def run(args) -> dict:
    from transformers import AutoTokenizer

    model = str(ensure_model("float32"))
    ps = prompts(AutoTokenizer.from_pretrained(model), args.prompts, args.tokens)
    need = sum((len(p) - 1) // CHUNK for p in ps)
    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="srkv-bench-integration-") as tmp:
        store = f"file://{tmp}/store"
        with SGLangServer(spec(model, store, "dpu", "seam", f"{tmp}/writer.log")) as w:
            refs = [stream_generate(w.base_url, p, args.new_tokens, 600)["output_ids"] for p in ps]
            deadline = time.monotonic() + 300
            while written(w.base_url) < need:
                if time.monotonic() > deadline:
                    raise SystemExit("write-back did not finish")
                time.sleep(0.5)
        for rep in range(args.reps):
            order = INTEGRATIONS if rep % 2 == 0 else INTEGRATIONS[::-1]
            for integration in order:
                for mode in args.modes:
                    log = f"{tmp}/{integration}-{mode}-{rep}.log"
                    with SGLangServer(spec(model, store, mode, integration, log)) as srv:
                        for i, p in enumerate(ps):
                            out = stream_generate(srv.base_url, p, args.new_tokens, 600)
                            rows.setdefault((integration, mode), []).append(
                                {
                                    "rep": rep,
                                    "prompt": i,
                                    "ttft_s": round(out["ttft_s"], 4),
                                    "prompt_tokens": len(p),
                                    "remote_tokens": out["storage_tokens"],
                                    "identical": out["output_ids"] == refs[i],
                                }
                            )
                    logger.info("rep %d %s %s done", rep, integration, mode)
    summary = {}
    for mode in args.modes:
        per = {}
        for integration in INTEGRATIONS:
            rs = rows[(integration, mode)]
            per[integration] = {
                "median_ttft_s": round(statistics.median(r["ttft_s"] for r in rs), 4),
                "remote_tokens": sum(r["remote_tokens"] for r in rs),
                "requests": len(rs),
                "identical": sum(r["identical"] for r in rs),
            }
        per["linker_over_seam_ttft"] = round(per["linker"]["median_ttft_s"] / per["seam"]["median_ttft_s"], 3)
        summary[mode] = per
    return {
        "summary": summary,
        "rows": {f"{i}/{m}": rs for (i, m), rs in rows.items()},
        "config": {**vars(args), "chunk": CHUNK, "codec": "lossless", "dtype": "float32"},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1500, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["inproc", "dpu"], choices=["inproc", "dpu"])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    res = run(args)
    print(f"{'path':8} {'integration':12} {'median TTFT s':>14} {'remote tokens':>14} {'identical':>10}")
    for mode, per in res["summary"].items():
        for integration in INTEGRATIONS:
            r = per[integration]
            print(
                f"{mode:8} {integration:12} {r['median_ttft_s']:14.3f} {r['remote_tokens']:14d} "
                f"{r['identical']:>5}/{r['requests']}"
            )
        print(f"{mode:8} linker/seam TTFT {per['linker_over_seam_ttft']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({**res, "config": {**res["config"], "out": str(args.out)}}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
