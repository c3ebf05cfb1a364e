"""The codec table (issue 3): ratio, bits/value, single-thread encode/decode MB/s and real-model quality.

Every row comes from a run: each text's 1,792-token prefix (real SmolLM2 KV, bf16) is split into 256-token
chunks, each chunk encoded to a blob by a codec from ``sgl_remote_kv.codec`` and decoded again; the decoded
prefix KV then replaces the recomputed prefix (``benchmarks.quality``).

- ``ratio``: bf16 bytes of K+V / blob bytes (headers, scales and tables included), summed over all chunks
  of all texts; ``bits_per_value`` = 16 / ratio.
- ``encode_mb_s`` / ``decode_mb_s``: MB (1e6 B) of bf16 KV per second, single thread, best of ``--repeat``.
- ``kl`` / ``top1`` / ``greedy_match``: means over texts (per-text values in ``per_text``).

Rows from elsewhere (the video-codec path) join the same table: either a module
``benchmarks.nvdec_rows`` exposing ``rows(ctx) -> list[dict]`` (``ctx`` is an ``EvalContext``; its
``measure`` takes plain encode/decode callables), producers added to ``ROW_PRODUCERS``, or ``--extra-rows``
JSON files of finished rows.

CLI: ``python -m benchmarks.bench_codec [--texts a,b] [--no-greedy] [--repeat 3] [--out FILE]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # single-thread codec timings

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import kvdata, quality  # noqa: E402

CHUNK = 256
OUT = kvdata.REPO / "docs" / "results" / "codec.json"
Encode = Callable[[np.ndarray, np.ndarray, int], bytes]  # (k, v, position of the chunk's first token)
Decode = Callable[[bytes], tuple[np.ndarray, np.ndarray]]
ROW_PRODUCERS: list[Callable[[EvalContext], list[dict]]] = []


@dataclass
class EvalContext:
    """Model, texts and recompute baselines shared by every row."""

    model: object
    texts: list[kvdata.TextKV]
    baselines: dict = field(default_factory=dict)
    greedy: bool = True
    repeat: int = 1
    fingerprint: object = None
    memo_only: bool = False  # never run the model: a quality not memoized raises LookupError

    @classmethod
    def create(cls, names=None, greedy=True, repeat=1, threads=2) -> EvalContext:
        model, tok = kvdata.load_model(threads)
        texts = kvdata.load_texts(names, (model, tok))
        ctx = cls(model, texts, greedy=greedy, repeat=repeat, fingerprint=kvdata.fingerprint())
        ctx.baselines = {t.name: quality.recompute_baseline(model, t) for t in texts}
        return ctx

    def subset(self, names: list[str]) -> EvalContext:
        texts = [t for t in self.texts if t.name in names]
        return EvalContext(self.model, texts, self.baselines, self.greedy, self.repeat, self.fingerprint)

    def measure(self, label: str, encode: Encode, decode: Decode, timing: bool = True, **extra) -> dict:
        """One table row for any encode/decode pair working on 256-token chunks of bf16 KV."""
        raw = blob = 0
        enc_t = dec_t = 0.0
        per_text = {}
        for t in self.texts:
            dk, dv, nbytes, te, td = _roundtrip(t, encode, decode, self.repeat if timing else 1)
            raw, blob, enc_t, dec_t = raw + t.k.nbytes + t.v.nbytes, blob + nbytes, enc_t + te, dec_t + td
            q = self.quality(t, dk, dv)
            per_text[t.name] = {
                **q,
                "ratio": (t.k.nbytes + t.v.nbytes) / nbytes,
                "blob_bytes": nbytes,
                "bf16_bytes": t.k.nbytes + t.v.nbytes,
                "role": t.role,
            }
        row = {"codec": label, "ratio": raw / blob, "bits_per_value": 16 * blob / raw}
        row["encode_mb_s"] = raw / enc_t / 1e6 if timing else None
        row["decode_mb_s"] = raw / dec_t / 1e6 if timing else None
        for key in ("kl", "top1", "greedy_match"):
            vals = [p[key] for p in per_text.values() if p[key] is not None]
            row[key] = float(np.mean(vals)) if vals else None
        row.update(extra)
        row["blob_bytes"], row["bf16_bytes"], row["per_text"] = blob, raw, per_text
        return row

    def quality(self, t: kvdata.TextKV, dk: np.ndarray, dv: np.ndarray) -> dict:
        """Quality of decoded KV, memoized on disk by a digest of the decoded bytes (equal quantization in
        two codecs -> one model run)."""
        key = f"{t.name}:{hashlib.sha256(dk.tobytes() + dv.tobytes()).hexdigest()}"
        memo = _quality_memo()
        hit = memo.get(key)
        if hit is None or (self.greedy and hit.get("greedy_match") is None):
            if self.memo_only:
                raise LookupError(f"quality of {key} not memoized")
            hit = quality.evaluate(self.model, t, self.baselines[t.name], dk, dv, greedy=self.greedy)
            memo[key] = hit
            _save_memo(memo)
        return dict(hit)

    def measure_codec(self, label: str, codec, timing: bool = True, **extra) -> dict:
        fp = self.fingerprint
        row = self.measure(
            label,
            lambda k, v, s: codec.encode(k, v, fp, start=s),
            lambda b: codec.decode(b, fp),
            timing,
            **extra,
        )
        row["params"] = codec.params()
        row.setdefault("impl", type(codec).__name__)
        return row


_MEMO_FILE = kvdata.CACHE.parent / "quality_memo.json"
_MEMO: dict = {}


def _quality_memo() -> dict:
    if not _MEMO and _MEMO_FILE.exists():
        _MEMO.update(json.loads(_MEMO_FILE.read_text()))
    return _MEMO


def _save_memo(memo: dict) -> None:
    """Merge with what other runs wrote meanwhile, then replace atomically."""
    if _MEMO_FILE.exists():
        for k, v in json.loads(_MEMO_FILE.read_text()).items():
            memo.setdefault(k, v)
    tmp = _MEMO_FILE.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo))
    os.replace(tmp, _MEMO_FILE)


def _chunks(t: kvdata.TextKV, with_start: bool = False):
    n = t.k.shape[1]
    for s in range(0, n, CHUNK):
        k, v = np.ascontiguousarray(t.k[:, s : s + CHUNK]), np.ascontiguousarray(t.v[:, s : s + CHUNK])
        yield (k, v, s) if with_start else (k, v)


def _roundtrip(t: kvdata.TextKV, encode: Encode, decode: Decode, repeat: int):
    """Encode and decode every chunk of ``t``; best-of-``repeat`` wall times (single thread)."""
    chunks = list(_chunks(t, with_start=True))
    enc_best = dec_best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        blobs = [encode(k, v, s) for k, v, s in chunks]
        t1 = time.perf_counter()
        dec = [decode(b) for b in blobs]
        t2 = time.perf_counter()
        enc_best, dec_best = min(enc_best, t1 - t0), min(dec_best, t2 - t1)
    dk = np.concatenate([d[0] for d in dec], axis=1)
    dv = np.concatenate([d[1] for d in dec], axis=1)
    return dk, dv, sum(len(b) for b in blobs), enc_best, dec_best


# ---- rows --------------------------------------------------------------------------------------------

CACHEGEN_K, CACHEGEN_V = "32@0,16@10", "32@0,16@2"  # CacheGen's shipped defaults (7B/8B layer groups)
RD_JSON = OUT.with_name("codec_rd.json")


@dataclass(frozen=True)
class Spec:
    """One table row: a label, a family, and a codec from ``sgl_remote_kv.codec`` with its parameters."""

    label: str
    family: str
    codec: str
    params: tuple = ()

    def make(self, ctx: EvalContext | None = None):
        """The codec; ``quant_rans`` gets entropy tables fitted on the context's ``tune`` texts only."""
        from sgl_remote_kv.codec.base import get_codec

        params = dict(self.params)
        if self.codec == "quant_rans" and ctx is not None:
            params["tables"] = fit_tables(ctx, params)
        if self.codec == "transform" and ctx is not None:
            heads = params.pop("group_heads", None)
            params["calibration"] = tune_calibration(ctx, params["quality"], heads).calib_id.hex()
        return get_codec(self.codec, **params)


def fit_tables(ctx: EvalContext, params: dict):
    """Entropy tables for ``quant_rans`` fitted on the chunks of the ``tune`` texts (held-out texts unseen)."""
    from sgl_remote_kv.codec import quant
    from sgl_remote_kv.codec.calibration import tables

    keys = ("k_bins", "v_bins", "granularity", "k_channel_scale", "k_outliers")
    spec = quant.QuantSpec.make(**{k: params[k] for k in keys if k in params})
    samples = [c for t in ctx.texts if t.role == "tune" for c in _chunks(t)]
    if not samples:
        raise ValueError("no tune texts to fit entropy tables on")
    return tables.fit(spec, ctx.fingerprint, samples)


def tune_calibration(ctx: EvalContext, quality: str, group_heads: int | None = None):
    """The registered calibration of the benchmark model (``make calibration``; with ``group_heads``, one
    of that many KV heads per group: ``calibrate --group-heads N``), refused unless it was fitted on tune
    texts only (its report names its texts)."""
    from sgl_remote_kv.codec import calibration

    fp = ctx.fingerprint
    cal = calibration.find_for(fp, quality)
    if group_heads is not None:
        want = group_heads * fp.layout.head_dim
        cands = [
            c
            for c in calibration.registered()
            if c.model_key == cal.model_key and c.group_dim == want and quality in c.levels
        ]
        if not cands:
            raise ValueError(
                f"no calibration with {group_heads} heads per group: calibrate --group-heads {group_heads}"
            )
        cal = cands[-1]
    fitted_on = set(json.loads(cal.report).get("texts", []))
    tune = {t.name for t in ctx.texts if t.role == "tune"}
    if not fitted_on or not fitted_on <= tune:
        raise ValueError(
            f"calibration {cal.calib_id.hex()} was fitted on {sorted(fitted_on)}, not on tune texts only"
        )
    return cal


def quant(label, family, codec, k="256", v="256", gran="token", cs=False, **more) -> Spec:
    p = {"k_bins": k, "v_bins": v, "granularity": gran, "k_channel_scale": cs, **more}
    return Spec(label, family, codec, tuple(sorted(p.items())))


def table_specs() -> list[Spec]:
    specs = [
        Spec("lossless zstd (byte-shuffled)", "lossless", "lossless", (("method", "zstd"),)),
        Spec("lossless deflate (byte-shuffled)", "lossless", "lossless", (("method", "deflate"),)),
        quant("int8 plain (256 bins/token, stored)", "int8", "quant_deflate", method="raw"),
        quant("CacheGen peer (default bins)", "cachegen", "cachegen", CACHEGEN_K, CACHEGEN_V),
        quant("CacheGen peer (256 bins)", "cachegen", "cachegen"),
        quant(
            "ShadowServe peer (CacheGen bins + Deflate)",
            "shadowserve",
            "quant_deflate",
            CACHEGEN_K,
            CACHEGEN_V,
        ),
        quant("ShadowServe peer (256 bins + Deflate)", "shadowserve", "quant_deflate"),
    ]
    from sgl_remote_kv.codec.base import DEFAULT_K_BINS, DEFAULT_V_BINS

    for codec, fam in (("quant_deflate", "ours-deflate"), ("quant_rans", "ours-rans")):
        for kb, vb, gran, cs in (
            ("256", "256", "token", False),
            ("256", "256", "head", False),
            ("256", "256", "head", True),
            ("256", "128", "token", False),
        ):
            tag = f"K{kb}/V{vb} bins/{gran}" + (" + key channel scales" if cs else "")
            specs.append(quant(f"ours {codec} ({tag})", fam, codec, kb, vb, gran, cs))
        tag = f"codec default K{DEFAULT_K_BINS}/V{DEFAULT_V_BINS}/token"
        specs.append(quant(f"ours {codec} ({tag})", fam, codec, DEFAULT_K_BINS, DEFAULT_V_BINS))
    return specs + recommended_specs()


def recommended_specs() -> list[Spec]:
    """The configs the rate-distortion sweep recommends (``codec_rd.json``), when it exists."""
    if not RD_JSON.exists():
        return []
    rec = json.loads(RD_JSON.read_text()).get("recommended") or {}
    out = []
    for key, r in rec.items():
        if r and r.get("codec_name"):
            out.append(
                Spec(
                    f"RECOMMENDED {key}: {r['codec']}",
                    r["family"],
                    r["codec_name"],
                    tuple(sorted(r["params"].items())),
                )
            )
    return out


def raw_bf16_row(ctx: EvalContext) -> dict:
    """Reference row: the bf16 bytes as they are (no codec, no header)."""

    def enc(k, v, start):
        return k.tobytes() + v.tobytes()

    lay = ctx.fingerprint.layout

    def dec(b):
        k, v = np.split(np.frombuffer(b, np.uint16), 2)
        per_token = lay.num_layers * lay.num_kv_heads * lay.head_dim
        shape = (lay.num_layers, len(k) // per_token, lay.num_kv_heads, lay.head_dim)
        return k.reshape(shape), v.reshape(shape)

    return ctx.measure("raw bf16", enc, dec, family="bf16")


def spec_row(ctx: EvalContext, spec: Spec, timing: bool = True) -> dict | None:
    if spec.codec == "kvtc":
        return kvtc_row(ctx, spec, timing)
    if spec.codec in PEER_ROWS:
        return peer_row(ctx, spec, timing)
    try:
        codec = spec.make(ctx)
    except (ImportError, KeyError, TypeError, ValueError) as e:
        print(f"  skip {spec.label}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return ctx.measure_codec(spec.label, codec, timing, family=spec.family, codec_name=spec.codec)


def kvtc_row(ctx: EvalContext, spec: Spec, timing: bool = True) -> dict:
    """The KVTC peer (``benchmarks.kvtc_peer``), fitted on the tune texts, at ``bits`` per value."""
    from benchmarks.kvtc_peer import KVTC
    from sgl_remote_kv.types import RopeSpec

    params = dict(spec.params)
    rope = RopeSpec.from_hf_config(json.loads((kvdata.model_dir() / "config.json").read_text()))
    peer = KVTC([t for t in ctx.texts if t.role == "tune"], rope, float(params["bits"]))
    row = ctx.measure(spec.label, peer.encode, peer.decode, timing, family=spec.family, codec_name="kvtc")
    row["params"], row["impl"] = params, "benchmarks.kvtc_peer.KVTC"
    return row


# Peers re-implemented under benchmarks/: codec name -> module with ``make(params)`` (an object with
# ``encode(k, v, start) -> bytes`` and ``decode(blob) -> (k, v)``) and ``grid(family)`` (its RD points).
PEER_ROWS = {"turboquant": "benchmarks.turboquant_peer", "ans": "benchmarks.ans_peer"}


def peer_row(ctx: EvalContext, spec: Spec, timing: bool = True) -> dict:
    """A ``PEER_ROWS`` peer at ``spec.params`` (data-oblivious: nothing fitted)."""
    params = dict(spec.params)
    peer = importlib.import_module(PEER_ROWS[spec.codec]).make(params)
    row = ctx.measure(spec.label, peer.encode, peer.decode, timing, family=spec.family, codec_name=spec.codec)
    row["params"], row["impl"] = params, f"{PEER_ROWS[spec.codec]}.{type(peer).__name__}"
    return row


def discovered_producers() -> list[Callable[[EvalContext], list[dict]]]:
    """Producers registered in ``ROW_PRODUCERS`` plus ``benchmarks.nvdec_rows.rows`` if present."""
    found = list(ROW_PRODUCERS)
    try:
        mod = importlib.import_module("benchmarks.nvdec_rows")
    except ImportError:
        return found
    if hasattr(mod, "rows"):
        found.append(mod.rows)
    return found


# ---- output ------------------------------------------------------------------------------------------

COLS = ("ratio", "bits_per_value", "encode_mb_s", "decode_mb_s", "kl", "top1", "greedy_match")


def _fmt(x, col: str) -> str:
    if x is None:
        return "-"
    if col == "kl":
        return f"{x:.5f}"
    if col == "ratio":
        return f"{x:.2f}"
    return f"{x:.3f}" if col in ("top1", "greedy_match", "bits_per_value") else f"{x:.1f}"


def format_table(rows: list[dict]) -> str:
    width = max([len(r["codec"]) for r in rows] + [5])
    lines = [f"{'codec':{width}s} " + " ".join(f"{c:>14s}" for c in COLS)]
    for r in rows:
        lines.append(f"{r['codec']:{width}s} " + " ".join(f"{_fmt(r.get(c), c):>14s}" for c in COLS))
    return "\n".join(lines)


def run(ctx: EvalContext, specs: list[Spec], extra_files: list[Path], producers: bool = True) -> list[dict]:
    rows = [raw_bf16_row(ctx)]
    for spec in specs:
        t0 = time.perf_counter()
        row = spec_row(ctx, spec)
        if row is not None:
            rows.append(row)
            print(
                f"  {spec.label}: ratio {row['ratio']:.2f} kl {row['kl']:.5f} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
            )
    for producer in discovered_producers() if producers else []:
        rows.extend(producer(ctx))
    for f in extra_files:
        rows.extend(json.loads(Path(f).read_text()))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="codec table on real SmolLM2 KV")
    ap.add_argument("--texts", default="", help="comma-separated text names (default: all)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the 32-token greedy match")
    ap.add_argument("--repeat", type=int, default=3, help="timing repeats (best of)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the model runs")
    ap.add_argument("--only", default="", help="substring filter on row labels")
    ap.add_argument("--extra-rows", action="append", default=[], help="JSON list of finished rows to add")
    ap.add_argument("--update", action="store_true", help="merge into --out, keeping rows not re-measured")
    ap.add_argument("--no-producers", action="store_true", help="skip discovered row producers (nvdec)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    names = [n for n in args.texts.split(",") if n] or None
    ctx = EvalContext.create(names, greedy=not args.no_greedy, repeat=args.repeat, threads=args.threads)
    specs = [s for s in table_specs() if args.only.lower() in s.label.lower()]
    rows = run(ctx, specs, args.extra_rows, not args.no_producers)
    if args.update and args.out.exists():  # keep earlier rows not measured this time, in their order
        fresh = {r["codec"]: r for r in rows}
        old = json.loads(args.out.read_text())["rows"]
        rows = [fresh.pop(r["codec"], r) for r in old] + list(fresh.values())
    print(format_table(rows))
    meta = {
        "texts": kvdata.describe(ctx.texts),
        "chunk_tokens": CHUNK,
        "greedy_tokens": quality.GREEDY,
        "runtime_s": round(time.perf_counter() - t0, 1),
        "timing": "single thread, best of --repeat",
        "quality": "mean over texts; kl nats KL(recompute||decoded) over 64 teacher-forced tokens",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out} ({meta['runtime_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
