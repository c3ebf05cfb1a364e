"""Fetch backend over the DPU data plane (``sgl_remote_kv.control.dpu_client.DpuClient``).

Unlike the in-process backend, this one is *direct*: the caller (the waiting_for_KV queue, on the
scheduler thread) reserves the destination KV slots in SGLang's pool before submitting, and the DPU
client's receiver thread scatters each finished layer straight into them. The handle then only
reports how many leading chunks made it (``ok_chunks``); chunks past the first failure are misses and
their slots are freed by the caller.

Threads: ``submit``/``cancel``/handle reads on the scheduler thread; the DPU client's receiver thread
updates the underlying handle under its own lock. Buffers: the reserved slots belong to the caller
until it inserts them into the radix tree or frees them; the data plane writes them only until the
handle is finished or cancelled.
"""

from __future__ import annotations

import logging

import torch

from sgl_remote_kv.sglang_glue.fetch import FetchHandle

logger = logging.getLogger(__name__)


class DpuFetchHandle(FetchHandle):
    """Adapter: our ``FetchHandle`` view of a ``control.jobs.FetchHandle``."""

    def __init__(self, client, inner, start_token: int, chunk_size: int, bytes_per_token: int) -> None:
        super().__init__(inner.request_id, inner.num_chunks, start_token, chunk_size)
        self._client, self._inner = client, inner
        self._bytes_per_token = bytes_per_token

    def done(self) -> bool:
        if self._done.is_set():
            return True
        res = self._inner.result()
        if res is None:
            return False
        self.ok_chunks = res.hit_chunks
        if res.failures:
            self.failure = res.failures[min(res.failures)]
        elif self.cancelled:
            self.failure = "cancelled"
        self.fetch_s = res.elapsed_s
        # Compressed bytes of the hit chunks, from the data plane's per-chunk ChunkDone.wire_bytes.
        self.fetched_bytes = int(getattr(res, "wire_bytes", 0))
        self.decoded_bytes = self.ok_tokens * self._bytes_per_token
        self.layers_ready = self.ok_chunks and self._inner.num_layers
        self._done.set()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        self._inner.wait(timeout)
        return self.done()

    def cancel(self) -> None:
        super().cancel()
        self._client.cancel(self._inner)

    def layer_ready(self, layer: int) -> bool:
        return self._inner.layer_ready[layer] >= self._inner.first_fail


class DpuFetchBackend:
    direct = True

    def __init__(self, client, kvcache, chunk_size: int, on_done=None) -> None:
        self.client = client
        self.kvcache = kvcache
        self.chunk_size = chunk_size
        self._on_done = on_done

    def queue_depth(self) -> int:
        st = self.client.stats()
        return int(st.get("pending_rounds", 0)) + int(st.get("inflight_rounds", 0))

    def submit(
        self, request_id: str, keys: list[bytes], start_token: int, slots: torch.Tensor
    ) -> FetchHandle:
        from sgl_remote_kv.control.scatter import KVPoolTarget

        target = KVPoolTarget(self.kvcache.k_buffer, self.kvcache.v_buffer, slots.to(torch.int64))
        inner = self.client.submit(request_id, list(keys), self.chunk_size, target)
        bpt = self.client.layout.bytes_per_token()
        return DpuFetchHandle(self.client, inner, start_token, self.chunk_size, bpt)

    def close(self) -> None:
        self.client.close()


def start_dpu_backend(config, fingerprint, codec, kvcache, on_done=None) -> DpuFetchBackend | None:
    """Spawn the data plane; ``None`` (with a warning) if it cannot start — the caller falls back."""
    try:
        from sgl_remote_kv.control.dpu_client import DpuClient, DpuClientConfig
        from sgl_remote_kv.control.dpu_process import ProcessSpec

        spec = ProcessSpec(cpus=tuple(config.dpu_cpus) or None)  # --remote-kv-dpu-cpus; None = auto
        cfg = DpuClientConfig(store_url=config.resolved_store_url(), process=spec)
        client = DpuClient(cfg, fingerprint, codec)
        client.start()
    except Exception as e:  # boundary: a missing/broken data plane means the in-process path
        logger.warning("DPU data plane unavailable (%r); using the in-process fetch path", e)
        return None
    logger.info("DPU data plane started (pid %s)", client.pid)
    return DpuFetchBackend(client, kvcache, config.chunk_size, on_done)
