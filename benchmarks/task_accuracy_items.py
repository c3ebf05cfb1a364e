"""Items and scoring of the task-accuracy benchmark (``benchmarks/bench_task_accuracy.py``).

RULER-style retrieval items built from texts on this machine (license texts and Debian copyright
files, prose only), each a long haystack with one or more facts ("needles") inserted at a stated
depth, a question about one of them and the start of the assistant's answer ("prime"):

- ``passkey``: one pass key (5 digits) at the stated depth; "What is the pass key?"
- ``multikey``: four pass keys of differently coloured doors, the asked one at the stated depth and
  the three others at random places; "What is the pass key of the red door?"
- ``kv``: a block of records ("The population of Zorbia is 475.", four of them) at the stated depth;
  "What is the population of Zorbia?" (key-value retrieval from a generated table).

Everything is deterministic given the corpus, the seed and the token counter: the benchmark passes the
model's tokenizer (``count_tokens``), tests a stand-in. Depths are fractions of the haystack's tokens
(the needle's start over the haystack's length, questions and templates excluded); an item records the
depth it asked for and the one it got (sentence granularity). No two items of one call start with the
same opening (first 60 characters), so their prompts share no 64-token chunk, only the chat template's few
tokens.

Scoring (``score``) is by string match on the first candidate in the model's output: for numeric
answers the first number (thousands separators, spaces or narrow spaces between digit groups,
markdown emphasis and a trailing period tolerated), otherwise the first of the item's ``choices``
named (whole word, case-insensitive). A wrong number named first is wrong even if the right one
follows.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

TASKS = ("passkey", "multikey", "kv")
DEPTHS = (
    0.1,
    0.5,
    0.9,
    0.3,
    0.7,
    0.2,
    0.6,
    0.4,
    0.8,
)  # item i asks at DEPTHS[i % 9]: a few items span the range
CORPUS_GLOBS = ("/usr/share/common-licenses/*", "/usr/share/doc/*/copyright")
MIN_PARAGRAPH_CHARS = 120
MAX_SENTENCE_CHARS = 500
START_KEY_CHARS = 60  # items start at paragraphs whose first 60 characters (~12 tokens) differ

COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
PLACES = ("Zorbia", "Quenland", "Trivania", "Morlond", "Aspeth", "Kelvaria", "Dunmark", "Oressa")
DISTRACTORS = 3  # multikey: other doors; kv: other records

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class Item:
    task: str
    index: int
    document: str  # the haystack with its needle(s)
    question: str  # appended to the document in the user turn
    prime: str  # the assistant turn starts with it; the model completes the answer
    answer: str
    needle: str  # the sentence (or block) that holds the answer
    depth: float  # asked for
    actual_depth: float  # token share of the haystack before the needle
    choices: tuple[str, ...] = ()  # closed answer set (non-numeric answers)

    @property
    def user_message(self) -> str:
        return f"{self.document}\n\n{self.question}"


# -- corpus -----------------------------------------------------------------------------------------
def load_corpus(globs: Sequence[str] = CORPUS_GLOBS) -> list[str]:
    """Paragraphs of the texts on this machine (whitespace-normalised, ASCII prose of at least
    ``MIN_PARAGRAPH_CHARS``, deduplicated by their first 200 characters), in a fixed order."""
    paths: list[Path] = []
    for g in globs:
        paths += sorted(Path("/").glob(g.lstrip("/")))
    return split_paragraphs(p.read_text(errors="replace") for p in paths if p.is_file())


def split_paragraphs(texts) -> list[str]:
    out, seen = [], set()
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            key = para[:200].lower()
            if key in seen or not _is_prose(para):
                continue
            seen.add(key)
            out.append(para)
    return out


def _is_prose(para: str) -> bool:
    """Plain running text: ASCII, long enough, few digits (numbers would compete with the answers), no
    Debian copyright-format fields, sentences of a readable length."""
    return (
        len(para) >= MIN_PARAGRAPH_CHARS
        and para.isascii()
        and sum(ch.isdigit() for ch in para) <= 0.01 * len(para)
        and re.match(r"[A-Z][A-Za-z-]*:\s", para) is None
        and para[-1] in '.;:!?)"'
        and max(len(s) for s in _sentences(para)) <= MAX_SENTENCE_CHARS
    )


def _sentences(para: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.;:!?])\s+", para) if s]


# -- items ------------------------------------------------------------------------------------------
def _haystack(paragraphs: Sequence[str], start: int, doc_tokens: int, count: TokenCounter) -> list[list[str]]:
    """Paragraphs (as sentence lists) from ``start`` on, wrapping around, until ``doc_tokens`` (the last
    one cut after the sentence that reaches it)."""
    out, n, i = [], 0, start
    while n < doc_tokens:
        if i - start >= len(paragraphs):
            raise ValueError(f"corpus has fewer than {doc_tokens} tokens")
        para: list[str] = []
        for sent in _sentences(paragraphs[i % len(paragraphs)]):
            para.append(sent)
            n += count(sent)
            if n >= doc_tokens:
                break
        out.append(para)
        i += 1
    return out


def _insert(
    paras: list[list[str]], needles: list[tuple[float, str]], count: TokenCounter
) -> tuple[str, list[float]]:
    """Join the haystack with each needle as its own paragraph at the sentence boundary nearest to its
    depth; returns the document and each needle's actual depth (in the order given)."""
    units = [(s, j == len(p) - 1) for p in paras for j, s in enumerate(p)]  # (sentence, ends a paragraph)
    sizes = [count(s) for s, _ in units]
    total = sum(sizes)
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    at: dict[int, list[str]] = {}
    actual = []
    for depth, text in needles:
        b = min(range(1, len(units)), key=lambda k: (abs(cum[k] - depth * total), k))
        at.setdefault(b, []).append(text)
        actual.append(cum[b] / total)
    parts: list[str] = []
    for k, (sent, _) in enumerate(units):
        if k in at:
            parts += ["\n\n", "\n\n".join(at[k]), "\n\n"]
        elif parts:
            parts.append("\n\n" if units[k - 1][1] else " ")
        parts.append(sent)
    doc = re.sub(r"\n\n(\n\n)+", "\n\n", "".join(parts))
    return doc, actual


def pick_starts(paragraphs: Sequence[str], n: int, rng: random.Random) -> list[int]:
    """``n`` start paragraphs whose openings (first ``START_KEY_CHARS`` characters) all differ: two prompts
    sharing a 64-token chunk would turn one's cold request into a remote hit."""
    firsts: dict[str, int] = {}
    for k, para in enumerate(paragraphs):
        firsts.setdefault(para[:START_KEY_CHARS].lower(), k)
    candidates = sorted(firsts.values())
    if n > len(candidates):
        raise ValueError(f"{n} items need {n} distinct start paragraphs; the corpus has {len(candidates)}")
    return rng.sample(candidates, n)


def make_suite(
    tasks: Sequence[str],
    n: int,
    seed: int,
    paragraphs: Sequence[str],
    count: TokenCounter,
    doc_tokens: int = 1000,
) -> list[Item]:
    """``n`` items of every task, no two of them (of any task) starting alike."""
    starts = pick_starts(paragraphs, n * len(tasks), random.Random(f"starts:{seed}"))
    return [
        it
        for k, task in enumerate(tasks)
        for it in make_items(task, n, seed, paragraphs, count, doc_tokens, starts=starts[k * n : (k + 1) * n])
    ]


def make_items(
    task: str,
    n: int,
    seed: int,
    paragraphs: Sequence[str],
    count: TokenCounter,
    doc_tokens: int = 1000,
    depths: Sequence[float] = DEPTHS,
    starts: Sequence[int] | None = None,
) -> list[Item]:
    """``n`` items of ``task``; item ``i`` asks at depth ``depths[i % len(depths)]`` (by default 10%..90%, in an
    order that spreads the first few items over the range). ``starts``: the paragraphs the haystacks begin
    at (default: ``pick_starts``)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; one of {TASKS}")
    if starts is None:
        starts = pick_starts(paragraphs, n, random.Random(f"starts:{task}:{seed}"))
    if len(starts) != n:
        raise ValueError(f"{n} items need {n} start paragraphs, got {len(starts)}")
    rng = random.Random(f"{task}:{seed}")
    items = []
    for i, start in enumerate(starts):
        depth = depths[i % len(depths)]
        paras = _haystack(paragraphs, start, doc_tokens, count)
        others = [rng.uniform(0.05, 0.95) for _ in range(DISTRACTORS)]
        choices: tuple[str, ...] = ()
        if task == "passkey":
            answer = str(rng.randrange(10000, 100000))
            needle = f"The pass key is {answer}. Remember it. {answer} is the pass key."
            needles = [(depth, needle)]
            question, prime = "What is the pass key?", "The pass key is"
        elif task == "multikey":
            doors = rng.sample(COLOURS, DISTRACTORS + 1)
            keys = rng.sample(range(10000, 100000), DISTRACTORS + 1)
            answer = str(keys[0])
            needle = f"The pass key of the {doors[0]} door is {answer}."
            needles = [(depth, needle)] + [
                (d, f"The pass key of the {c} door is {k}.")
                for d, c, k in zip(others, doors[1:], keys[1:], strict=True)
            ]
            question = f"What is the pass key of the {doors[0]} door?"
            prime = f"The pass key of the {doors[0]} door is"
        else:  # kv
            places = rng.sample(PLACES, DISTRACTORS + 1)
            values = rng.sample(range(100, 1000), DISTRACTORS + 1)
            records = [f"The population of {p} is {v}." for p, v in zip(places, values, strict=True)]
            q = rng.randrange(len(places))
            answer, needle = str(values[q]), "\n".join(records)
            needles = [(depth, needle)]
            question, prime = f"What is the population of {places[q]}?", f"The population of {places[q]} is"
        doc, actual = _insert(paras, needles, count)
        items.append(Item(task, i, doc, question, prime, answer, needle, depth, actual[0], choices))
    return items


# -- scoring ----------------------------------------------------------------------------------------
_NUMBER = re.compile(r"\d{1,3}(?:[,\u00a0\u202f ]\d{3})+(?!\d)|\d+")


def first_number(text: str) -> str | None:
    """The first number in ``text`` with its digit-group separators removed (``"48,213"`` -> ``"48213"``)."""
    m = _NUMBER.search(text.replace("*", "").replace("`", ""))
    return re.sub(r"\D", "", m.group(0)) if m else None


def first_choice(text: str, choices: Sequence[str]) -> str | None:
    """The choice named first in ``text`` (whole word, case-insensitive)."""
    best = None
    for c in choices:
        m = re.search(rf"(?<!\w){re.escape(c)}(?!\w)", text, re.IGNORECASE)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), c)
    return best[1] if best else None


def extract(output: str, item: Item) -> str | None:
    if item.answer.isdigit():
        return first_number(output)
    return first_choice(output, item.choices or (item.answer,))


def score(output: str, item: Item) -> bool:
    got = extract(output, item)
    return got is not None and got.lower() == item.answer.lower()
