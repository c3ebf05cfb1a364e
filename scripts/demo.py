"""`make demo`: real CPU SGLang servers with --remote-kv dpu on SmolLM2.

Part 1: a 3-turn chat, then the same chat on a restarted server (its prefix comes back from the tier).
Part 2: a 2.2K-token document read by server A, then asked about on server B (A restarted on the same
store): recompute vs local hit vs remote hit, side by side (``examples/long_document.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/ (the server launcher), from the tree

from benchmarks.launcher import ServerSpec, SGLangServer  # noqa: E402
from sgl_remote_kv.config import RemoteKVConfig  # noqa: E402
from sgl_remote_kv.model import ensure_model

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--remote-kv", default="dpu")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument(
        "--restart",
        action="store_true",
        help="run the chat twice with a server restart between (shows remote-tier hits)",
    )
    ap.add_argument("--json", help="write the long-document rows to this file")
    ap.add_argument("--part", choices=("all", "chat", "document"), default="all")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[demo] %(message)s")
    model = ensure_model("float32")
    spec = ServerSpec(
        model_path=str(model),
        extra_args=("--remote-kv", args.remote_kv, "--enable-metrics", "--enable-cache-report"),
    )
    if args.part != "document":
        rc = chat(spec, args)
        if rc != 0 or args.part == "chat":
            return rc
    logging.info(
        "part 2: one long document; server A reads it, then server B (A restarted, same store) is asked about it"
    )
    return long_document(model, args.remote_kv, args.json)


def chat(spec: ServerSpec, args) -> int:
    rounds = 2 if args.restart else 1
    for i in range(rounds):
        what = (
            "fresh server"
            if i == 0
            else "restarted server: local cache empty, the remote tier serves the prefix"
        )
        logging.info("round %d/%d: %s", i + 1, rounds, what)
        with SGLangServer(spec) as srv:
            marker = "sgl-remote-kv: --remote-kv"
            logging.info(
                "server up at %s; log says: %s",
                srv.base_url,
                next((ln for ln in srv.log_text().splitlines() if marker in ln), "(flag not reported!)"),
            )
            rc = subprocess.call(
                [
                    sys.executable,
                    str(ROOT / "examples" / "multi_turn_chat.py"),
                    "--base-url",
                    srv.base_url,
                    "--turns",
                    str(args.turns),
                ]
            )
            if rc != 0:
                logging.error("chat failed (round %d); server log tail:\n%s", i + 1, srv.log_tail())
                return rc
    return 0


def long_document(model: Path, mode: str, json_path: str | None) -> int:
    """Server A reads the document and is stopped; server B (A restarted: a fresh process on the same
    file store) is asked about it. One server at a time."""
    sys.path.insert(0, str(ROOT / "examples"))
    import long_document as ld  # examples/long_document.py

    with tempfile.TemporaryDirectory(prefix="srkv-demo-store-") as store:
        extra = (
            "--remote-kv",
            mode,
            "--remote-kv-store",
            f"file://{store}",
            "--enable-metrics",
            "--enable-cache-report",
        )
        spec = ServerSpec(model_path=str(model), extra_args=extra)
        rows = []
        for name, phase in (("A", ld.phase_a), ("B", ld.phase_b)):
            with SGLangServer(spec) as srv:
                logging.info("server %s up at %s (store %s)", name, srv.base_url, store)
                try:
                    rows += phase(srv.base_url)
                except Exception:
                    logging.exception(
                        "long-document part failed; server %s log tail:\n%s", name, srv.log_tail()
                    )
                    return 1
    cfg = RemoteKVConfig(mode=mode)
    ld.report(
        rows,
        json_path,
        measured=time.strftime("%Y-%m-%d"),
        remote_kv=mode,
        store="file",
        chunk_size=cfg.chunk_size,
        codec_flag=cfg.codec,
        cpus=os.cpu_count(),
    )
    logging.info("servers stopped; demo done")
    return 0 if all(r.answer for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
