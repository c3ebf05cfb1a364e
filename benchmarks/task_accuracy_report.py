"""The statistics and tables of ``bench_task_accuracy``: conditions answered the same items, so each is
compared with recompute *paired* (Wilson intervals of an accuracy, a paired bootstrap interval of the
difference, McNemar's exact test on the discordant items); markdown tables of the result JSON."""

from __future__ import annotations

import math
import random

from benchmarks.task_accuracy_items import TASKS, Item, extract, score


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
