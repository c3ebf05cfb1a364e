"""Derived views of an e2e result (all computed from measured fields of ``e2e.json``, nothing typed in).

- ``scaling``: this machine's measured prefill rate (prompt tokens / latency of the side-by-side
  recompute references; runs without them: the recompute config's probes)
  and, per link rate, the bandwidth that plays the same role for Llama-8B on an L40S. What decides
  fetch-vs-recompute is how many tokens of KV the link delivers per second of prefill:
  ``link / (kv_bytes_per_token * prefill_tok_s)``; keeping that ratio, a rate ``r`` here corresponds
  to ``r * (128 KiB * P_L40S) / (kv_here * P_here)`` there (``P_L40S`` from ``projection.prefill_s``).
- ``fetch_vs_floor``: every probe request's fetch/floor ratio per config and rate.
- ``auto_vs_fixed``: per rate, auto's mean TTFT and paths next to the best fixed configuration.
- ``interference``: loaded/unloaded TPOT per configuration, and the device-hit baseline's beside it.
- ``probe_vs_recompute``: per config and rate, each probe request's latency over the side-by-side
  recompute of a same-length fresh prompt (measured right after it, same server, same moment), and a
  fetched probe's over the local hit of the same prompt asked again right after it (runs that timed one).
"""

from __future__ import annotations

import logging
import statistics

from benchmarks import projection

logger = logging.getLogger(__name__)

FIXED = ("recompute", "device", "raw", "dpu", "nvdec", "inproc", "dpu_fetch", "inproc_fetch")


def _cfgs(result: dict) -> dict:
    return {k: v for k, v in result["configs"].items() if "runs" in v}


def scaling(result: dict, kv_bytes_per_token: int) -> dict:
    # every side-by-side recompute reference (fresh prompt of the probe's length), else the recompute
    # config's probes
    refs = [
        p["prompt_tokens"] / p["recompute_ref_s"]
        for c in _cfgs(result).values()
        for r in c["runs"]
        for p in r["probe"]
        if p.get("recompute_ref_s")
    ]
    rec = _cfgs(result).get("recompute")
    rows = [p["prompt_tokens"] / p["latency_s"] for r in (rec or {}).get("runs", []) for p in r["probe"]]
    if not (refs or rows):
        return {"status": "no recompute probe"}
    tok_s = statistics.median(refs or rows)
    m, hw = projection.Model(), projection.HW
    l40s_tok_s = 14000 / projection.prefill_s(14000, m, hw)
    factor = (m.kv_bytes_per_token * l40s_tok_s) / (kv_bytes_per_token * tok_s)
    rates = sorted({r["rate_mbit"] for c in _cfgs(result).values() for r in c["runs"] if r["rate_mbit"]})
    return {
        "cpu_prefill_tok_s": tok_s,
        "cpu_prefill_samples": len(refs or rows),
        "kv_bytes_per_token": kv_bytes_per_token,
        "l40s_llama8b_prefill_tok_s_model": l40s_tok_s,
        "rate_scale_factor": factor,
        "paper_equivalent_gbps": {str(r): r * factor / 1000 for r in rates},
    }


def fetch_vs_floor(result: dict) -> dict:
    out = {}
    for name, c in _cfgs(result).items():
        for r in c["runs"]:
            ratios = [p["fetch_over_floor"] for p in r["probe"] if p.get("fetch_over_floor")]
            if ratios:
                out.setdefault(name, {})[str(r["rate_mbit"])] = {
                    "n": len(ratios),
                    "median": statistics.median(ratios),
                    "max": max(ratios),
                    "within_1_2x": sum(x <= 1.2 for x in ratios),
                    "compressed_mb_per_request": statistics.median(
                        p["fetched_bytes"] / 1e6 for p in r["probe"] if p.get("fetch_over_floor")
                    ),
                }
    return out


def _ttft_at(c: dict, rate) -> float | None:
    for r in c["runs"]:
        if r["rate_mbit"] in (rate, None):
            return r["harness"].get("mean_ttft_ms")
    return None


def auto_vs_fixed(result: dict) -> dict:
    cfgs = _cfgs(result)
    auto = cfgs.get("auto")
    if not auto:
        return {"status": "auto not run"}
    out = {}
    for r in auto["runs"]:
        rate = r["rate_mbit"]
        fixed = {n: _ttft_at(cfgs[n], rate) for n in FIXED if n in cfgs and _ttft_at(cfgs[n], rate)}
        best = min(fixed, key=fixed.get) if fixed else None
        a = r["harness"].get("mean_ttft_ms")
        out[str(rate)] = {
            "auto_mean_ttft_ms": a,
            "auto_paths": r["harness"]["remote"]["paths"],
            "auto_probe_paths": [p["paths"] for p in r["probe"]],
            "fixed_mean_ttft_ms": fixed,
            "best_fixed": best,
            "auto_over_best": a / fixed[best] if best and a else None,
        }
    return out


def interference(result: dict) -> dict:
    out = {}
    for name, c in _cfgs(result).items():
        i = c.get("interference") or {}
        if i.get("loaded_over_unloaded"):
            out[name] = {
                "unloaded_tpot_ms": i["unloaded_tpot"]["mean_s"] * 1e3,
                "loaded_tpot_ms": i["loaded_tpot"]["mean_s"] * 1e3,
                "ratio": i["loaded_over_unloaded"],
                "paths": i.get("paths"),
            }
            base = i.get("device_hit_baseline") or {}
            if base.get("loaded_over_unloaded"):  # same server, every background request a device hit
                out[name]["device_hit_ratio"] = base["loaded_over_unloaded"]
                out[name]["remainder"] = i["loaded_over_unloaded"] / base["loaded_over_unloaded"]
    return out


def _median(values) -> float | None:
    """The median of ``values``, or None when there are none (no probe was a local hit)."""
    values = list(values)
    return statistics.median(values) if values else None


def probe_vs_recompute(result: dict) -> dict:
    out = {}
    for name, c in _cfgs(result).items():
        for r in c["runs"]:
            rows = [p for p in r["probe"] if p.get("recompute_ref_s")]
            if rows:
                ratios = [p["latency_s"] / p["recompute_ref_s"] for p in rows]
                fetched = [p for p in rows if p.get("remote_hit_tokens")]
                # each fetched probe's remote hit, then the same prompt as a local hit
                local = [p for p in fetched if p.get("local_hit_s")]
                out.setdefault(name, {})[str(r["rate_mbit"])] = {
                    "n": len(rows),
                    "fetched": len(fetched),
                    "median_latency_s": statistics.median(p["latency_s"] for p in rows),
                    "median_recompute_ref_s": statistics.median(p["recompute_ref_s"] for p in rows),
                    "median_ratio": statistics.median(ratios),
                    "median_local_hit_s": _median(p["local_hit_s"] for p in local),
                    "median_remote_over_local_hit": _median(p["latency_s"] / p["local_hit_s"] for p in local),
                    # the least remote / local any fetch could reach on this link: the local hit plus the
                    # time the probe's payload takes on the wire (nothing else), over the local hit
                    "median_wire_floor_over_local_hit": _median(
                        (p["local_hit_s"] + p["wire_floor_s"]) / p["local_hit_s"] for p in local
                    ),
                    # what the tier adds beyond that floor: the remote hit over (local hit + wire floor)
                    "median_remote_over_local_plus_wire": _median(
                        p["latency_s"] / (p["local_hit_s"] + p["wire_floor_s"]) for p in local
                    ),
                    "paths": [p["paths"] for p in rows],
                }
    return out


def derive(result: dict, kv_bytes_per_token: int) -> dict:
    return {
        "probe_vs_recompute": probe_vs_recompute(result),
        "scaling": scaling(result, kv_bytes_per_token),
        "fetch_vs_floor": fetch_vs_floor(result),
        "auto_vs_fixed": auto_vs_fixed(result),
        "interference": interference(result),
    }


# -- markdown tables for docs/RESULTS.md (printed, pasted by hand; every cell from e2e.json) ----------
def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def tables(result: dict) -> str:
    lines = [
        "| config | link Mbit/s | TTFT mean / p50 / p90 (ms) | TPOT mean (ms) | req/s | cached dev/storage tok | remote paths |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in result["configs"].items():
        if "runs" not in c:
            lines.append(f"| {name} | - | {c.get('status', '?')} | | | | |")
            continue
        for r in c["runs"]:
            for tag, h in ((name, r["harness"]), (f"{name} (warm)", r.get("device_warm"))):
                if not h:
                    continue
                cr = h.get("cache_report") or {}
                lines.append(
                    f"| {tag} | {_f(r['rate_mbit'])} | {_f(h['mean_ttft_ms'])} / {_f(h['median_ttft_ms'])} / "
                    f"{_f(h['p90_ttft_ms'])} | {_f(h['mean_tpot_ms'])} | {_f(h['request_throughput'], '{:.3f}')} | "
                    f"{cr.get('device_cached_tokens')}/{cr.get('storage_cached_tokens')} | {h['remote']['paths'] or '-'} |"
                )
    lines += [
        "",
        "| config | link Mbit/s | probe: tokens, MB over the link, fetch s, floor s, fetch/floor, latency s, path |",
        "|---|---|---|",
    ]
    for name, c in result["configs"].items():
        for r in c.get("runs", []):
            cells = [
                f"{p['prompt_tokens']} tok, {_f((p.get('wire_bytes') or p['fetched_bytes']) / 1e6, '{:.2f}')} MB, "
                f"{_f(p['fetch_s'], '{:.2f}')}, "
                f"{_f(p['wire_floor_s'], '{:.2f}')}, {_f(p['fetch_over_floor'], '{:.2f}')}x, "
                f"{p['latency_s']:.2f}, {p['paths'] or '-'}"
                for p in r["probe"]
            ]
            lines.append(f"| {name} | {_f(r['rate_mbit'])} | {'; '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    res = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/e2e.json").read_text())
    print(tables(res))
    print(json.dumps({**(res.get("derived") or {}), "probe_vs_recompute": probe_vs_recompute(res)}, indent=1))
