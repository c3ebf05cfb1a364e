"""One long document, three ways to get its KV: recompute, local hit, remote hit — side by side.

Server A reads a ~2.2K-token document (a chat whose system message is the document). Question 1 about it
computes the document's KV (**recompute**); question 2, on the same server, finds it in A's own radix
cache (**local hit**). Then server B — A restarted on the same remote store, or a second server sharing
it — is asked question 2: the document's KV comes from the remote tier (**remote hit**). Local and
remote hit answer the same question, so their answers compare the tier's codec with the exact KV.

Timings are of warm servers: each fresh server first answers a short warm-up chat on an unrelated text
(SGLang's own first request of a process is slower; that is not the tier's cost). B's first remote hit is
a second document of the same size (A read it too), printed as its own row, so the first remote hit of a
fresh server can be compared with the next one. Per row: TTFT, prompt tokens, cached tokens by tier, the
data plane's fetch time and the codec whose chunks served the hit (from B's ``/metrics``), the answer.

    python examples/long_document.py --server-a http://127.0.0.1:30000 --server-b http://127.0.0.1:30001
    python examples/long_document.py --server-a URL --phase a   # ... restart the server, then:
    python examples/long_document.py --server-b URL --phase b

Both need ``--remote-kv <mode>`` on one store, ``--enable-cache-report`` and ``--enable-metrics``;
``make demo`` starts A, stops it and starts B on a temporary file store (``scripts/demo.py``). Documents
are license texts shipped with Debian (real text, offline).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from multi_turn_chat import stream_chat  # same directory: streaming + TTFT + cache report
from openai import OpenAI

LICENSES = Path("/usr/share/common-licenses")
DOCUMENT = ("Apache-2.0", None)  # the whole text: 2,224 tokens (2,258 as the chat's prompt)
SECOND_DOCUMENT = ("MPL-2.0", 9700)  # cut to about the same size: B's first remote hit
WARMUP_TEXT = ("BSD", None)  # short, unrelated; behind a per-call nonce so it is never a remote hit
QUESTIONS = (
    "Who counts as a 'Contributor' under this license? Answer in one sentence.",
    "Does this license grant a patent license? Answer in one sentence.",
)


@dataclass(frozen=True)
class Row:
    server: str
    path: str  # recompute | local hit | first remote hit (fresh server) | remote hit
    document: str
    question: int  # 1 or 2 (QUESTIONS)
    ttft_s: float
    prompt_tokens: int
    cached_device: int
    cached_storage: int
    fetch_s: float | None  # the server's remote_kv_fetch_seconds over this request (remote hits only)
    codec: str | None  # the codec whose chunks served the remote hit (remote_kv_hit_tokens{codec})
    answer: str


def load(name: str, max_chars: int | None) -> str:
    return (LICENSES / name).read_text(errors="replace")[:max_chars]


def _metrics(base_url: str) -> tuple[dict[str, float], float]:
    """(remote-hit tokens by codec, fetch seconds sum) from the server's ``/metrics``."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    hits: dict[str, float] = {}
    for labels, value in re.findall(r"^sglang:remote_kv_hit_tokens_total\{([^}]*)\}\s+(\S+)$", text, re.M):
        codec = re.search(r'codec="([^"]*)"', labels)
        if codec:
            hits[codec.group(1)] = hits.get(codec.group(1), 0.0) + float(value)
    fetch = sum(float(v) for v in re.findall(r"^sglang:remote_kv_fetch_seconds_sum\S*\s+(\S+)$", text, re.M))
    return hits, fetch


def chat(base_url: str, document: str, question: str, max_tokens: int) -> tuple[str, float, dict, dict]:
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "Answer questions about this document.\n\n" + document},
        {"role": "user", "content": question},
    ]
    answer, ttft, _, usage, details = stream_chat(client, model, messages, max_tokens)
    return answer, ttft, usage, details


def ask(base_url: str, server: str, path: str, doc: tuple[str, int | None], q: int, max_tokens: int) -> Row:
    hits0, fetch0 = _metrics(base_url)
    answer, ttft, usage, details = chat(base_url, load(*doc), QUESTIONS[q - 1], max_tokens)
    hits1, fetch1 = _metrics(base_url)
    served = {c: n - hits0.get(c, 0.0) for c, n in hits1.items() if n > hits0.get(c, 0.0)}
    storage = int(details.get("storage") or 0)
    return Row(
        server,
        path,
        doc[0],
        q,
        ttft,
        usage.get("prompt_tokens", 0),
        int(details.get("device") or 0),
        storage,
        (fetch1 - fetch0) if storage else None,
        max(served, key=served.get) if served else None,
        answer,
    )


def warm_up(base_url: str) -> None:
    """One short chat on an unrelated text (a fresh nonce in front: nothing of it is in any cache)."""
    chat(base_url, f"[{uuid.uuid4().hex}]\n" + load(*WARMUP_TEXT), "What is this text?", 8)


def written_chunks(base_url: str) -> float:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(v) for v in re.findall(r"^sglang:remote_kv_written_chunks_total\S*\s+(\S+)$", text, re.M)
    )


def wait_written(base_url: str, quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Until the server's write-back stopped moving for ``quiet_s`` (its chunks are in the store)."""
    deadline, last, since = time.monotonic() + timeout_s, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = written_chunks(base_url)
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the write-back did not settle in {timeout_s:.0f} s")


def phase_a(server_a: str, max_tokens: int = 40) -> list[Row]:
    """Server A: warm up, read the second document (for B), then question 1 (recompute) and, once its
    write-back is in the store, question 2 (local hit) about the document; returns when A's write-back
    is in the store."""
    warm_up(server_a)
    chat(server_a, load(*SECOND_DOCUMENT), QUESTIONS[1], 1)  # computed here, written back for B's first hit
    recompute = ask(server_a, "A", "recompute", DOCUMENT, 1, max_tokens)
    wait_written(server_a)  # its write-back's encode would compete with the local hit for the CPU
    local = ask(server_a, "A", "local hit", DOCUMENT, 2, max_tokens)
    wait_written(server_a)
    return [recompute, local]


def phase_b(server_b: str, max_tokens: int = 40) -> list[Row]:
    """Server B (fresh, same store): warm up, a first remote hit (the second document), then question 2
    about the document (remote hit)."""
    warm_up(server_b)
    return [
        ask(server_b, "B", "first remote hit (fresh server)", SECOND_DOCUMENT, 2, max_tokens),
        ask(server_b, "B", "remote hit", DOCUMENT, 2, max_tokens),
    ]


def table(rows: list[Row], width: int = 56) -> str:
    head = (
        f"{'server':6} {'path':31} {'document':10} {'Q':1} {'TTFT':>8} {'prompt':>6} {'device':>6} "
        f"{'remote':>6} {'fetch':>7} {'codec':13}  answer"
    )
    out = [head]
    for r in rows:
        answer = r.answer.replace("\n", " ")
        answer = answer if len(answer) <= width else answer[: width - 3] + "..."
        fetch = f"{r.fetch_s * 1000:5.0f}ms" if r.fetch_s is not None else "      -"
        out.append(
            f"{r.server:6} {r.path:31} {r.document:10} {r.question:1d} {r.ttft_s * 1000:6.0f}ms "
            f"{r.prompt_tokens:6d} {r.cached_device:6d} {r.cached_storage:6d} {fetch} {r.codec or '-':13}  "
            f"{answer}"
        )
    return "\n".join(out)


def report(rows: list[Row], json_path: str | None = None, **context) -> None:
    """Print the table (and the questions); write it as JSON (``context`` + rows) when asked."""
    print(table(rows))
    for i, q in enumerate(QUESTIONS, 1):
        print(f"Q{i}: {q}")
    if json_path:
        doc = {**context, "questions": list(QUESTIONS), "rows": [asdict(r) for r in rows]}
        Path(json_path).write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-a", help="base URL of the server that reads the document first")
    ap.add_argument("--server-b", help="base URL of a fresh server on the same remote store")
    ap.add_argument("--phase", choices=("a", "b", "both"), default="both")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = []
    for phase, url, fn in (("a", args.server_a, phase_a), ("b", args.server_b, phase_b)):
        if args.phase in (phase, "both"):
            if not url:
                ap.error(f"--phase {args.phase} needs --server-{phase}")
            rows += fn(url, args.max_tokens)
    report(rows, args.json)
    return 0 if all(r.answer for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
