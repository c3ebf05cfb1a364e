"""Measurements for the GPU report (``tests/test_gpu_metrics.py`` records them; none is asserted).

- ``writer_h2d_gbps``: a whole ``KVWriter.write`` (H2D copy + scatter into the pool + the completion wait)
  in GB/s of K+V bytes, from a host region pinned in place (zero-copy: ``register_host``, what the DPU
  destination region is) or from pageable memory (staged through the writer's pinned buffer); best of
  ``repeats`` after one warm-up write.
- ``dequant_gbps`` / ``inverse_transform_gbps``: the Triton dequant and inverse-transform kernels in GB/s
  of *decoded* KV written (the codec's output bytes), timed with CUDA events over ``iters`` launches
  (host wall clock on a CPU, under the Triton interpreter: only to exercise the code).
- ``compile_times``: each Triton kernel variant's first launch (compile + run) against a warm launch,
  and the tier's start-up ``kvpool.warmup.warm_up`` cold and warm. Only meaningful in a fresh process
  with an empty Triton cache: ``python tests/gpu_measure.py compile --device cuda`` (the test runs it so,
  with ``TRITON_CACHE_DIR`` set to an empty directory) prints them as JSON.
"""

from __future__ import annotations

import json
import mmap
import statistics
import sys
import time

import numpy as np
import torch

from sgl_remote_kv.types import KVLayout, ModelFingerprint

TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def page_aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous page-aligned host memory (what ``cudaHostRegister`` pins in place); the arrays over it
    keep the mapping alive."""
    m = mmap.mmap(-1, nbytes)
    return m, np.frombuffer(m, np.uint8, nbytes)


def writer_h2d_gbps(writer, tokens: int, pinned: bool, repeats: int = 3, seed: int = 0) -> dict:
    """See module docstring. ``writer``: a pool's ``KVWriter`` (its layout's every layer is written)."""
    lay = writer.layout
    shape = (lay.num_layers, tokens, lay.num_kv_heads, lay.head_dim)
    nbytes = 2 * int(np.prod(shape)) * writer.storage.itemsize
    m, raw = page_aligned(nbytes)
    kv = raw.view(writer.storage).reshape(2, *shape)
    bits = raw.view(np.uint16)  # small positive finite values in any storage dtype
    bits[...] = np.random.default_rng(seed).integers(0, 1 << 14, bits.size, dtype=np.uint16)
    slots = torch.randperm(writer.pool.k[0].shape[0])[:tokens]
    if pinned:
        writer.register_host(raw)
    try:
        writer.write(kv[0], kv[1], slots)  # warm-up: compiles, grows the staging buffers
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            writer.write(kv[0], kv[1], slots)
            times.append(time.perf_counter() - t0)
    finally:
        if pinned:
            writer.unregister_host(raw)
    stats = dict(getattr(writer, "stats", {}))
    del m  # unmapped with the last array over it
    return {"gbps": nbytes / min(times) / 1e9, "bytes": nbytes, "best_s": min(times), "writer_stats": stats}


def _time_launches(fn, device, iters: int) -> float:
    """Seconds per launch of ``fn`` (after one untimed launch)."""
    fn()
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def dequant_gbps(device, tokens: int, channels: int, dtype: str = "bfloat16", iters: int = 20) -> dict:
    from sgl_remote_kv.kernels.dequant import dequant_triton

    g = torch.Generator().manual_seed(1)
    m = 127
    codes = torch.randint(0, 2 * m + 1, (tokens, channels), dtype=torch.uint8, generator=g).to(device)
    scales = (torch.rand(tokens, channels // 128, generator=g) + 0.5).to(device)
    out = torch.empty(tokens, channels, dtype=TD[dtype], device=device)
    s = _time_launches(lambda: dequant_triton(codes, scales, m, None, out.dtype, out=out), device, iters)
    nbytes = out.numel() * out.element_size()
    return {"gbps": nbytes / s / 1e9, "decoded_bytes": nbytes, "launch_s": s}


def _inverse_inputs(device, tokens: int, heads: int, head_dim: int, seed: int = 2):
    """Inputs of one ``inverse_triton`` launch: one head group per KV head (``gd = head_dim``)."""
    from sgl_remote_kv.kernels.transform import TransformConsts, resolve_escapes

    rng = np.random.default_rng(seed)
    n_g, gd = heads, head_dim
    basis = np.linalg.qr(rng.standard_normal((2, n_g, gd, gd)))[0].astype(np.float32)
    consts = TransformConsts.build(
        rng.uniform(0.01, 0.2, (2, n_g, gd)), basis, rng.standard_normal((2, n_g, gd)) * 0.1, head_dim, 0
    ).to(lambda a: torch.from_numpy(a).to(device))
    sym = torch.from_numpy(rng.integers(1, 256, (2, n_g * gd, tokens)).astype(np.uint8)).to(device)
    esc = torch.zeros(0, dtype=torch.int16, device=device)
    q = resolve_escapes(sym, esc)
    scales = torch.from_numpy(rng.uniform(0.5, 3.0, (2, tokens)).astype(np.float32)).to(device)
    ang = np.arange(tokens)[:, None] / 10000.0 ** (np.arange(head_dim // 2) * 2.0 / head_dim)
    cos, sin = (torch.from_numpy(f(ang).astype(np.float32)).to(device) for f in (np.cos, np.sin))
    return q, scales, cos, sin, consts


def inverse_transform_gbps(
    device, tokens: int, heads: int, head_dim: int, dtype: str = "bfloat16", iters: int = 20
) -> dict:
    from sgl_remote_kv.kernels.transform import inverse_triton

    q, scales, cos, sin, consts = _inverse_inputs(device, tokens, heads, head_dim)
    out = torch.empty(2, tokens, heads * head_dim, dtype=TD[dtype], device=device)
    fn = lambda: inverse_triton(q, scales, cos, sin, consts, head_dim, 0, True, out)  # noqa: E731
    s = _time_launches(fn, device, iters)
    nbytes = out.numel() * out.element_size()
    return {"gbps": nbytes / s / 1e9, "decoded_bytes": nbytes, "launch_s": s}


def _first_and_warm(fn, device, warm: int = 5) -> dict:
    t0 = time.perf_counter()
    fn()
    _sync(device)
    cold = time.perf_counter() - t0
    runs = []
    for _ in range(warm):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        runs.append(time.perf_counter() - t0)
    return {"first_s": round(cold, 5), "warm_s": round(statistics.median(runs), 6)}


def compile_times(device, dtype: str = "float16") -> dict:
    """See module docstring. The writer's warm-up runs first (its variants: ``dtype`` pools), then each
    kernel in a variant the warm-up did not compile (float32 output, channel scales, another shape)."""
    from sgl_remote_kv.kernels.dequant import dequant_triton
    from sgl_remote_kv.kernels.scatter import scatter_triton
    from sgl_remote_kv.kernels.transform import inverse_triton

    from sgl_remote_kv.codec.base import get_codec
    from sgl_remote_kv.kvpool import PoolTensors, writer_for
    from sgl_remote_kv.kvpool.warmup import warm_up

    out: dict = {"device": str(device), "triton_interpret": _interpreting()}
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype)
    fp = ModelFingerprint("TestArch", lay, "w" * 16)
    planes = [torch.zeros(64, 2, 64, dtype=TD[dtype], device=device) for _ in range(4)]
    writer = writer_for(PoolTensors(planes[:2], planes[2:]), lay)
    codecs = [get_codec("quant_deflate", k_bins="256", v_bins="96", granularity="head")]
    t0 = time.perf_counter()
    done = warm_up(writer, codecs, fp)
    out["kvpool_warm_up"] = {"first_s": round(time.perf_counter() - t0, 5), "writes": list(done.writes)}
    t0 = time.perf_counter()
    warm_up(writer, codecs, fp)
    out["kvpool_warm_up"]["warm_s"] = round(time.perf_counter() - t0, 5)

    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 48, 2, 64, generator=g).to(device)  # float32 source: another scatter variant
    pool = [torch.zeros(100, 2, 64, device=device) for _ in range(2)]
    slots = torch.randperm(100, generator=g)[:48].to(device)
    out["scatter_float32"] = _first_and_warm(lambda: scatter_triton(src, pool, slots), device)
    codes = torch.randint(0, 63, (48, 256), dtype=torch.uint8, generator=g).to(device)
    scales = (torch.rand(48, 2, generator=g) + 0.5).to(device)
    cs = (torch.rand(256, generator=g) + 0.5).to(device)
    for name, c, dt in (("dequant_float32", None, torch.float32), ("dequant_channel_scales", cs, TD[dtype])):
        out[name] = _first_and_warm(lambda c=c, dt=dt: dequant_triton(codes, scales, 31, c, dt), device)
    q, sc, cos, sin, consts = _inverse_inputs(device, 48, 2, 64)
    inv = torch.empty(2, 48, 128, dtype=torch.float32, device=device)
    out["inverse_transform_float32"] = _first_and_warm(
        lambda: inverse_triton(q, sc, cos, sin, consts, 64, 1, True, inv), device
    )
    return out


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "") == "1"


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description="GPU suite measurements (see tests/gpu_measure.py)")
    p.add_argument("what", choices=["compile"])
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    print("RESULT " + json.dumps(compile_times(torch.device(a.device))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
