"""Fetch backend over the DPU data plane (``sgl_remote_kv.fetch.dpu_client.client.DpuClient``).

Unlike the in-process backend, this one is *direct*: the caller (the waiting_for_KV queue, on the
scheduler thread) reserves the destination staging rows (``kvpool/staged.py``) before submitting, and the
DPU client's receiver thread writes finished layers straight into them through the staging's
``KVWriter`` (a failed write fails the round's chunks: never a hit). The handle then only
reports how many leading chunks made it (``ok_chunks``); chunks past the first failure are misses and
their rows are freed by the caller.

Layer-wise (``--remote-kv-layerwise``): the data plane copies each round's verified blobs into the
shared region and the client keeps host copies, so the handle becomes ``verified`` (every chunk fetched
and parsed, on both sides) while layers are still decoding; ``layer_ready(l)`` is then true once layer
``l`` of every chunk has been written into the rows. ``layerwise.py`` admits the request at
``verified`` and decodes from ``blobs`` itself if the data plane fails afterwards (``broken()``).

Threads: ``submit``/``cancel``/handle reads on the scheduler thread (and the forward thread, for
``layer_ready``/``broken``/``blobs`` of an admitted layer-wise install); the DPU client's receiver thread
updates the underlying handle under its own lock. Buffers: the reserved rows belong to the caller
until it stages them or frees them; the DPU client writes them only until the handle is finished or
cancelled.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex

import torch

from sgl_remote_kv.fetch.base import FetchHandle

logger = logging.getLogger(__name__)


class DpuFetchHandle(FetchHandle):
    """Adapter: our ``FetchHandle`` view of a ``dpu_client.jobs.ClientFetch``."""

    direct = True  # the KV lands in the caller's rows (written by the client's receiver thread)
    decoded_here = False  # the data plane decodes: its time is part of ``fetch_s``

    def __init__(
        self,
        client,
        inner,
        start_token: int,
        chunk_size: int,
        bytes_per_token: int,
        tokens: list[int] | None = None,
    ) -> None:
        self._client, self._inner = client, inner
        self._fb, self._fs = 0, 0.0  # fetched bytes / seconds, once done
        super().__init__(inner.request_id, inner.num_chunks, start_token, chunk_size, tokens)
        self._bytes_per_token = bytes_per_token
        self.verified = inner.verified  # set by the client's receiver thread

    # The inner handle owns the blob copies; until ``done()`` the fetch size/time are those at
    # verification (what a layer-wise admission reports).
    blobs = property(lambda self: self._inner.blobs if self.verified.is_set() else None, lambda s, v: None)
    headers = property(
        lambda self: self._inner.headers if self.verified.is_set() else None, lambda s, v: None
    )

    @property
    def fetched_bytes(self) -> int:
        return self._fb if self._done.is_set() else self._inner.verified_bytes

    @fetched_bytes.setter
    def fetched_bytes(self, value: int) -> None:
        self._fb = value

    @property
    def fetch_s(self) -> float:
        return self._fs if self._done.is_set() else self._inner.verified_s

    @fetch_s.setter
    def fetch_s(self, value: float) -> None:
        self._fs = value

    def broken(self) -> bool:
        """A chunk failed, or the fetch was cancelled / lost: some layer may never arrive."""
        return self.cancelled or self._inner.cancelled or self._inner.hit_chunks_now() < self.n_chunks

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
        self.finished_at = self._inner.t_done or None
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
        """``layer`` of every chunk is in the rows."""
        return self._inner.layer_ready[layer] >= self.n_chunks


class DpuFetchBackend:
    direct = True
    tails = True  # a job's chunks may have different token counts (tail sub-chunks)

    def __init__(self, client, kv_writer, chunk_size: int, on_done=None) -> None:
        self.client = client
        self.kv_writer = kv_writer
        self.chunk_size = chunk_size
        self._on_done = on_done

    def queue_depth(self) -> int:
        st = self.client.stats()
        return int(st.get("pending_rounds", 0)) + int(st.get("inflight_rounds", 0))

    def submit(
        self,
        request_id: str,
        keys: list[bytes],
        start_token: int,
        rows: torch.Tensor,
        tokens: list[int] | None = None,
    ) -> FetchHandle:
        from sgl_remote_kv.fetch.dpu_client.jobs import KVTarget

        target = KVTarget(self.kv_writer, rows.to("cpu", torch.int64))  # host copy, on this thread
        inner = self.client.submit(
            request_id, list(keys), list(tokens) if tokens else self.chunk_size, target
        )
        bpt = self.client.layout.bytes_per_token()
        return DpuFetchHandle(self.client, inner, start_token, self.chunk_size, bpt, tokens)

    def close(self) -> None:
        self.client.close()


def start_dpu_backend(
    config, fingerprint, codec, kv_writer, on_done=None, on_store_error=None, on_restart=None, on_write=None
) -> DpuFetchBackend | None:
    """Spawn the data plane, or attach to the service at ``config.dpu_endpoint``; ``None`` (with a warning)
    if it cannot start or refuses this client -- the caller falls back.
    ``on_store_error(op, kind, n)``: the data plane's store client failures (per failed chunk);
    ``on_restart(reason)``: the data plane was replaced (``exited`` / ``hung``) or, attached, a reconnect
    (``hung`` / ``restarted``); ``on_write(seconds, layers, output)``: the client's receiver thread wrote fetched
    layers into the staging rows."""
    try:
        from sgl_remote_kv.contract.settings import DataPlaneSettings
        from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
        from sgl_remote_kv.fetch.dpu_client.link import resolved

        # --remote-kv-dpu-args (validated by config) and --remote-kv-dpu-cpus (empty: auto = None)
        flags = shlex.split(config.dpu_args)
        spec = DataPlaneSettings.from_flags(flags, cpus=tuple(config.dpu_cpus) or None)
        # --remote-kv-dpu-endpoint: attach to the host's data-plane service (its endpoint's secret is the
        # tier's --remote-kv-auth-key-file); else spawn a private data plane with the settings above
        key_file = config.auth_key_file if config.dpu_endpoint else ""
        cfg = DpuClientConfig(
            store_url=config.resolved_store_url(),
            process=spec,
            endpoint=config.dpu_endpoint,
            auth_key_file=key_file,
            output=config.dpu_output,
        )
        if config.layerwise:  # host copies of verified blobs: compressed size <= decoded size here
            cfg = dataclasses.replace(cfg, blob_slot_bytes=cfg.dest_slot_bytes)
        client = DpuClient(
            cfg,
            fingerprint,
            codec,
            on_event=on_done,
            on_store_error=on_store_error,
            on_restart=on_restart,
            on_write=on_write,
        )
        client.start()
    except Exception as e:  # boundary: a missing/broken data plane means the in-process path
        logger.warning("DPU data plane unavailable (%r); using the in-process fetch path", e)
        return None
    if config.dpu_endpoint:  # the service has its own settings
        logger.info("DPU data plane attached to %s (pid %s)", config.dpu_endpoint, client.pid)
    else:
        logger.info("DPU data plane started (pid %s; %s)", client.pid, resolved(spec).describe_workers())
    return DpuFetchBackend(client, kv_writer, config.chunk_size, on_done)
