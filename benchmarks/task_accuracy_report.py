"""The statistics, result JSON and tables of ``bench_task_accuracy``: conditions answered the same items, so
each is compared with recompute *paired* (Wilson intervals of an accuracy, a paired bootstrap interval of the
difference, McNemar's exact test on the discordant items); the JSON of the servers run so far
(``build_result``); markdown tables of it."""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shlex
import time

from benchmarks.task_accuracy_items import TASKS, Item, extract, score
from sgl_remote_kv.types import DEFAULT_QUALITY, DEFAULT_QUANTIZER, QUALITY_LEVELS


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def paired_bootstrap(a: list[bool], b: list[bool], reps: int = 5000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of mean(b) - mean(a) over items resampled with replacement (paired)."""
    d = [int(y) - int(x) for x, y in zip(a, b, strict=True)]
    if not d:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(d)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return (means[int(0.025 * reps)], means[min(reps - 1, int(0.975 * reps))])


def mcnemar_exact(a: list[bool], b: list[bool]) -> dict:
    """Discordant pairs (a right / b wrong, a wrong / b right) and the exact two-sided p-value."""
    lost = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    gained = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    m = lost + gained
    tail = sum(math.comb(m, i) for i in range(min(lost, gained) + 1)) / 2**m if m else 1.0
    return {"lost": lost, "gained": gained, "p": min(1.0, 2 * tail)}


def accuracy(correct: list[bool]) -> dict:
    k, n = sum(correct), len(correct)
    lo, hi = wilson(k, n)
    return {"correct": k, "items": n, "accuracy": k / n if n else None, "ci95": [lo, hi]}


def versus(ref: list[bool], other: list[bool], ref_ans: list, other_ans: list, seed: int) -> dict:
    n = len(ref)
    lo, hi = paired_bootstrap(ref, other, seed=seed)
    return {
        "delta": (sum(other) - sum(ref)) / n if n else None,
        "ci95": [lo, hi],
        "mcnemar": mcnemar_exact(ref, other),
        "answer_changed": sum(1 for x, y in zip(ref_ans, other_ans, strict=True) if x != y) / n
        if n
        else None,
    }


def summarize(items: list[Item], answers: dict[str, list[str]], seed: int) -> dict:
    """Per condition: accuracy per task and over all; vs recompute: paired delta, CI, McNemar."""
    by_task = {t: [i for i, it in enumerate(items) if it.task == t] for t in TASKS}
    by_task = {t: ix for t, ix in by_task.items() if ix}
    correct = {c: [score(a, it) for a, it in zip(ans, items, strict=True)] for c, ans in answers.items()}
    extracted = {c: [extract(a, it) for a, it in zip(ans, items, strict=True)] for c, ans in answers.items()}
    ref, ref_x = correct["recompute"], extracted["recompute"]
    out = {}
    for c in answers:
        row = {"all": accuracy(correct[c])}
        for t, ix in by_task.items():
            row[t] = accuracy([correct[c][i] for i in ix])
        depths = sorted({it.depth for it in items})
        row["by_depth"] = {
            f"{d:.1f}": accuracy([correct[c][i] for i, it in enumerate(items) if it.depth == d])
            for d in depths
        }
        if c != "recompute":
            row["vs_recompute"] = {"all": versus(ref, correct[c], ref_x, extracted[c], seed)}
            for t, ix in by_task.items():
                row["vs_recompute"][t] = versus(
                    [ref[i] for i in ix],
                    [correct[c][i] for i in ix],
                    [ref_x[i] for i in ix],
                    [extracted[c][i] for i in ix],
                    seed,
                )
        out[c] = row
    return out


def transform_name(quality: str, quantizer: str | None) -> str:
    """``transform@0.001``: the server's default quantizer; ``transform+scalar@0.001``: a named one."""
    return f"transform{'' if quantizer is None else '+' + quantizer}@{quality}"


def build_result(
    rows: list[dict],
    items: list[Item],
    prompts: list[list[int]],
    tasks: list[str],
    levels: list[str],
    args: argparse.Namespace,
    meta: dict,
    complete: bool,
) -> dict:
    """The JSON of the servers run so far (recompute and local hits from the first)."""
    first = rows[0]
    answers = {
        "recompute": [r["text"] for r in first["cold"]],
        "local_hit": [r["text"] for r in first["local"]],
    }
    for r in rows:
        answers[f"remote:{r['condition']}"] = [x["text"] for x in r["remote"]]
    cond_rows = summarize(items, answers, args.seed)
    total_prompt = sum(len(p) for p in prompts)
    cond_rows["local_hit"]["cached_token_share"] = sum(x["cached"] for x in first["local"]) / total_prompt
    for r in rows:
        c = cond_rows[f"remote:{r['condition']}"]
        c["remote_hit_token_share"] = sum(x["storage"] for x in r["remote"]) / total_prompt
        c["cached_token_share"] = sum(x["cached"] for x in r["remote"]) / total_prompt
        c["items_with_remote_hit"] = sum(1 for x in r["remote"] if x["storage"] > 0)
        c["served_by"], c["quality_served"] = r["served_by"], r["quality_served"]
        c["server_args"], c["seconds"], c["failures"] = r["server_args"], r["seconds"], r["failures"]
        c["written_bytes"], c["fetched_bytes"] = r["written_bytes"], r["fetched_bytes"]
        # recompute is deterministic (fp32, one request at a time): every server's cold first token should
        # equal the first server's
        c["cold_first_token_differs_from_recompute"] = sum(
            1 for x, y in zip(r["cold"], first["cold"], strict=True) if x["first_token"] != y["first_token"]
        )
    quantizer = args.quantizer
    per_level = {}
    for q in sorted(levels, key=QUALITY_LEVELS.index):
        c = cond_rows.get(f"remote:{transform_name(q, quantizer)}")
        if c:
            v = c["vs_recompute"]["all"]
            per_level[q] = {
                "accuracy": c["all"]["accuracy"],
                "delta": v["delta"],
                "ci95": v["ci95"],
                "mcnemar": v["mcnemar"],
                "answer_changed": v["answer_changed"],
                "remote_hit_token_share": c["remote_hit_token_share"],
                "served_by": c["served_by"],
                "quality_served": c["quality_served"],
            }
    # the headline is what a user gets: the default level with the default quantizer
    default = cond_rows.get(f"remote:{transform_name(DEFAULT_QUALITY, None)}")
    result = {
        "model": "SmolLM2-135M-Instruct float32 (dequantized from GGUF Q4_1)",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "loadavg_start": meta["load_start"],
            "loadavg_end": os.getloadavg(),
        },
        "command": "python -m benchmarks.bench_task_accuracy " + shlex.join(meta["argv"]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": time.monotonic() - meta["t_start"],
        "complete": complete,
        "conditions_run": [r["condition"] for r in rows],
        "tasks": tasks,
        "items_per_task": args.items,
        "items": len(items),
        "doc_tokens": args.doc_tokens,
        "prompt_tokens": {
            "min": min(map(len, prompts)),
            "max": max(map(len, prompts)),
            "mean": total_prompt / len(prompts),
        },
        "chunk_size": meta["chunk_size"],
        "answer_tokens": meta["answer_tokens"],
        "concurrency": args.concurrency,
        "server_threads": args.server_threads or None,
        "seed": args.seed,
        "default_level": DEFAULT_QUALITY,
        "quantizer": quantizer or DEFAULT_QUANTIZER,
        "default_accuracy_delta": default["vs_recompute"]["all"]["delta"] if default else None,
        "default_accuracy_delta_ci95": default["vs_recompute"]["all"]["ci95"] if default else None,
        "per_level": per_level,
        "conditions": cond_rows,
        "per_item": [
            {
                "task": it.task,
                "index": it.index,
                "depth": it.depth,
                "actual_depth": round(it.actual_depth, 4),
                "answer": it.answer,
                "prompt_tokens": len(p),
                "outputs": {c: answers[c][i] for c in answers},
                "remote_hit_tokens": {f"remote:{r['condition']}": r["remote"][i]["storage"] for r in rows},
            }
            for i, (it, p) in enumerate(zip(items, prompts, strict=True))
        ],
    }
    return result


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table(result: dict) -> str:
    tasks = result["tasks"]
    head = ["condition", "remote-hit share"] + [f"{t} acc % [95% CI]" for t in tasks]
    head += [
        "all acc % [95% CI]",
        "delta vs recompute, pts [95% CI]",
        "McNemar lost/gained (p)",
        "answers changed",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, row in result["conditions"].items():
        cells = [
            c,
            _pct(row.get("remote_hit_token_share")) + ("%" if "remote_hit_token_share" in row else ""),
        ]
        for t in [*tasks, "all"]:
            a = row[t]
            cells.append(f"{_pct(a['accuracy'])} [{_pct(a['ci95'][0])}, {_pct(a['ci95'][1])}]")
        v = row.get("vs_recompute", {}).get("all")
        if v:
            cells.append(f"{100 * v['delta']:+.1f} [{100 * v['ci95'][0]:+.1f}, {100 * v['ci95'][1]:+.1f}]")
            m = v["mcnemar"]
            cells.append(f"{m['lost']}/{m['gained']} ({m['p']:.2f})")
            cells.append(f"{100 * v['answer_changed']:.1f}%")
        else:
            cells += ["(reference)", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def level_table(result: dict) -> str:
    lines = ["| level | remote-hit share | accuracy % | delta vs recompute, pts [95% CI] | answers changed |"]
    lines.append("|---|---|---|---|---|")
    for q, r in result["per_level"].items():
        lines.append(
            f"| {q}{' (default)' if q == result['default_level'] else ''} | {_pct(r['remote_hit_token_share'])}% | "
            f"{_pct(r['accuracy'])} | {100 * r['delta']:+.1f} [{100 * r['ci95'][0]:+.1f}, {100 * r['ci95'][1]:+.1f}] | "
            f"{_pct(r['answer_changed'])}% |"
        )
    return "\n".join(lines)
