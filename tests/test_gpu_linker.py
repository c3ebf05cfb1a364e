"""GPU suite (``pytest -m gpu``; ``scripts/gpu_check.sh``): the linker's load into a real SGLang
``MHATokenToKVPool`` on ``cuda``, the path of every remote hit (``sglang_glue/linker.py``).

Staged host rows (pinned, as the linker allocates them on a GPU host) are copied layer by layer on a load
thread through the pool's device KV writer (``StagedPages.copy_out``), while the reading thread takes each
layer through the pool's ``get_key_buffer``/``get_value_buffer``, which wait on the registered layer
counter (``FencedCounter``: SGLang's ``LayerWiseLoadCounter`` plus a stream wait on the write's event), as
attention does in a forward pass: every layer read is bit-exact, and rows not loaded stay untouched.

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
    staged = StagedPages(lay, rows=4 * TOKENS, page_size=PAGE, pin_memory=True)
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
