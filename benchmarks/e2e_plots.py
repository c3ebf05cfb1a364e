"""PNG plots of ``docs/results/e2e.json`` (matplotlib, Agg).

- ``e2e_ttft.png``: mean / p90 TTFT per link rate for the remote configurations, the local ones
  (recompute, cold device cache, warm device cache) as horizontal references;
- ``e2e_load_latency.png``: mean TTFT and TPOT against achieved request throughput (ShadowServe
  Fig. 9 style) at the curve's link rate;
- ``e2e_fetch_floor.png``: each probe request's store fetch time against its wire-time floor;
- ``e2e_interference.png``: a running decode's TPOT alone vs while other requests fetch;
- ``e2e_probe_ratio.png``: each probe request's latency over its side-by-side recompute reference
  (< 1: the remote tier was faster at that moment), filled markers where the request was fetched.

``python -m benchmarks.e2e_plots [e2e.json]`` re-draws from a saved result.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

LOCAL = ("recompute", "device")
BASES = ("dpu_fetch", "inproc_fetch", "recompute", "device", "raw", "dpu", "nvdec", "auto", "inproc")


def _tag(name: str) -> str:
    """The run tag of a result key (``--tag``): what follows the configuration's own name."""
    base = max((b for b in BASES if name.startswith(b)), key=len, default=name.partition("_")[0])
    return name[len(base) :].lstrip("_")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok(cfgs: dict) -> dict:
    return {k: v for k, v in cfgs.items() if "runs" in v}


def _label(name: str, c: dict) -> str:
    return name if c.get("status", "ok") == "ok" else f"{name} (*)"


def plot_ttft(result: dict, out: Path) -> None:
    plt = _plt()
    cfgs = _ok(result["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "mean_ttft_ms", "mean TTFT"), (axes[1], "p90_ttft_ms", "p90 TTFT")):
        for name, c in cfgs.items():
            runs = [r for r in c["runs"] if r["harness"].get(key) is not None]
            if name.partition("_")[0] in LOCAL and runs:
                ls = "--" if "_" not in name else "-."
                ax.axhline(
                    runs[0]["harness"][key] / 1e3,
                    ls=ls,
                    color={"recompute": "grey", "device": "tab:olive"}.get(name, "tab:cyan"),
                    label=f"{name} (no link)",
                )
                continue
            xs = [r["rate_mbit"] for r in runs]
            ax.plot(xs, [r["harness"][key] / 1e3 for r in runs], "o-", label=_label(name, c))
        warm = next((r.get("device_warm") for r in cfgs.get("device", {}).get("runs", [])), None)
        if warm and warm.get(key):
            ax.axhline(warm[key] / 1e3, ls=":", color="k", label="device (warm, all hits)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate to the store (Mbit/s, tc tbf)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{title}, generated-shared-prefix, cold device cache")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.text(0.01, 0.01, "(*) = the server did not take the named path; see status in e2e.json", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "e2e_ttft.png", dpi=110)
    plt.close(fig)


def plot_load_latency(result: dict, out: Path) -> None:
    """One column per run group (configs tagged ``name_tag`` ran together, untagged in the main run)."""
    plt = _plt()
    groups: dict[str, dict] = {}
    for name, c in _ok(result["configs"]).items():
        pts = [p for p in ((c.get("load_latency") or {}).get("points") or []) if p.get("request_throughput")]
        if pts:
            groups.setdefault(_tag(name), {})[name] = (c, pts)
    if not groups:
        return
    fig, axes = plt.subplots(2, len(groups), figsize=(5.5 * len(groups), 7), squeeze=False)
    for col, (tag, members) in enumerate(sorted(groups.items())):
        for name, (c, pts) in members.items():
            link = c["load_latency"].get("link_rate_mbit")
            label = f"{_label(name, c)} ({link:g} Mbit/s)" if link else f"{name} (no link)"
            thr = [p["request_throughput"] for p in pts]
            axes[0][col].plot(thr, [p["mean_ttft_ms"] / 1e3 for p in pts], "o-", label=label)
            axes[1][col].plot(thr, [p["mean_tpot_ms"] for p in pts], "o-", label=label)
        axes[0][col].set_title(f"run: {tag or 'main'} (Poisson arrivals)")
        axes[0][col].set_ylabel("mean TTFT (s)")
        axes[1][col].set_ylabel("mean TPOT (ms)")
        for ax in axes[:, col]:
            ax.set_xlabel("achieved request throughput (req/s)")
            ax.grid(True, alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "e2e_load_latency.png", dpi=100)
    plt.close(fig)


def plot_fetch_floor(result: dict, out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    lim = [1e9, 0.0]
    for name, c in _ok(result["configs"]).items():
        pts = [
            (p["wire_floor_s"], p["fetch_s"])
            for r in c["runs"]
            for p in r["probe"]
            if p.get("fetch_over_floor")
        ]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        ax.scatter(xs, ys, label=_label(name, c), s=18)
        lim = [min(lim[0], *xs, *ys), max(lim[1], *xs, *ys)]
    if lim[1] == 0:
        ax.text(0.5, 0.5, "no remote fetches recorded", ha="center", transform=ax.transAxes)
    else:
        xs = [lim[0] * 0.8, lim[1] * 1.2]
        ax.plot(xs, xs, "k-", lw=0.8, label="= wire floor")
        ax.plot(xs, [1.2 * x for x in xs], "k--", lw=0.8, label="1.2x floor (target)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_xlabel("wire floor: compressed bytes / link rate (s)")
    ax.set_ylabel("measured store fetch time (s)")
    ax.set_title("per-request remote fetch vs wire floor")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "e2e_fetch_floor.png", dpi=110)
    plt.close(fig)


def plot_interference(result: dict, out: Path) -> None:
    plt = _plt()
    rows = []
    for name, c in _ok(result["configs"]).items():
        i = c.get("interference") or {}
        if i.get("loaded_over_unloaded"):
            bg = "+".join(sorted(i.get("paths") or {})) or "prefill"  # what the background requests did
            label = f"{_label(name, c)}\nbg: {bg}"
            rows.append((label, i["unloaded_tpot"]["mean_s"] * 1e3, i["loaded_tpot"]["mean_s"] * 1e3))
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(10, 4.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.4, label="decode alone")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], 0.4, label="while other requests fetch / prefill")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x + 0.2, r[2], f"{r[2] / r[1]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=7, rotation=20)
    ax.set_ylabel("mean TPOT of the running decode (ms)")
    ax.set_title("interference on a running decode (labels: loaded / alone; target <= 1.05x for dpu)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "e2e_interference.png", dpi=110)
    plt.close(fig)


def plot_probe_ratio(result: dict, out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    cfgs = [(n, c) for n, c in _ok(result["configs"]).items()]
    drawn = False
    for k, (name, c) in enumerate(cfgs):
        rows = [
            (r["rate_mbit"], p)
            for r in c["runs"]
            if r["rate_mbit"]
            for p in r["probe"]
            if p.get("recompute_ref_s")
        ]
        if not rows:
            continue
        color = plt.get_cmap("tab20")(k % 20)
        jitter = 1 + 0.04 * (k - len(cfgs) / 2)  # configs side by side around each rate
        for hit, style in ((True, {"color": color}), (False, {"facecolors": "none", "edgecolors": color})):
            pts = [
                (x * jitter, p["latency_s"] / p["recompute_ref_s"])
                for x, p in rows
                if bool(p.get("remote_hit_tokens")) == hit
            ]
            if pts:
                label = f"{_label(name, c)}" + ("" if hit else " (not fetched)")
                ax.scatter(*zip(*pts, strict=True), s=20, label=label, **style)
                drawn = True
    if not drawn:
        plt.close(fig)
        return
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="= recompute measured side by side")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate to the store (Mbit/s)")
    ax.set_ylabel("probe latency / side-by-side recompute latency")
    ax.set_title(
        "1025-token prompt: remote tier vs recompute, same moment\n(filled: remote hit; hollow: recomputed)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out / "e2e_probe_ratio.png", dpi=110)
    plt.close(fig)


def plot_all(result: dict, out: Path) -> None:
    for fn in (plot_ttft, plot_load_latency, plot_fetch_floor, plot_interference, plot_probe_ratio):
        try:
            fn(result, out)
        except Exception:  # one broken plot must not lose the others
            logger.exception("%s failed", fn.__name__)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    p = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).resolve().parent.parent / "docs/results/e2e.json"
    )
    plot_all(json.loads(p.read_text()), p.parent)
