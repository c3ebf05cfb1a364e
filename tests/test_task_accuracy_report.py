"""The task-accuracy benchmark's statistics (benchmarks/task_accuracy_report.py): the intervals and the
paired test behind ``default_accuracy_delta``, on hand-checked values, and the conditions it runs; no server."""

from __future__ import annotations

import pytest

from benchmarks.task_accuracy_items import Item
from benchmarks.task_accuracy_report import mcnemar_exact, paired_bootstrap, summarize, versus, wilson


def test_wilson_matches_the_textbook_interval():
    lo, hi = wilson(8, 9)  # 8 of 9: [0.565, 0.980] (Wilson score, z = 1.96)
    assert lo == pytest.approx(0.56499, abs=1e-4) and hi == pytest.approx(0.98011, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


@pytest.mark.parametrize(("lost", "gained", "p"), [(1, 0, 1.0), (2, 0, 0.5), (6, 0, 2 / 64), (3, 3, 1.0)])
def test_mcnemar_exact_two_sided(lost, gained, p):
    ref = [True] * lost + [False] * gained + [True] * 5
    other = [False] * lost + [True] * gained + [True] * 5
    m = mcnemar_exact(ref, other)
    assert (m["lost"], m["gained"]) == (lost, gained)
    assert m["p"] == pytest.approx(p)


def test_paired_bootstrap_one_flip_in_27():
    ref = [True] * 27
    other = [False] + [True] * 26
    lo, hi = paired_bootstrap(ref, other, reps=5000, seed=0)
    assert hi == 0.0 and -4 / 27 <= lo <= -1 / 27  # the flipped item resampled 1..4 times at the 2.5% tail
    assert paired_bootstrap(ref, ref) == (0.0, 0.0)
    with pytest.raises(ValueError):
        paired_bootstrap(ref, other[:-1])  # unpaired lists are an error, not a silent truncation


def test_versus_counts_changed_answers_not_only_scores():
    v = versus([True, False], [True, False], ["1", "2"], ["1", "3"], seed=0)  # same scores, one answer moved
    assert v["delta"] == 0.0 and v["answer_changed"] == 0.5


def _item(task: str, answer: str, depth: float) -> Item:
    return Item(task, 0, "doc", "q?", "The pass key is", answer, "needle", depth, depth)


def test_summarize_pairs_every_condition_with_recompute():
    items = [_item("passkey", "111", 0.1), _item("passkey", "222", 0.5), _item("kv", "333", 0.5)]
    answers = {
        "recompute": [" 111.", " 222.", " 999."],
        "remote:x": [" 111.", " 000.", " 333."],  # one lost, one gained
    }
    s = summarize(items, answers, seed=0)
    assert s["recompute"]["all"]["correct"] == 2 and "vs_recompute" not in s["recompute"]
    v = s["remote:x"]["vs_recompute"]
    assert (
        v["all"]["delta"] == 0.0 and v["all"]["mcnemar"]["lost"] == 1 and v["all"]["mcnemar"]["gained"] == 1
    )
    assert v["passkey"]["delta"] == pytest.approx(-0.5) and v["kv"]["delta"] == pytest.approx(1.0)
    assert s["remote:x"]["by_depth"]["0.5"]["correct"] == 1


def test_conditions_name_and_pass_a_quantizer():
    """The default level leads (its server gives recompute and local hits) and gets no flags; a named
    quantizer reaches every transform server and its condition names, and nothing else."""
    from pathlib import Path

    from benchmarks.bench_task_accuracy import conditions, server_args

    plain = conditions(["lossless", "transform"], ["0.001", "0.0005"])
    assert [c.name for c in plain] == ["transform@0.0005", "lossless", "transform@0.001"]
    args = server_args(plain[0], Path("/s"))
    assert "--remote-kv-quality" not in args and "--remote-kv-quantizer" not in args
    named = conditions(["transform", "lossless"], ["0.0005", "0.001"], "scalar")
    assert [c.name for c in named] == ["transform+scalar@0.0005", "lossless", "transform+scalar@0.001"]
    tail = server_args(named[2], Path("/s"))[-4:]
    assert tail == ("--remote-kv-quality", "0.001", "--remote-kv-quantizer", "scalar")
    assert "--remote-kv-quantizer" not in server_args(named[1], Path("/s"))
