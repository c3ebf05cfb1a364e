"""One long document, three ways to get its KV: recompute, local hit, remote hit — side by side.

Server A reads a 2-4K-token document (a chat whose system message is the document) and is asked a
question about it twice: the first time the document's KV is computed (**recompute**), the second time it
comes from A's own radix cache (**local hit**). Server B shares A's remote store (or is A restarted) and
is asked the same question: the document's KV comes from the remote tier (**remote hit**). Before that,
each server is warmed up, and B's warm-up is itself a remote hit of another document, so the table
compares warm servers; that first remote hit of the fresh server B is printed too, as its own row.

    python examples/long_document.py --server-a http://127.0.0.1:30000 --server-b http://127.0.0.1:30001

Both servers need ``--remote-kv <mode>`` on one store and ``--enable-cache-report``; ``make demo`` starts
them (``scripts/demo.py``). Documents default to license texts shipped with Debian (real text, offline).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from multi_turn_chat import stream_chat  # same directory: streaming + TTFT + cache report
from openai import OpenAI

DOCUMENT = "/usr/share/common-licenses/Apache-2.0"  # ~2.2K tokens
WARMUP_DOCUMENT = "/usr/share/common-licenses/MPL-2.0"  # another license; cut to about the same size
QUESTION = "Does this license grant a patent license? Answer in one sentence."


@dataclass(frozen=True)
class Row:
    server: str
    path: str  # recompute | local hit | remote hit | first remote hit (fresh server)
    document: str
    ttft_s: float
    prompt_tokens: int
    cached_device: int
    cached_storage: int
    answer: str


def load(path: str, max_chars: int) -> str:
    return Path(path).read_text(errors="replace")[:max_chars]


def ask(base_url: str, server: str, path: str, name: str, document: str, max_tokens: int) -> Row:
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Answer questions about this document.\n\n" + document},
                {"role": "user", "content": QUESTION}]  # fmt: skip
    answer, ttft, _, usage, details = stream_chat(client, model, messages, max_tokens)
    return Row(server, path, name, ttft, usage.get("prompt_tokens", 0), int(details.get("device") or 0),
               int(details.get("storage") or 0), answer)  # fmt: skip


def written_chunks(base_url: str) -> float:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^sglang:remote_kv_written_chunks_total\S*\s+(\S+)$", text, re.M))


def wait_written(base_url: str, quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Until server A's write-back stopped moving for ``quiet_s`` (its chunks are in the store)."""
    deadline, last, since = time.monotonic() + timeout_s, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = written_chunks(base_url)
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)
    raise RuntimeError(f"server A's write-back did not settle in {timeout_s:.0f} s")


def run(server_a: str, server_b: str, max_tokens: int = 40) -> list[Row]:
    doc = load(DOCUMENT, 20000)
    warm = load(WARMUP_DOCUMENT, len(doc))
    ask(server_a, "A", "warm-up", "MPL-2.0", warm, max_tokens)  # computed here; written back for B
    rows = [ask(server_a, "A", "recompute", "Apache-2.0", doc, max_tokens),
            ask(server_a, "A", "local hit", "Apache-2.0", doc, max_tokens)]  # fmt: skip
    wait_written(server_a)
    rows.append(ask(server_b, "B", "first remote hit (fresh server)", "MPL-2.0", warm, max_tokens))
    rows.append(ask(server_b, "B", "remote hit", "Apache-2.0", doc, max_tokens))
    return rows


def table(rows: list[Row], width: int = 60) -> str:
    out = [f"{'server':6} {'path':32} {'document':10} {'TTFT':>8} {'prompt':>6} {'device':>6} {'remote':>6}  answer"]
    for r in rows:
        answer = r.answer.replace("\n", " ")
        answer = answer if len(answer) <= width else answer[: width - 3] + "..."
        out.append(f"{r.server:6} {r.path:32} {r.document:10} {r.ttft_s * 1000:6.0f}ms {r.prompt_tokens:6d} "
                   f"{r.cached_device:6d} {r.cached_storage:6d}  {answer}")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-a", required=True, help="base URL of the server that reads the document first")
    ap.add_argument("--server-b", required=True, help="base URL of a server on the same remote store")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = run(args.server_a, args.server_b, args.max_tokens)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(r.answer for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
