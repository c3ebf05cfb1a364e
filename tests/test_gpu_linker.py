"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): the linker's load into a real SGLang
``MHATokenToKVPool`` on ``cuda``, the path of every remote hit (``sglang_glue/linker.py``).

Staged host rows (their arena pinned in place, as ``assemble.build_staging`` does on a GPU host) are copied layer by layer on a load
thread through the pool's device KV writer (``StagedPages.copy_out``), while the reading thread takes each
layer through the pool's ``get_key_buffer``/``get_value_buffer``, which wait on the registered layer
counter (``FencedCounter``: SGLang's ``LayerWiseLoadCounter`` plus a stream wait on the write's event), as
attention does in a forward pass: every layer read is bit-exact, and rows not loaded stay untouched.

Device decode (``test_linker_load_decodes_staged_codes_on_the_device``): staging that keeps codes (the
in-process path's lossless stage only), loaded through the same copy: the codes are uploaded from the
pinned arena and dequantized / inverse-transformed by the Triton kernels into the pool; the quantized
codec bit-exact to its CPU decode, the transform codec within one bf16 step; the load's GB/s of decoded KV
against the zero-copy H2D rate of plain KV measured in the same test (``metrics``).

Skipped with the reason when there is no CUDA device (always, in CI), or naming the module when SGLang
was not carried to the GPU machine (``tests/gpu_gate.py``).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch
from gpu_gate import gpu_gate  # noqa: F401  (autouse: skips without CUDA, names a missing module)

from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.kvpool.device_writer import DeviceKVWriter
from sgl_remote_kv.kvpool.staged import StagedPages
from sgl_remote_kv.types import KVLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_needs(
        "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.unified_cache.unified_cache_linker"
    ),
]

TD = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PAGE, TOKENS, SLOTS = 16, 96, 512


def _storage(t: torch.Tensor) -> np.ndarray:
    """The staging writer's source format: the dtype's bits (bf16 as uint16), ``[L, T, H, D]``."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_linker_load_into_a_cuda_pool_layer_by_layer_is_bit_exact(dtype):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_remote_kv.sglang_glue.linker import FencedCounter

    lay = KVLayout(6, 2, 64, dtype)
    pool = MHATokenToKVPool(
        SLOTS, 1, TD[dtype], lay.num_kv_heads, lay.head_dim, lay.num_layers, "cuda", False
    )
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.fill_(7.0)  # rows the load must not touch
    writer = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay)
    assert isinstance(writer, DeviceKVWriter)

    g = torch.Generator().manual_seed(11)
    shape = (lay.num_layers, TOKENS, lay.num_kv_heads, lay.head_dim)
    k, v = (torch.randn(shape, generator=g).to(TD[dtype]) for _ in range(2))
    staged = StagedPages(lay, rows=4 * TOKENS, page_size=PAGE)
    writer.register_host(staged.writer.arena.array)  # pinned in place, as build_staging does
    rows = staged.alloc(TOKENS)
    staged.writer.write(_storage(k), _storage(v), rows)
    pages = [f"page-{i}" for i in range(TOKENS // PAGE)]
    staged.stage(pages, rows)
    pin = staged.pin(pages)
    assert pin is not None and len(pin.rows) == TOKENS

    slots = torch.randperm(SLOTS, generator=g)[:TOKENS].to(torch.int64)
    counter = FencedCounter(lay.num_layers, writer)
    pool.register_layer_transfer_counter(counter)  # what SGLang's factory does with a linker's counter
    index = counter.update_producer()
    counter.set_consumer(index)
    errors: list[BaseException] = []

    def load() -> None:  # the linker's load thread
        try:
            staged.copy_out([(pin, slots)], writer, functools.partial(counter.complete, index))
        except BaseException as e:  # reported below; a failed copy must fail the test, not hang it
            errors.append(e)
            counter.fail(index, e)

    t = threading.Thread(target=load, name="srkv-linker-load")
    t.start()
    on = slots.cuda()
    for layer in range(lay.num_layers):  # the forward: attention reads each layer through the pool
        got_k = pool.get_key_buffer(layer)[on].cpu()
        got_v = pool.get_value_buffer(layer)[on].cpu()
        assert torch.equal(got_k, k[layer]) and torch.equal(got_v, v[layer]), f"layer {layer}"
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert counter.finish(index)
    untouched = torch.ones(pool.k_buffer[0].shape[0], dtype=torch.bool)  # SGLang's pool: size + padding rows
    untouched[slots] = False
    for buf in (*pool.k_buffer, *pool.v_buffer):
        assert bool((buf[untouched.cuda()] == 7.0).all())
    staged.release(pin)


@pytest.mark.parametrize("kind", ["quant_deflate", "transform", "transform_trellis"])
def test_linker_load_decodes_staged_codes_on_the_device(kind, tmp_path, gpu_metrics):
    import time

    from calibration_helpers import device_decode_codec
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from benchmarks import synthetic_kv as synthetic
    from sgl_remote_kv.codec import quant
    from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
    from sgl_remote_kv.kvpool.staged import staging_plan
    from sgl_remote_kv.store.client import open_client

    chunk, n = 256, 16
    fp = synthetic.fingerprint(num_layers=8, dtype="bfloat16")
    lay = fp.layout
    codec = device_decode_codec(kind, fp)  # the trellis: its k replayed into codes on the device too
    client = open_client(f"file://{tmp_path / 'store'}")
    keys = [bytes([i]) * 32 for i in range(n)]
    blobs = [codec.encode(*synthetic.kv(lay, chunk, seed=i), fp, start=i * chunk) for i in range(n)]
    client.put_many(list(zip(keys, blobs, strict=True)))
    ref = [codec.decode(b, fp) for b in blobs]
    tokens = n * chunk
    pool = MHATokenToKVPool(
        2 * tokens, 1, torch.bfloat16, lay.num_kv_heads, lay.head_dim, lay.num_layers, "cuda", False
    )
    writer = writer_for(PoolTensors(pool.k_buffer, pool.v_buffer), lay)
    plan = staging_plan(lay, writer.device_dequant, codec, [])
    assert plan.keep_codes

    def staging(keep: bool):
        s = StagedPages(lay, tokens, PAGE, keep_codes=keep, nbytes=tokens * lay.bytes_per_token())
        writer.register_host(s.writer.arena.array)
        return s

    def timed_load(s, rows, slots) -> float:
        pages = [f"p{i}" for i in range(tokens // PAGE)]
        entry = s.stage(pages, rows)
        pin = s.pin(pages)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.copy_out([(pin, slots)], writer, lambda layer: None)
        writer.fence()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        s.release(pin)
        s.release(entry)
        return dt

    codes = staging(True)
    be = InProcessFetchBackend(client, codec, fp, chunk, keep_codes=True)
    h = be.submit("r", keys, start_token=0)
    assert h.wait(120) and h.failure is None and h.codes is not None
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(2 * tokens, generator=g)[:tokens].to(torch.int64)
    seconds = []
    for _ in range(3):
        rows = codes.alloc(tokens)
        h.write_staged(codes.writer, rows, tokens)
        seconds.append(timed_load(codes, rows, slots))
    assert codes.writer.stats["host_dequant"] == 0 and writer.host_dequant_tokens == 0
    rk, rv = writer.read(slots)
    wk = np.concatenate([r[0] for r in ref], axis=1)
    wv = np.concatenate([r[1] for r in ref], axis=1)
    for got, want in ((rk, wk), (rv, wv)):
        if kind != "quant_deflate":  # float32 summation order: at most one bf16 step
            g32, w32 = quant.to_f32(got, lay.dtype), quant.to_f32(want, lay.dtype)
            assert np.all(np.abs(g32 - w32) <= np.abs(w32) * 2.0**-7 + 1e-6)
        else:
            assert np.array_equal(got, want)
    plain = staging(False)  # the same KV as plain rows: the zero-copy H2D + scatter rate
    plain_s = []
    for _ in range(3):
        rows = plain.alloc(tokens)
        plain.writer.write(wk, wv, rows)
        plain_s.append(timed_load(plain, rows, slots))
    kv_bytes = tokens * lay.bytes_per_token()
    load, h2d = kv_bytes / min(seconds) / 1e9, kv_bytes / min(plain_s) / 1e9
    gpu_metrics[f"linker_device_decode_{kind}_gbps"] = round(load, 2)
    gpu_metrics[f"linker_zero_copy_kv_{kind}_gbps"] = round(h2d, 2)
    gpu_metrics[f"linker_device_decode_{kind}_over_zero_copy"] = round(load / h2d, 3)
    be.close()
    client.close()
