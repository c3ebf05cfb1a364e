"""TTFT of a prompt sent twice on the CPU server: ``torch_native`` vs ``cpu_prefix`` attention.

For each dtype and backend it starts one real SGLang server (SmolLM2-135M, CPU platform plugin,
``--sleep-on-idle``), then per repeat sends a fresh ``--prompt-tokens`` prompt twice (cold, then a
full prefix hit: ``prompt_tokens - 1`` cached tokens, one token computed) and a fresh
``--new-tokens``-token prompt alone (the uncached cost of a few new tokens). TTFT is the client-side
latency of a 1-token greedy ``/generate``. Medians over repeats are reported.

It also times the attention op alone, in-process (30 layers, one new token over a
``prompt_tokens - 1`` cached prefix, one thread), which is robust to the shared machine's load.

Writes ``docs/results/cpu_attention.json`` and prints a table.
``python -m benchmarks.bench_cpu_attention [--dtypes float32,bfloat16] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
import urllib.request
from pathlib import Path

import torch

from benchmarks.launcher import ServerSpec, SGLangServer
from sgl_remote_kv.model import ensure_model

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("torch_native", "cpu_prefix")


def _ttft(base_url: str, ids: list[int]) -> tuple[float, int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    req = urllib.request.Request(
        base_url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, int(out["meta_info"].get("cached_tokens", 0))


def measure_server(dtype: str, backend: str, args: argparse.Namespace, seed: int) -> dict:
    """One server; per repeat: cold prompt, the same prompt again, a few new tokens alone."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1000, 40000, (n,), generator=gen).tolist()  # noqa: E731
    spec = ServerSpec(
        model_path=str(ensure_model(dtype)),
        dtype=dtype,
        max_total_tokens=8192,
        extra_args=("--attention-backend", backend, "--enable-cache-report"),
        log_path=str(Path(args.log_dir) / f"bench-cpu-attn-{dtype}-{backend}.log"),
    )
    rows: dict[str, list[float]] = {"cold_s": [], "cached_s": [], "new_only_s": []}
    load = [os.getloadavg()[0]]
    with SGLangServer(spec) as srv:
        _ttft(srv.base_url, rand(16))  # warm-up
        for _ in range(args.repeats):
            prompt = rand(args.prompt_tokens)
            rows["cold_s"].append(_ttft(srv.base_url, prompt)[0])
            t, cached = _ttft(srv.base_url, prompt)
            if cached < args.prompt_tokens - 1:
                raise RuntimeError(f"second send was not a prefix hit ({cached} cached tokens)")
            rows["cached_s"].append(t)
            rows["new_only_s"].append(_ttft(srv.base_url, rand(args.new_tokens))[0])
    load.append(os.getloadavg()[0])
    res = {k: round(statistics.median(v), 4) for k, v in rows.items()}
    res.update({k.replace("_s", "_min_s"): round(min(v), 4) for k, v in rows.items()})
    return {"dtype": dtype, "backend": backend, **res, "samples": rows, "loadavg_1m": load}


def attention_only_ms(dtype: torch.dtype, backend_cls, prefix: int, layers: int = 30) -> float:
    """In-process: extend attention for 1 new token over ``prefix`` cached tokens, ``layers`` times."""
    from types import SimpleNamespace

    heads, kv_heads, dim, pool = 9, 3, 64, prefix + 64
    runner = SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=SimpleNamespace())
    backend = backend_cls(runner)
    k, v = torch.randn(pool, kv_heads, dim).to(dtype), torch.randn(pool, kv_heads, dim).to(dtype)
    req_to_token = torch.randperm(pool)[: prefix + 1].to(torch.int32).unsqueeze(0)
    q = torch.randn(1, heads, dim).to(dtype)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    lens = (t([0]), t([prefix + 1]), t([prefix]), t([1]))
    best = float("inf")
    for _ in range(3):
        backend.init_forward_metadata(SimpleNamespace(out_cache_loc=None))
        t0 = time.perf_counter()
        for _ in range(layers):
            backend._run_sdpa_forward_extend(
                q,
                torch.empty_like(q),
                k,
                v,
                req_to_token,
                *lens,
                None,
                scaling=dim**-0.5,
                enable_gqa=True,
                causal=True,
            )
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def attention_only(args: argparse.Namespace) -> list[dict]:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sgl_remote_kv.sglang_glue.cpu_attention import CpuPrefixAttnBackend

    classes = {"torch_native": TorchNativeAttnBackend, "cpu_prefix": CpuPrefixAttnBackend}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [
            {
                "dtype": d,
                "backend": b,
                "ms_30_layers": attention_only_ms(getattr(torch, d), classes[b], args.prompt_tokens - 1),
            }
            for d in args.dtypes
            for b in args.backends
        ]
    finally:
        torch.set_num_threads(threads)


def print_table(result: dict) -> None:
    n, m = result["config"]["prompt_tokens"], result["config"]["new_tokens"]
    print(f"\nTTFT (s, median of {result['config']['repeats']}), {n}-token prompt sent twice, CPU x2:")
    print(f"{'dtype':9} {'backend':13} {'cold':>7} {'cached':>7} {f'{m} new alone':>13} {'attn-only ms':>13}")
    print(f"{'':23}(median; min of the cached sends in brackets)")
    attn = {(a["dtype"], a["backend"]): a["ms_30_layers"] for a in result["attention_only"]}
    for r in result["servers"]:
        ms = attn.pop((r["dtype"], r["backend"]), float("nan"))
        print(
            f"{r['dtype']:9} {r['backend']:13} {r['cold_s']:7.3f} {r['cached_s']:7.3f} "
            f"{r['new_only_s']:13.3f} {ms:13.2f}  [{r.get('cached_min_s', float('nan')):.3f}]"
        )
    for (dtype, backend), ms in attn.items():  # attention-only rows without a server run
        print(f"{dtype:9} {backend:13} {'-':>7} {'-':>7} {'-':>13} {ms:13.2f}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    p.add_argument("--backends", default=",".join(BACKENDS), type=lambda s: s.split(","))
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--new-tokens", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "cpu_attention.json"))
    p.add_argument("--skip-servers", action="store_true", help="attention-only timings")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    servers = []
    if not args.skip_servers:
        for i, (d, b) in enumerate((d, b) for d in args.dtypes for b in args.backends):
            servers.append(measure_server(d, b, args, seed=1000 + i))
            logger.info("%s", servers[-1])
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "servers": servers,
        "attention_only": attention_only(args),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return result


if __name__ == "__main__":
    main()
