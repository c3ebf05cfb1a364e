"""`make demo`: start a real CPU SGLang server with --remote-kv dpu on SmolLM2, run a 3-turn chat, stop."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

from sgl_remote_kv.launcher import ServerSpec, SGLangServer
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
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[demo] %(message)s")
    model = ensure_model("float32")
    spec = ServerSpec(
        model_path=str(model),
        extra_args=("--remote-kv", args.remote_kv, "--enable-metrics", "--enable-cache-report"),
    )
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
    logging.info("server stopped; demo done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
