"""The task-accuracy benchmark's item generator and scorer (benchmarks/task_accuracy_items.py); no server."""

from __future__ import annotations

import random
import re

import pytest

from benchmarks.task_accuracy_items import (
    DEPTHS,
    TASKS,
    Item,
    first_choice,
    first_number,
    make_items,
    make_suite,
    score,
    split_paragraphs,
)

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def count(text: str) -> int:
    """Stand-in tokenizer: one token per word."""
    return len(text.split())


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    rng = random.Random(1)
    texts = []
    for _ in range(4):
        paras = []
        for _ in range(30):
            sents = [
                " ".join(rng.choice(WORDS) for _ in range(rng.randrange(6, 14))).capitalize() + "."
                for _ in range(5)
            ]
            paras.append(" ".join(sents))
        texts.append("\n\n".join(paras))
    return split_paragraphs(texts)


def _item(answer: str, choices: tuple[str, ...] = ()) -> Item:
    return Item("passkey", 0, "doc", "q?", "The pass key is", answer, "needle", 0.5, 0.5, choices)


def test_corpus_filters_non_prose():
    paras = split_paragraphs(
        [
            "Short.\n\n"
            + "Files: a/b.c Copyright: someone who wrote a long line of text here and more. " * 3
            + "\n\nDigits 1234 5678 9012 3456 in a paragraph that is otherwise long enough to pass the test."
            + "\n\n"
            + "A plain paragraph of running text that is long enough to be kept by the filter. " * 2
        ]
    )
    assert len(paras) == 1 and paras[0].startswith("A plain paragraph")


@pytest.mark.parametrize("task", TASKS)
def test_items_are_deterministic(corpus, task):
    a = make_items(task, 9, seed=3, paragraphs=corpus, count=count, doc_tokens=300)
    b = make_items(task, 9, seed=3, paragraphs=corpus, count=count, doc_tokens=300)
    c = make_items(task, 9, seed=4, paragraphs=corpus, count=count, doc_tokens=300)
    assert a == b
    assert [i.document for i in a] != [i.document for i in c]


@pytest.mark.parametrize("task", TASKS)
def test_answer_at_stated_depth(corpus, task):
    items = make_items(task, 18, seed=0, paragraphs=corpus, count=count, doc_tokens=300)
    assert [it.depth for it in items] == [DEPTHS[i % len(DEPTHS)] for i in range(18)]
    assert sorted(DEPTHS) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    for it in items:
        assert it.document.count(it.needle) == 1 and it.answer in it.needle
        assert it.answer in re.findall(r"\d+", it.needle)
        total = count(it.document) - sum(count(n) for n in _needles(it))
        before = count(it.document[: it.document.index(it.needle)])
        before -= sum(count(n) for n in _needles(it) if it.document.index(n) < it.document.index(it.needle))
        assert before / total == pytest.approx(it.actual_depth, abs=1e-9)
        assert abs(it.actual_depth - it.depth) <= 14 / total  # within one sentence (<= 14 words here)
        assert it.document == it.document.strip() and it.needle in it.user_message
        assert it.user_message.endswith(it.question)
    # no two items share their start (so no two prompts share a prefix)
    assert len({it.document[:60].lower() for it in items}) == len(items)


def _needles(it: Item) -> list[str]:
    """Every inserted line of an item (the asked needle and its distractors)."""
    return [p for p in it.document.split("\n\n") if re.search(r"\b(pass key|population)\b", p)]


def test_multikey_has_distinct_doors_and_keys(corpus):
    for it in make_items("multikey", 9, seed=0, paragraphs=corpus, count=count, doc_tokens=300):
        doors = re.findall(r"The pass key of the (\w+) door is (\d+)\.", it.document)
        assert len(doors) == 4
        assert len({d for d, _ in doors}) == 4 and len({k for _, k in doors}) == 4
        asked = re.search(r"the (\w+) door", it.question).group(1)
        assert dict(doors)[asked] == it.answer and it.prime.endswith(f"the {asked} door is")


def test_kv_record_block(corpus):
    for it in make_items("kv", 9, seed=0, paragraphs=corpus, count=count, doc_tokens=300):
        recs = dict(re.findall(r"The population of (\w+) is (\d+)\.", it.needle))
        assert len(recs) == 4
        place = re.search(r"population of (\w+)\?", it.question).group(1)
        assert recs[place] == it.answer


def test_suite_items_never_start_alike(corpus):
    items = make_suite(TASKS, 12, seed=0, paragraphs=corpus, count=count, doc_tokens=200)
    assert [it.task for it in items] == [t for t in TASKS for _ in range(12)]
    assert len({it.document[:60].lower() for it in items}) == len(items)
    assert items == make_suite(TASKS, 12, seed=0, paragraphs=corpus, count=count, doc_tokens=200)


def test_unknown_task_and_small_corpus(corpus):
    with pytest.raises(ValueError, match="unknown task"):
        make_items("nope", 1, 0, corpus, count)
    with pytest.raises(ValueError, match="distinct start"):
        make_items("passkey", len(corpus) + 1, 0, corpus, count)


@pytest.mark.parametrize(
    "output",
    [
        " 48213.",
        "48213",
        " **48213**",
        " `48213`.",
        " 48,213.",
        " 48 213",
        " 48\u202f213.",
        "\n48213 is it",
        ": 48213!",
    ],
)
def test_score_numeric_variants(output):
    assert score(output, _item("48213"))


@pytest.mark.parametrize("output", [" 48212.", "", " unknown.", " 12345, not 48213", " 482130", " 4821"])
def test_score_numeric_wrong(output):
    assert not score(output, _item("48213"))


def test_first_number_and_choice():
    assert first_number("The key is 1,234,567.") == "1234567"
    assert first_number("no digits") is None
    assert first_choice(" It is oslo, not Paris.", ("Paris", "Oslo")) == "Oslo"
    assert first_choice(" Parisian", ("Paris",)) is None
    assert score(" oslo.", _item("Oslo", ("Paris", "Oslo")))
    assert not score(" Paris or Oslo", _item("Oslo", ("Paris", "Oslo")))
