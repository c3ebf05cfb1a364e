"""Greedy divergence of remote hits vs local hits, per codec, on real servers (``make bench-exactness``).

For each codec one ``--remote-kv dpu`` server (file store, fetch always preferred) serves the same
prompts four ways, greedy, ``--tokens`` new tokens each:

1. cold (computed; written back), 2. again: a **local hit** (SGLang's radix cache),
3. after ``/flush_cache``: a **remote hit** (the chunks come back through the codec),
4. after another flush, with ``custom_params: {"remote_kv": "exact"}``: an **exact** request.

Reported per codec: the share of prompts whose remote-hit continuation differs from the local hit's,
the mean first diverging position among those, the same for exact vs local (0 by construction:
exact requests recompute on lossy codecs, fetch on exact ones) and cold vs local (the noise floor: two
ways of computing the same KV on this CPU). Writes ``docs/results/exactness.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from pathlib import Path

from benchmarks.e2e_probe import generate, probe_prompts
from benchmarks.e2e_server import flush_device_cache, scrape, wait_writeback_idle
from benchmarks.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.model import ensure_model

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "exactness.json"
# default: what the server resolves (the transform codec with the model's calibration, else quant_deflate with
# the tuned bins; ``served_by`` says which, from the server's metrics); quant_deflate: its constructor's
# (8-bit K and V, ShadowServe-like)
CODECS = ("lossless", "default", "quant_deflate", "cachegen")
CHUNK = 64
log = logging.getLogger("bench_exactness")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref: list[list[int]], other: list[list[int]]) -> dict:
    firsts = [first_divergence(a, b) for a, b in zip(ref, other, strict=True)]
    diverged = [f for f in firsts if f is not None]
    return {
        "diverged": len(diverged),
        "prompts": len(firsts),
        "rate": len(diverged) / len(firsts),
        "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None,
    }


def run_codec(model: str, codec: str, prompts: list[list[int]], tokens: int, workdir: Path) -> dict:
    store = workdir / f"store-{codec}"
    args = (
        "--enable-metrics",
        "--enable-cache-report",
        "--attention-backend",
        "torch_native",
        "--remote-kv",
        "dpu",
        "--remote-kv-store",
        f"file://{store}",
        "--remote-kv-codec",
        codec,
        "--remote-kv-chunk-size",
        str(CHUNK),
        "--remote-kv-policy-margin",
        "1e9",
    )
    with SGLangServer(ServerSpec(model_path=model, extra_args=args)) as srv:
        url = srv.base_url

        def run(**sampling):
            outs = [generate(url, p, tokens, **sampling) for p in prompts]
            return [o["output_ids"] for o in outs], [o["meta_info"] for o in outs]

        cold, _ = run()
        wait_writeback_idle(url)
        local, meta_local = run()
        flush_device_cache(url)
        remote, meta_remote = run()
        flush_device_cache(url)
        exact, meta_exact = run(custom_params={"remote_kv": "exact"})
        metrics = scrape(url)
    storage = [((m.get("cached_tokens_details") or {}).get("storage") or 0) for m in meta_remote]
    row = {
        "codec": codec,
        "remote_vs_local": compare(local, remote),
        "exact_vs_local": compare(local, exact),
        "cold_vs_local": compare(local, cold),
        "remote_hit_tokens_per_prompt": sum(storage) / len(storage),
        "local_hit_tokens_per_prompt": sum(m["cached_tokens"] for m in meta_local) / len(meta_local),
        "exact_cached_tokens_per_prompt": sum(m["cached_tokens"] for m in meta_exact) / len(meta_exact),
        "served_by": sorted(
            re.findall(
                r'codec="([^"]+)"', " ".join(k for k, v in metrics.items() if "hit_tokens_total" in k and v)
            )
        ),
        "exact_requests": {k: v for k, v in metrics.items() if "exact_requests_total" in k and v},
    }
    log.info("%s: %s", codec, row)
    return row


def table(rows: list[dict]) -> str:
    head = "| codec (served by) | remote vs local: diverged | mean first diverging token | exact vs local | cold vs local | remote-hit tokens/prompt |"
    lines = [head, "|" + "---|" * 6]
    for r in rows:
        rv, ev, cv = r["remote_vs_local"], r["exact_vs_local"], r["cold_vs_local"]
        first = f"{rv['mean_first_divergence']:.1f}" if rv["mean_first_divergence"] is not None else "-"
        lines.append(
            f"| {r['codec']} ({', '.join(r['served_by']) or '-'}) | {rv['diverged']}/{rv['prompts']} ({rv['rate']:.0%}) | {first} | "
            f"{ev['diverged']}/{ev['prompts']} | {cv['diverged']}/{cv['prompts']} | {r['remote_hit_tokens_per_prompt']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--chunks", type=int, default=6, help="chunks of 64 tokens per prompt")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per request")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[exactness] %(message)s")
    model = str(ensure_model("float32"))
    prompts = probe_prompts(model, args.prompts, args.chunks, CHUNK)
    with tempfile.TemporaryDirectory(prefix="srkv-exact-") as tmp:
        rows = [run_codec(model, c, prompts, args.tokens, Path(tmp)) for c in args.codecs.split(",")]
    result = {
        "model": "SmolLM2-135M float32",
        "prompts": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "greedy_tokens": args.tokens,
        "chunk_size": CHUNK,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
