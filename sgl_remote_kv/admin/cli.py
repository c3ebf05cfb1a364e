"""``sgl-remote-kv-admin`` (``python -m sgl_remote_kv.admin``): stats, verify, evict and warm-up.

    sgl-remote-kv-admin stats  --store URL [--json]
    sgl-remote-kv-admin verify --store URL [--delete] [--json]
    sgl-remote-kv-admin evict  --store URL (--fingerprint HEX | --tenant SALT [--extra-key K] | --shared
                               | --older-than 7d) ... [--dry-run] [--json]
    sgl-remote-kv-admin warm   --server URL (--file PATH ... | --dir DIR) [--chat] [--cache-salt S] [--json]

Store URLs as the server takes them (``auth+...`` checks MACs with the key file). Tables for people,
``--json`` for machines; a progress bar on stderr during scans when it is a terminal. Exit codes: 0 done,
1 ``verify`` found bad values it did not delete, 2 bad arguments or an unreachable store/server (one line,
no traceback, the URL's password redacted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from sgl_remote_kv.admin import scan
from sgl_remote_kv.admin.scan import Entry
from sgl_remote_kv.store.base import StoreError, redact_url
from sgl_remote_kv.store.keys import tenant_salt, tenant_tag

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """``30m``, ``12h``, ``7d``, ``90s`` -> seconds (``ValueError`` otherwise)."""
    text = text.strip().lower()
    if len(text) < 2 or text[-1] not in _UNITS or not text[:-1].replace(".", "", 1).isdigit():
        raise ValueError(f"age must look like 30m, 12h or 7d, got {text!r}")
    return float(text[:-1]) * _UNITS[text[-1]]


def _progress(args, what: str):
    from tqdm import tqdm

    return tqdm(desc=what, unit=" values", file=sys.stderr, disable=args.json or not sys.stderr.isatty())


@contextlib.contextmanager
def _opened(args) -> Iterator[scan.AdminStore]:
    """The store of ``--store``, open for one command (its walk and its deletes)."""
    adm = scan.open_admin(args.store)
    try:
        yield adm
    finally:
        adm.close()


def _walk(args, adm: scan.AdminStore, deep: bool) -> list[Entry]:
    with _progress(args, f"scanning {adm.url}") as bar:
        return list(scan.walk(adm, deep=deep, progress=bar.update))


# -- stats ------------------------------------------------------------------------------------------
def stats(entries: list[Entry], now: float) -> dict:
    groups: dict[tuple[str, str, str], dict] = defaultdict(
        lambda: {
            "chunks": 0,
            "stored_bytes": 0,
            "raw_bytes": 0,
            "tokens": 0,
            "oldest_s": None,
            "newest_s": None,
        }
    )
    kinds = Counter(e.kind.value for e in entries)
    for e in entries:
        if not e.kind.is_chunk:
            continue
        g = groups[(e.fingerprint[:16], e.codec, e.tenant)]
        g["chunks"] += 1
        g["stored_bytes"] += e.size
        g["raw_bytes"] += e.raw_bytes
        g["tokens"] += e.tokens
        if e.written_at is not None:
            age = max(0.0, now - e.written_at)
            g["oldest_s"] = age if g["oldest_s"] is None else max(g["oldest_s"], age)
            g["newest_s"] = age if g["newest_s"] is None else min(g["newest_s"], age)
    rows = [
        {
            "fingerprint": fp,
            "codec": codec,
            "tenant": tenant,
            **g,
            "ratio": round(g["raw_bytes"] / g["stored_bytes"], 3) if g["stored_bytes"] else None,
        }
        for (fp, codec, tenant), g in sorted(groups.items())
    ]
    return {"values": len(entries), "by_kind": dict(kinds), "groups": rows}


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def _print_stats(report: dict) -> None:
    print(
        f"{report['values']} values: " + ", ".join(f"{k} {v}" for k, v in sorted(report["by_kind"].items()))
    )
    head = f"{'fingerprint':16}  {'codec':13}  {'tenant':16}  {'chunks':>7}  {'tokens':>9}  {'stored MB':>9}  {'ratio':>6}  {'oldest':>7}  {'newest':>7}"
    print(head)
    for r in report["groups"]:
        print(
            f"{r['fingerprint']:16}  {r['codec']:13}  {r['tenant']:16}  {r['chunks']:7d}  {r['tokens']:9d}  "
            f"{r['stored_bytes'] / 1e6:9.2f}  {r['ratio'] or 0:6.2f}  {_age(r['oldest_s']):>7}  {_age(r['newest_s']):>7}"
        )


def cmd_stats(args) -> int:
    with _opened(args) as adm:
        report = stats(_walk(args, adm, deep=False), time.time())
    print(json.dumps(report, indent=1)) if args.json else _print_stats(report)
    return 0


# -- verify -----------------------------------------------------------------------------------------
def cmd_verify(args) -> int:
    with _opened(args) as adm:
        entries = _walk(args, adm, deep=True)
        bad = [e for e in entries if e.kind.failed]
        deleted = _delete(adm, [e.key for e in bad], recheck=True) if bad and args.delete else 0
    report = {
        "values": len(entries),
        "failed": dict(Counter(e.kind.value for e in bad)),
        "deleted": deleted,
        "failures": [{"key": e.key.hex(), "kind": e.kind.value, "detail": e.detail} for e in bad],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"{len(entries)} values checked, {len(bad)} failed"
            + (f", {deleted} deleted" if args.delete else "")
        )
        for e in bad[:50]:
            print(f"  {e.key.hex()}  {e.kind.value}  {e.detail}")
        if len(bad) > 50:
            print(f"  ... and {len(bad) - 50} more (--json lists all)")
    return 1 if bad and not args.delete else 0


# -- evict ------------------------------------------------------------------------------------------
def selector(args, now: float):
    """The evict predicate of the flags (all given criteria must hold); chunks only."""
    tags = []
    if args.tenant is not None or args.tenant_key is not None:
        tags.append(tenant_tag(tenant_salt(args.tenant, args.tenant_key)))
    if args.shared:
        tags.append(tenant_tag(None))
    cutoff = now - parse_age(args.older_than) if args.older_than else None
    fp = args.fingerprint.lower() if args.fingerprint else None
    if fp is not None and (not fp or fp.strip("0123456789abcdef")):
        raise ValueError(
            f"--fingerprint must be a hex prefix (as `stats` prints it), got {args.fingerprint!r}"
        )
    if not (tags or cutoff is not None or fp):
        raise ValueError(
            "evict needs at least one of --fingerprint, --tenant/--extra-key, --shared, --older-than"
        )

    def pick(e: Entry) -> bool:
        return (
            e.kind.is_chunk
            and (fp is None or e.fingerprint.startswith(fp))
            and (not tags or e.tenant_tag in tags)
            and (cutoff is None or (e.written_at is not None and e.written_at < cutoff))
        )

    return pick


def cmd_evict(args) -> int:
    pick = selector(args, time.time())  # bad arguments before any store I/O
    with _opened(args) as adm:
        chosen = [e for e in _walk(args, adm, deep=False) if pick(e)]
        if chosen and not args.dry_run:
            _delete(adm, [e.key for e in chosen])
    report = {
        "matched": len(chosen),
        "deleted": 0 if args.dry_run else len(chosen),
        "bytes": sum(e.size for e in chosen),
        "tokens": sum(e.tokens for e in chosen),
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {len(chosen)} chunks ({report['tokens']} tokens, {report['bytes'] / 1e6:.2f} MB)")
    return 0


def _delete(adm: scan.AdminStore, keys: list[bytes], recheck: bool = False) -> int:
    """Delete ``keys``, on the store the walk read; ``recheck``: only those whose value still fails (a
    server may have rewritten a bad value with a good one since the walk read it). Returns how many."""
    n = 0
    for i in range(0, len(keys), 256):
        batch = keys[i : i + 256]
        if recheck:
            values = adm.store.get_many(batch)
            batch = [
                k
                for k, v in zip(batch, values, strict=True)
                if v is not None and scan.classify(k, v, adm.secret).kind.failed
            ]
        adm.store.delete_many(batch)
        n += len(batch)
    return n


# -- warm -------------------------------------------------------------------------------------------
def cmd_warm(args) -> int:
    from sgl_remote_kv.admin.warm import warm

    paths = [Path(p) for p in args.file or []]
    if args.dir:
        paths += sorted(p for p in Path(args.dir).iterdir() if p.is_file())
    if not paths:
        raise ValueError("warm needs --file or --dir")
    docs = [(str(p), p.read_text(errors="replace")) for p in paths]

    def show(r) -> None:
        if not args.json:
            print(
                f"{r.document}: {r.prompt_tokens} prompt tokens, {r.chunks_written} chunks written, "
                f"{r.chunks_present} already stored"
            )

    results = warm(args.server, docs, args.chat, args.tenant_salt, args.tenant_key, on_done=show)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sgl-remote-kv-admin", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, doc in (
        ("stats", cmd_stats, "chunks, bytes, ratio and age per model / codec / tenant"),
        ("verify", cmd_verify, "check every value (MAC, framing, header, layer CRCs)"),
        ("evict", cmd_evict, "delete chunks by model, tenant or age"),
    ):
        p = sub.add_parser(name, help=doc)
        p.add_argument("--store", required=True, help="store URL (as the server's --remote-kv-store)")
        p.add_argument("--json", action="store_true", help="machine output")
        p.set_defaults(fn=fn)
        if name == "verify":
            p.add_argument("--delete", action="store_true", help="delete the values that fail")
        if name == "evict":
            p.add_argument("--fingerprint", help="model fingerprint (hex prefix, as `stats` prints it)")
            p.add_argument("--tenant", metavar="CACHE_SALT", help="the tenant's cache_salt")
            p.add_argument(
                "--extra-key", dest="tenant_key", help="the tenant's extra_key (with or without --tenant)"
            )
            p.add_argument("--shared", action="store_true", help="chunks of requests without a tenant salt")
            p.add_argument("--older-than", metavar="AGE", help="written longer ago than AGE (30m, 12h, 7d)")
            p.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    p = sub.add_parser("warm", help="store the KV of documents through a running --remote-kv server")
    p.add_argument("--server", required=True, help="base URL of the server (started with --enable-metrics)")
    p.add_argument("--file", action="append", help="a document (repeatable)")
    p.add_argument("--dir", help="every file in this directory is a document")
    p.add_argument("--chat", action="store_true", help="send each document as a chat's system message")
    p.add_argument("--cache-salt", dest="tenant_salt", help="tenant: the requests' cache_salt")
    p.add_argument("--extra-key", dest="tenant_key", help="tenant: the requests' extra_key")
    p.add_argument("--json", action="store_true", help="machine output")
    p.set_defaults(fn=cmd_warm)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (ValueError, OSError, StoreError, RuntimeError) as e:  # the CLI boundary: one line, no traceback
        where = getattr(args, "store", None) or getattr(args, "server", "")
        print(f"sgl-remote-kv-admin {args.command}: {e} ({redact_url(where)})", file=sys.stderr)
        return 2
