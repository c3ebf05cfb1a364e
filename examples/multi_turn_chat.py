"""Multi-turn chat against any OpenAI-compatible SGLang server, printing per turn: the answer, TTFT, and
cached prompt tokens by tier (device / host / remote storage) when the server reports them.

    python examples/multi_turn_chat.py --base-url http://127.0.0.1:30000 [--turns 3] [--json out.json]

Works with or without ``--remote-kv``; start the server with ``--enable-cache-report`` to see cached tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from openai import OpenAI

SYSTEM = (
    "You are a concise assistant for Northwind Travel, a small travel agency. Answer in one or two "
    "sentences. The agency sells trips to France, Italy, Spain, Japan and Canada. Prices include flights "
    "and hotels. Always be polite and factual; if you do not know, say so. "
    "Agency policies you must follow when asked: bookings can be changed free of charge up to 30 days "
    "before departure; after that a fee of 50 euros applies per traveller. Cancellations more than 60 days "
    "before departure are refunded in full, between 60 and 30 days half of the price is refunded, and later "
    "cancellations are not refunded unless the trip is cancelled by the agency. Travel insurance is "
    "optional and costs 4 percent of the trip price. Children under 12 travel at 70 percent of the adult "
    "price when sharing a room with two adults. Each traveller may bring one checked bag of up to 23 kg "
    "and one cabin bag. Special meals must be requested at least 7 days before departure. The office is "
    "open Monday to Friday from 9:00 to 18:00 and Saturday from 10:00 to 14:00, Central European Time. "
    "Payment is accepted by bank transfer or credit card; a deposit of 20 percent is due at booking and "
    "the rest 45 days before departure. Guided city tours are available in Paris, Rome, Madrid, Kyoto and "
    "Montreal; they last three hours and are offered in English, French, Spanish and Japanese. When a "
    "customer asks about visas, remind them to check the official government website of the country they "
    "visit, because rules change. Never invent prices that are not listed here."
)
TURNS = [
    "What is the capital of France?",
    "Name one famous museum in that city.",
    "Which river flows through it?",
    "Suggest one dish a visitor should try there.",
    "Thank you! Summarise our conversation in one sentence.",
]


@dataclass(frozen=True)
class TurnResult:
    turn: int
    question: str
    answer: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict


def stream_chat(
    client: OpenAI, model: str, messages: list[dict], max_tokens: int
) -> tuple[str, float, float, dict, dict]:
    """Stream one chat completion; return (answer, ttft, total, usage, cached_tokens_details).
    Also used by shared_document_qa.py."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict = {}
    details: dict = {}
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_cached_tokens_details": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        raw = chunk.model_dump()
        if raw.get("usage"):
            usage = raw["usage"]
        for place in (raw.get("sglext"), *(c.get("sglext") for c in raw.get("choices") or [])):
            if place and place.get("cached_tokens_details"):
                details = place["cached_tokens_details"]
    total = time.perf_counter() - t0
    return "".join(parts).strip(), (ttft if ttft is not None else total), total, usage, details


def run(base_url: str, turns: int, max_tokens: int) -> list[TurnResult]:
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for i, question in enumerate(TURNS[:turns], start=1):
        messages.append({"role": "user", "content": question})
        answer, ttft, total, usage, details = stream_chat(client, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        results.append(
            TurnResult(i, question, answer, ttft, total, usage.get("prompt_tokens", 0), cached, details)
        )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--turns", type=int, default=3, choices=range(1, len(TURNS) + 1))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", help="also write the per-turn results to this file")
    args = ap.parse_args(argv)
    results = run(args.base_url, args.turns, args.max_tokens)
    for r in results:
        tiers = ", ".join(f"{k}={v}" for k, v in r.cached_by_tier.items() if v is not None) or "n/a"
        print(f"--- turn {r.turn}: {r.question}")
        print(f"    answer : {r.answer}")
        print(
            f"    TTFT {r.ttft_s * 1000:.0f} ms | total {r.total_s * 1000:.0f} ms | prompt {r.prompt_tokens} tok"
            f" | cached {r.cached_tokens} tok (by tier: {tiers})"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=2)
    return 0 if all(r.answer for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
