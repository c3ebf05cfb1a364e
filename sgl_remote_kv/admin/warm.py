"""Warm-up: push documents through a running ``--remote-kv`` server so their KV lands in the store.

Each document is sent once (``/generate`` with one new token, or with ``chat`` as the system message of a
chat completion, so later chats with that system prompt share its chunks), then the server's write-back
is waited for: its ``sglang:remote_kv_written_chunks_total`` and ``writeback_skipped_total{reason="present"}``
counters stop moving for ``quiet_s``. Reported per document: prompt tokens, chunks written, chunks the
store already had. The server must run with ``--enable-metrics`` (otherwise the wait cannot be observed).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmResult:
    document: str
    prompt_tokens: int
    chunks_written: int
    chunks_present: int  # already in the store (not written again)


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _counters(server: str) -> tuple[float, float]:
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        text = r.read().decode()
    if "sglang:remote_kv_written_chunks_total" not in text:
        raise RuntimeError(
            f"{server} exports no remote-KV write-back metrics: is it a --remote-kv server "
            "started with --enable-metrics?"
        )

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    return (
        total(r"^sglang:remote_kv_written_chunks_total\S*\s+(\S+)$"),
        total(r'^sglang:remote_kv_writeback_skipped_total\{[^}]*reason="present"[^}]*\}\s+(\S+)$'),
    )


def _settle(server: str, quiet_s: float, timeout_s: float) -> tuple[float, float]:
    deadline = time.monotonic() + timeout_s
    last, since = _counters(server), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _counters(server)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise RuntimeError(f"the write-back of {server} did not settle in {timeout_s:.0f} s")


def warm(
    server: str,
    documents: list[tuple[str, str]],
    chat: bool = False,
    cache_salt: str | None = None,
    extra_key: str | None = None,
    quiet_s: float = 2.0,
    timeout_s: float = 600.0,
    on_done=None,
) -> list[WarmResult]:
    """Send each ``(name, text)`` through ``server``; ``on_done(result)`` after each one."""
    server = server.rstrip("/")
    tenancy = {k: v for k, v in (("cache_salt", cache_salt), ("extra_key", extra_key)) if v is not None}
    before = _settle(server, quiet_s, timeout_s)
    model = _field(_get(server + "/v1/models"), "data", 0, "id") if chat else None
    out = []
    for name, text in documents:
        if chat:
            body = {
                "model": model,
                "messages": [{"role": "system", "content": text}],
                "max_tokens": 1,
                "temperature": 0,
                **tenancy,
            }
            tokens = _field(_post(server + "/v1/chat/completions", body, timeout_s), "usage", "prompt_tokens")
        else:
            body = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **tenancy}
            tokens = _field(_post(server + "/generate", body, timeout_s), "meta_info", "prompt_tokens")
        after = _settle(server, quiet_s, timeout_s)
        result = WarmResult(name, int(tokens), int(after[0] - before[0]), int(after[1] - before[1]))
        out.append(result)
        if on_done is not None:
            on_done(result)
        before = after
    return out


def _field(answer, *path):
    """``answer[path[0]][path[1]]...``; ``RuntimeError`` naming the path when the server answered otherwise."""
    try:
        for step in path:
            answer = answer[step]
    except (KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"unexpected server answer (no {'.'.join(map(str, path))})") from e
    return answer


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())
