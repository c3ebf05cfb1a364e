"""Can an encoder see, from the KV alone, how much KL a quality level will cost on a text? (issue 38)

A per-chunk quality controller would estimate each chunk's distortion at encode time and scale its steps
so every chunk lands on the level's KL target. This benchmark tests the candidate signals on real
SmolLM2 KV of every catalogue text (``benchmarks.kvdata``), with the calibration ``make calibration``
makes, at one level:

- ``kl_ratio``: measured next-token KL over the 64-token continuation / the level's target (the codec as
  it ships: steps relative to each token's RMS);
- ``energy_ratio``: the KV-only proxy. With steps relative to the token RMS, the absolute noise a
  (layer, K/V) adds is proportional to its mean squared token RMS in the transform domain; the calibration
  gives every (layer, K/V) an equal KL share, so the predicted KL ratio is the mean over (layer, K/V) of
  that energy against its mean over the calibration texts;
- ``entropy``: the model's own predictive entropy on the continuation (not visible to an encoder; tells
  whether confident predictions explain low KL);
- ``controlled``: the proxy used as a controller (per (layer, K/V) step multiplier
  ``sqrt(reference / energy)``, clipped to [0.5, 4], folded into the token scales) and its KL ratio and
  bits per value (order-0 symbol entropy + 16 bits per escape: an estimate, not a blob size).

Writes ``docs/results/quality_proxy.json`` (per text, and the log-log correlations). CLI:
``python -m benchmarks.bench_quality_proxy [--level 0.0005]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks import kvdata, quality

OUT = kvdata.REPO / "docs" / "results" / "quality_proxy.json"
ALPHA_CLIP = (0.5, 4.0)


def _coeffs(cal, a: np.ndarray, layer: int, kv: int) -> tuple[np.ndarray, np.ndarray]:
    from sgl_remote_kv.codec import transform_ops as ops

    x = np.ascontiguousarray(kvdata.to_f32(a[layer]), np.float32)
    return x, ops.forward(cal, layer, kv, 0, x.copy(), 0)


def energy(cal, t: kvdata.TextKV) -> np.ndarray:
    """[L, 2] mean squared token RMS of the transformed KV (sinks left out)."""
    from sgl_remote_kv.codec import transform_ops as ops

    out = np.zeros((t.k.shape[0], 2))
    for layer in range(t.k.shape[0]):
        for kv, a in enumerate((t.k, t.v)):
            _, y = _coeffs(cal, a, layer, kv)
            out[layer, kv] = np.mean(ops.token_rms(y)[cal.sinks :].astype(np.float64) ** 2)
    return out


def coded(cal, level: str, t: kvdata.TextKV, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """K, V (bf16 bits) after the codec with token scales multiplied by ``alpha`` [L, 2], and the estimated
    bits per value."""
    from sgl_remote_kv.codec import calibration as cm
    from sgl_remote_kv.codec import transform_ops as ops

    outs, bits = [], 0.0
    for kv, a in enumerate((t.k, t.v)):
        res = np.empty(a.shape, np.float32)
        for layer in range(a.shape[0]):
            x, y = _coeffs(cal, a, layer, kv)
            t_n, c_n = x.shape[0], x.shape[1] * x.shape[2]
            n_sink = ops.sink_count(cal, 0, t_n)
            s = ops.code_scales([ops.token_rms(y, n_sink) * np.float32(alpha[layer, kv])])[2][0]
            sym, esc = np.empty((c_n, t_n), np.uint8), np.empty(t_n * c_n, np.int16)
            n = ops.quantize(
                y, cal.steps[level][layer, kv, 0:1], s, np.empty((0, cm.SYMBOLS), np.uint16), 0, sym, esc
            )
            if n < 0:
                raise ValueError(f"{t.name} layer {layer}: values do not fit the escape format")
            for row in sym:
                h = np.bincount(row, minlength=256).astype(np.float64)
                h = h[h > 0]
                bits -= float((h * np.log2(h / t_n)).sum())
            bits += 16 * n
            out = np.empty((t_n, y.shape[0], cal.group_dim), np.float32)
            cos, sin = ops.rope_tables(cal.rope, 0, t_n)
            rope = (cos, sin, ops.rope_style(cal.rope)) if kv == 0 else None
            cal.inverse_tables(level, layer).decode(
                kv, 0, sym, esc[:n], s, cal.mean[layer, kv, 0:1], rope, cal.head_dim, 0, out
            )
            out = out.reshape(x.shape)
            out[:n_sink] = x[:n_sink]
            res[layer] = out
        outs.append(kvdata.f32_to_bf16(res))
    return outs[0], outs[1], bits / (2 * t.k.size)


def _corr(a, b) -> float:
    return float(np.corrcoef(np.log(a), np.log(b))[0, 1])


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_codec_rd import check_calibration
    from sgl_remote_kv.codec import calibration as cm
    from sgl_remote_kv.codec.calibration import texts as ct

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", default=cm.DEFAULT_LEVEL, choices=cm.LEVELS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cal = cm.lookup(bytes.fromhex(check_calibration(False)))
    target = float(args.level)
    model, tok = kvdata.load_model(threads=1)
    texts = kvdata.load_texts(model_tok=(model, tok))
    en = {t.name: energy(cal, t) for t in texts}
    ref = np.mean([en[n] for n in ct.CALIBRATION if n in en], axis=0)
    rows = []
    for t in texts:
        base = quality.recompute_baseline(model, t)
        p = base.logp.exp()
        row = {
            "text": t.name,
            "kind": t.kind,
            "role": t.role,
            "energy_ratio": float(np.mean(en[t.name] / ref)),
            "entropy": float(-(p * base.logp).sum(-1).mean()),
        }
        for mode in ("as_shipped", "controlled"):
            alpha = (
                np.ones_like(ref) if mode == "as_shipped" else np.clip(np.sqrt(ref / en[t.name]), *ALPHA_CLIP)
            )
            k, v, bpv = coded(cal, args.level, t, alpha)
            kl = quality.evaluate(model, t, base, k, v, greedy=False)["kl"]
            row[mode] = {"kl_ratio": kl / target, "bits_per_value": bpv}
        rows.append(row)
        print(
            f"{t.name:24s} {t.kind:12s} {t.role:7s} energy {row['energy_ratio']:.3f} entropy {row['entropy']:.2f}"
            f" | KL/target {row['as_shipped']['kl_ratio']:.3f} ({row['as_shipped']['bits_per_value']:.3f} b/v)"
            f" | controlled {row['controlled']['kl_ratio']:.3f} ({row['controlled']['bits_per_value']:.3f} b/v)",
            flush=True,
        )
    kl = np.array([r["as_shipped"]["kl_ratio"] for r in rows])
    klc = np.array([r["controlled"]["kl_ratio"] for r in rows])
    summary = {
        "corr_log_kl_ratio_vs_log_energy_ratio": _corr(kl, [r["energy_ratio"] for r in rows]),
        "corr_log_kl_ratio_vs_log_entropy": _corr(kl, [r["entropy"] for r in rows]),
        "kl_ratio_spread_as_shipped": {
            "min": float(kl.min()),
            "max": float(kl.max()),
            "geo_sd": float(np.exp(np.log(kl).std())),
        },
        "kl_ratio_spread_controlled": {
            "min": float(klc.min()),
            "max": float(klc.max()),
            "geo_sd": float(np.exp(np.log(klc).std())),
        },
    }
    res = {
        "meta": {
            "calibration": cal.calib_id.hex(),
            "level": args.level,
            "cpu": kvdata.cpu_model(),
            "command": "python -m benchmarks.bench_quality_proxy --level " + args.level,
            "runtime_s": round(time.perf_counter() - t0, 1),
        },
        "summary": summary,
        "texts": rows,
    }
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
