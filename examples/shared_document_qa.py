"""Several clients ask questions about one long document at the same time.

Every request is ``[system: the document] + [user: a question]``, so all of them share a ~2k-token
prefix. Printed per question: TTFT, prompt tokens, cached tokens and how they split by tier
(``device`` = SGLang's radix cache, ``host``, ``storage`` = the remote tier when ``--remote-kv`` is on).
Run it twice against a ``--remote-kv`` server restarted in between (or against a second server sharing
the store) to see the document come back from the remote tier instead of being recomputed.

    python examples/shared_document_qa.py --base-url http://127.0.0.1:30000 --clients 4

Works against any SGLang server; start it with ``--enable-cache-report`` to see cached tokens. The
document defaults to a license text shipped with Debian (real text, no download).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
from dataclasses import dataclass
from pathlib import Path

from multi_turn_chat import stream_chat  # same directory: the streaming + TTFT + cache-report helper
from openai import OpenAI

logger = logging.getLogger(__name__)

DEFAULT_DOC = "/usr/share/common-licenses/Apache-2.0"
QUESTIONS = (
    "What does the license say about patents?",
    "Can I redistribute modified versions? Under which conditions?",
    "What is a 'Contribution' according to this document?",
    "Does the license include a warranty?",
    "What must a NOTICE file contain when I redistribute?",
    "Which law governs trademarks under this license?",
    "When does a patent license granted here terminate?",
    "How should the license be applied to my own work?",
)


@dataclass
class Answer:
    question: str
    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    by_tier: dict


def load_document(path: str, max_chars: int) -> str:
    return Path(path).read_text(errors="replace")[:max_chars]


def ask(client: OpenAI, model: str, document: str, question: str, max_tokens: int) -> Answer:
    messages = [
        {"role": "system", "content": "Answer questions about this document.\n\n" + document},
        {"role": "user", "content": question},
    ]
    text, ttft, total, usage, details = stream_chat(client, model, messages, max_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    by_tier = {k: v for k, v in details.items() if v is not None}
    return Answer(question, text, ttft, total, usage.get("prompt_tokens", 0), cached, by_tier)


def run(base_url: str, clients: int, questions: int, max_tokens: int, document: str) -> list[Answer]:
    """``questions`` questions sent by ``clients`` concurrent clients (one OpenAI client each)."""
    pool = [OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY") for _ in range(clients)]
    model = pool[0].models.list().data[0].id
    qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(questions)]
    with cf.ThreadPoolExecutor(max_workers=clients) as ex:
        futs = [ex.submit(ask, pool[i % clients], model, document, q, max_tokens) for i, q in enumerate(qs)]
        return [f.result() for f in futs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--document", default=DEFAULT_DOC)
    ap.add_argument("--max-chars", type=int, default=9000, help="about 2k tokens of the document")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    answers = run(
        args.base_url,
        args.clients,
        args.questions,
        args.max_tokens,
        load_document(args.document, args.max_chars),
    )
    for i, a in enumerate(answers, 1):
        tiers = ", ".join(f"{k}={v}" for k, v in a.by_tier.items()) or "n/a"
        print(
            f"Q{i}: {a.question}\n    TTFT {a.ttft_s * 1e3:.0f} ms | total {a.total_s:.2f} s | prompt "
            f"{a.prompt_tokens} tok | cached {a.cached_tokens} tok (by tier: {tiers})\n    A: {a.text[:160]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
