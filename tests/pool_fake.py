"""A stand-in for the slice of SGLang's ``MHATokenToKVPool`` that the fetch backends and the
layer-transfer counter touch (per-layer K/V buffers, ``register_layer_transfer_counter``,
``get_key_buffer`` waiting for its layer). Not a mock of behaviour under test: the code under test
writes real tensors and the tests read them back."""

from __future__ import annotations

import torch

from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.types import KVLayout


class FakeKVPool:
    def __init__(self, layout: KVLayout, slots: int, dtype: torch.dtype = torch.float32) -> None:
        shape = (slots, layout.num_kv_heads, layout.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)]
        self.layer_transfer_counter = None
        self.writer = writer_for(PoolTensors(self.k_buffer, self.v_buffer), layout)  # the pool's KVWriter

    def register_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counter = counter

    def get_key_buffer(self, layer_id: int):
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)
        return self.k_buffer[layer_id]


def attach_installs(pool, kv_writer, fingerprint, metrics):
    """A ``LayerwiseInstalls`` over ``kv_writer`` whose ``wait_until`` the pool's readers call: the
    linker's load thread does the same before it copies a layer (``linker.RemoteKVLinker``); here the
    reader stands in for it, so the installs are tested without a linker."""
    from sgl_remote_kv.fetch.layerwise import LayerwiseInstalls

    counter = LayerwiseInstalls(kv_writer, fingerprint, metrics)
    pool.register_layer_transfer_counter(counter)
    return counter
