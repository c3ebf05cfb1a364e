"""Task accuracy of recompute, local hits and remote hits per codec and quality level, on real servers
(``make bench-task-accuracy``; part 3 of issue #38: task accuracy, not only KL).

Items (``benchmarks/task_accuracy_items.py``): RULER-style retrieval from ~1,000-token haystacks cut from
the texts on this machine, the needle at depths 10%..90%: ``passkey`` (one pass key), ``multikey`` (four
coloured doors' pass keys, one asked), ``kv`` (four "population of X" records, one asked); chat template,
the assistant's answer primed ("The pass key is"), greedy, scored by string match on the first number.

One ``--remote-kv dpu`` server per codec / quality level (levels have their own key namespaces), file://
store in a temporary directory, chunks of 64 tokens, fetch always preferred (``--remote-kv-policy-margin
1e9``), float32 weights (the build the calibration belongs to), the platform's default attention
(``cpu_prefix``: a hit's extend attends only its new tokens; ``torch_native`` pads them to the whole
prompt). Per server, per item: a cold request (recomputed, written back), on the first server the same
request again (a **local hit**: SGLang's radix cache), then after the write-back went quiet and
``/flush_cache`` every item once more: a **remote hit** (the document's chunks come back through the
codec; ``cached_tokens_details.storage`` says how many tokens, reported as the remote-hit token share). The transform codec's default level is served by a
server started without ``--remote-kv-quality`` (what a user gets), the metrics' ``quality`` label says
which level that was; ``--quantizer`` passes ``--remote-kv-quantizer`` to every transform server (named in
the conditions, ``transform+scalar@0.0005``), otherwise they write their default quantizer.

Reported per condition and task: accuracy with a Wilson 95% interval; for every condition against
recompute on the same items: the accuracy delta with a paired bootstrap 95% interval, McNemar's exact
p-value, and the share of items whose extracted answer differs. Top level: ``default_accuracy_delta``
(remote hit at the default level minus recompute, a fraction) with its interval, and ``per_level``.
Writes ``docs/results/task_accuracy.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.e2e_probe import generate
from benchmarks.e2e_server import flush_device_cache, metric, scrape
from benchmarks.launcher import ServerSpec, SGLangServer
from benchmarks.task_accuracy_items import TASKS, load_corpus, make_suite
from benchmarks.task_accuracy_report import build_result, level_table, table, transform_name
from sgl_remote_kv.model import ensure_model
from sgl_remote_kv.types import DEFAULT_QUALITY, QUALITY_LEVELS, QUANTIZERS

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "task_accuracy.json"
CODECS = ("transform", "lossless", "quant_deflate")  # transform: one server per --levels entry
CHUNK = 64
ANSWER_TOKENS = 8  # " 48213." is 7 tokens; generation also stops at a newline
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # --server-threads
log = logging.getLogger("bench_task_accuracy")


# -- servers ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Condition:
    name: str  # e.g. "transform@0.001", "lossless"
    codec: str  # --remote-kv-codec
    quality: str | None  # --remote-kv-quality (None: the server's default)
    quantizer: str | None = None  # --remote-kv-quantizer (None: the server's default)


def conditions(codecs: list[str], levels: list[str], quantizer: str | None = None) -> list[Condition]:
    """The default level first (the headline; its server gives recompute and local hits), then the other
    codecs, then the other levels, finest first. ``quantizer``: the transform servers' (None: their default)."""
    out = []
    levels = sorted(levels, key=lambda q: (q != DEFAULT_QUALITY, QUALITY_LEVELS.index(q)))
    for c in codecs:
        if c == "transform":
            for q in levels:
                # the default level is served by a server started without the flag: what a user gets
                quality = None if q == DEFAULT_QUALITY else q
                out.append(Condition(transform_name(q, quantizer), "default", quality, quantizer))
        else:
            out.append(Condition(c, c, None))
    rank = {c.name: k for k, c in enumerate(out)}
    return sorted(
        out,
        key=lambda c: (
            c.name != transform_name(DEFAULT_QUALITY, quantizer),
            c.name.startswith("transform"),
            rank[c.name],
        ),
    )


def wait_written(url: str, min_chunks: int, quiet_s: float = 4.0, timeout_s: float = 300.0) -> float:
    """Wait until at least ``min_chunks`` chunks were written back (or skipped) and the count stood still for
    ``quiet_s`` (tail sub-chunks come on top); a loaded machine encodes slowly, and a flush before the
    write-back landed would turn remote hits into misses. Returns the written bytes."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        m = scrape(url)
        # a chunk already in the store (another prompt's identical prefix) is skipped, not written
        chunks = metric(m, "remote_kv_written_chunks_total") + metric(m, "remote_kv_writeback_skipped_total")
        if chunks != last:
            last, since = chunks, time.monotonic()
        elif chunks >= min_chunks and time.monotonic() - since >= quiet_s:
            return metric(m, "remote_kv_written_bytes_total")
        time.sleep(1.0)
    log.warning("write-back: %s of at least %d chunks after %.0f s", last, min_chunks, timeout_s)
    return metric(scrape(url), "remote_kv_written_bytes_total")


def server_args(cond: Condition, store: Path) -> tuple[str, ...]:
    args = [
        "--enable-metrics",
        "--enable-cache-report",
        "--remote-kv",
        "dpu",
        "--remote-kv-store",
        f"file://{store}",
        "--remote-kv-codec",
        cond.codec,
        "--remote-kv-chunk-size",
        str(CHUNK),
        "--remote-kv-policy-margin",
        "1e9",
    ]
    if cond.quality is not None:
        args += ["--remote-kv-quality", cond.quality]
    if cond.quantizer is not None:
        args += ["--remote-kv-quantizer", cond.quantizer]
    return tuple(args)


def _ask(url: str, ids: list[int], tok, tokens: int = ANSWER_TOKENS) -> dict:
    t0 = time.monotonic()
    out = generate(url, ids, tokens, ignore_eos=False, stop=["\n"])
    meta = out.get("meta_info", {})
    return {
        "text": tok.decode(out["output_ids"], skip_special_tokens=True),
        "first_token": out["output_ids"][0] if out["output_ids"] else None,
        "cached": meta.get("cached_tokens") or 0,
        "storage": (meta.get("cached_tokens_details") or {}).get("storage") or 0,
        "s": time.monotonic() - t0,
    }


def _each(fn, prompts: list[list[int]], concurrency: int) -> list:
    """``fn(ids)`` for every prompt, ``concurrency`` at a time, results in prompt order."""
    if concurrency <= 1:
        return [fn(ids) for ids in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(fn, prompts))


def run_server(
    model: str,
    cond: Condition,
    prompts: list[list[int]],
    tok,
    workdir: Path,
    logdir: Path,
    first: bool,
    concurrency: int,
    threads: int = 0,
) -> dict:
    """Cold pass (on the first server each prompt at once again: the local hit; later servers generate one
    token only: the cold pass is their write-back), then ``/flush_cache`` and the remote pass."""
    store = workdir / f"store-{cond.name}"
    t0 = time.monotonic()
    spec = ServerSpec(
        model_path=model,
        extra_args=server_args(cond, store),
        log_path=str(logdir / f"server-{cond.name}.log"),
    )
    with SGLangServer(spec) as srv:
        url = srv.base_url
        started = time.monotonic() - t0

        def cold_local(ids: list[int]) -> tuple[dict, dict | None]:
            cold = _ask(url, ids, tok, ANSWER_TOKENS if first else 1)
            # right after its cold request: the radix cache still holds the whole prompt
            return cold, (_ask(url, ids, tok) if first else None)

        pairs = _each(cold_local, prompts, concurrency)
        cold, loc = [c for c, _ in pairs], [x for _, x in pairs if x is not None]
        t_cold = time.monotonic()
        log.info("%s: cold%s pass %.0fs", cond.name, " + local" if first else "", t_cold - t0 - started)
        written = wait_written(url, sum((len(p) - 1) // CHUNK for p in prompts))
        flush_device_cache(url)
        t_flush = time.monotonic()
        remote = _each(lambda ids: _ask(url, ids, tok), prompts, concurrency)
        t_remote = time.monotonic()
        metrics = scrape(url)
    served_by = sorted(
        set(
            re.findall(
                r'codec="([^"]+)"', " ".join(k for k, v in metrics.items() if "hit_tokens_total" in k and v)
            )
        )
    )
    quality = sorted(
        set(
            re.findall(
                r'quality="([^"]+)"',
                " ".join(k for k, v in metrics.items() if "hit_tokens_by_quality" in k and v),
            )
        )
    )
    row = {
        "condition": cond.name,
        "server_args": list(server_args(cond, Path("<tmp>/store"))),
        "served_by": served_by,
        "quality_served": quality,
        "cold": cold,
        "local": loc,
        "remote": remote,
        "written_bytes": written,
        "fetched_bytes": metric(metrics, "remote_kv_fetched_bytes_total") or None,
        "failures": {k: v for k, v in metrics.items() if "failures" in k and v},
        "seconds": {
            "start": started,
            "cold": t_cold - t0 - started,
            "writeback_wait": t_flush - t_cold,
            "remote": t_remote - t_flush,
            "remote_request_mean": sum(r["s"] for r in remote) / len(remote),
        },
    }
    log.info(
        "%s: served by %s %s, remote-hit share %.3f, %.0fs",
        cond.name,
        served_by,
        quality,
        sum(r["storage"] for r in remote) / max(1, sum(len(p) for p in prompts)),
        time.monotonic() - t0,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=18, help="items per task (depths cycle through 10%%..90%%)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--codecs", default=",".join(CODECS), help="transform = one server per --levels entry")
    ap.add_argument("--levels", default=",".join(QUALITY_LEVELS), help="transform codec quality levels")
    ap.add_argument(
        "--quantizer",
        choices=QUANTIZERS,
        default=None,
        help="the transform servers' --remote-kv-quantizer (default: none passed, the servers' default; a "
        "named one is in the condition names, transform+scalar@0.0005, and leaves default_accuracy_delta null)",
    )
    ap.add_argument("--doc-tokens", type=int, default=1000, help="haystack length in tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight (1: one at a time, the cleanest comparison; more: batched, faster on a loaded "
        "machine, and batch shapes add their own float noise, which local_hit and lossless then show)",
    )
    ap.add_argument(
        "--server-threads",
        type=int,
        default=0,
        help="OpenMP/BLAS threads of each server (0: torch's default, one per core). On a machine shared with "
        "other busy processes use 1: two OpenMP threads that cannot run at once spin at every barrier (a "
        "prefill GEMM ran 2.3x slower with 2 threads than with 1 at load average 8 here)",
    )
    ap.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "srkv-task-accuracy-logs")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[task-accuracy] %(message)s")
    codecs = [c for c in args.codecs.split(",") if c]
    levels = [q for q in args.levels.split(",") if q]
    tasks = [t for t in args.tasks.split(",") if t]
    for q in levels:
        if q not in QUALITY_LEVELS:
            ap.error(f"--levels: {q!r} is not one of {QUALITY_LEVELS}")
    t_start = time.monotonic()
    load_start = os.getloadavg()

    from transformers import AutoTokenizer

    model = str(ensure_model("float32"))
    tok = AutoTokenizer.from_pretrained(model)

    def count(s: str) -> int:
        return len(tok(s, add_special_tokens=False)["input_ids"])

    corpus = load_corpus()
    items = make_suite(tasks, args.items, args.seed, corpus, count, args.doc_tokens)
    prompts = []
    for it in items:
        text = tok.apply_chat_template(
            [{"role": "user", "content": it.user_message}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tok(text + it.prime, add_special_tokens=False)["input_ids"])
    log.info("%d items, prompts %d..%d tokens", len(items), min(map(len, prompts)), max(map(len, prompts)))

    rows: list[dict] = []
    conds = conditions(codecs, levels, args.quantizer)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "argv": argv if argv is not None else sys.argv[1:],
        "t_start": t_start,
        "load_start": load_start,
        "chunk_size": CHUNK,
        "answer_tokens": ANSWER_TOKENS,
    }
    with tempfile.TemporaryDirectory(prefix="srkv-taskacc-") as tmp:
        for k, cond in enumerate(conds):
            rows.append(
                run_server(
                    model,
                    cond,
                    prompts,
                    tok,
                    Path(tmp),
                    args.log_dir,
                    k == 0,
                    args.concurrency,
                    args.server_threads,
                )
            )
            # written after every server: an interrupted run keeps what it measured ("complete": false)
            result = build_result(
                rows, items, prompts, tasks, levels, args, meta, complete=k == len(conds) - 1
            )
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if result["per_level"]:
        print()
        print(level_table(result))
    if result["default_accuracy_delta"] is not None:
        lo, hi = result["default_accuracy_delta_ci95"]
        print(
            f"\ndefault_accuracy_delta (remote hit at {DEFAULT_QUALITY} - recompute): "
            f"{result['default_accuracy_delta']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        )
    print(f"wrote {args.out} ({result['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
