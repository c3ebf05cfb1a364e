"""What the data plane checks before it accepts a client's message: registrations, submitted jobs, codecs.

Everything here either returns what the message names (a model fingerprint, a codec, attached regions, a
checked destination) or raises ``ValueError`` with a reason the client is told; nothing here touches
the server's sockets or tables. The server thread (``server.py``, its tables ``clients.py`` and
``jobs.py``) is the only caller.

``Codecs`` caches one codec object per (name, params) and warms each (codec, model) up once per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from sgl_remote_kv.codec.base import codec_from_params
from sgl_remote_kv.codec.errors import ChunkError
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.contract.sizing import layer_bytes
from sgl_remote_kv.types import KVLayout, ModelFingerprint

from .buffers import DestRegion

logger = logging.getLogger(__name__)


def fingerprint(w: P.Fingerprint) -> ModelFingerprint:
    """The model fingerprint a wire ``Fingerprint`` names; ``ValueError`` if its digest does not match."""
    layout = KVLayout(w.layout.num_layers, w.layout.num_kv_heads, w.layout.head_dim, w.layout.dtype)
    fp = ModelFingerprint(w.architecture, layout, w.weights_id, w.tp_rank, w.tp_size)
    if fp.digest() != w.digest:
        raise ValueError("fingerprint digest does not match its fields")
    return fp


class Codecs:
    """Codec objects by (name, canonical params), built on first use; server thread only."""

    def __init__(self) -> None:
        self._codecs: dict[tuple[str, bytes], object] = {}
        self._warmed: set[tuple[str, bytes, bytes]] = set()

    def get(self, name: str, params: bytes):
        key = (name, params)
        if key not in self._codecs:
            self._codecs[key] = codec_from_params(name, params)
        return self._codecs[key]

    def warm(self, codec, name: str, params: bytes, fp: ModelFingerprint) -> float | None:
        """Warm ``codec`` up for ``fp`` once per process (at start, or on a client's first registration:
        the first registration of a model waits for it); the seconds it took (the caller's log line says
        so), None when it was warm already or failed. A failure is logged and costs only the first job's
        latency."""
        key = (name, params, fp.digest())
        if key in self._warmed:
            return None
        self._warmed.add(key)
        t0 = time.perf_counter()
        try:
            codec.warm_up(fp)
        except (ValueError, KeyError, ChunkError) as e:  # e.g. no tables for this model
            logger.warning("warm-up of codec %s failed (%r); the first job loads its kernels", name, e)
            return None
        return time.perf_counter() - t0


def attach_regions(
    names: list[str], held: dict[str, str], inherited: Mapping[str, int] | None = None
) -> dict[str, DestRegion]:
    """Map a registration's destination regions: ``inherited`` ones (name -> descriptor our spawning host
    passed down) by their descriptor, the others by name under /dev/shm; ``held``: region name -> label
    of the client that has it registered. All or nothing: on ``ValueError`` nothing stays mapped."""
    if len(set(names)) != len(names):
        raise ValueError("a region is named twice")
    regions: dict[str, DestRegion] = {}
    try:
        for name in names:
            if not shm_names.is_region_name(name):
                raise ValueError(f"{name!r} is not a destination region name (srkv-dpu-<pid>-<start>-<hex>)")
            if name in held:
                raise ValueError(f"destination region {name!r} is registered by client {held[name]!r}")
            try:
                fd = (inherited or {}).get(name)
                regions[name] = DestRegion.attach(name) if fd is None else DestRegion.inherited(name, fd)
            except FileNotFoundError:
                raise ValueError(f"destination region {name!r} does not exist") from None
            except OSError as e:
                raise ValueError(f"destination region {name!r}: {e.strerror or e}") from None
    except ValueError:
        for r in regions.values():
            r.close()
        raise
    return regions


def check_submit(
    msg: P.SubmitFetch, regions: dict[str, DestRegion], fp: ModelFingerprint, codec_key: tuple[str, bytes]
) -> DestRegion:
    """Check a job against its client's registration (``regions``, model ``fp``, ``codec_key``): the
    destination region is the client's, and the blob area and every chunk's layers lie inside it.
    Returns the destination region."""
    region = regions.get(msg.dest_name)
    if region is None:
        raise ValueError(f"unknown destination {msg.dest_name!r} (not registered by this client)")
    if msg.blob_off + msg.blob_cap > region.size:
        raise ValueError("blob area outside the destination region")
    if fingerprint(msg.fingerprint).digest() != fp.digest():
        raise ValueError("fingerprint differs from the client's registration")
    if (msg.codec, msg.codec_params) != codec_key:
        raise ValueError("codec differs from the client's registration")
    layout = fp.layout
    for c in msg.chunks:
        lb = layer_bytes(layout, c.tokens)
        if msg.output == "codes":  # one area of ``layer_stride`` bytes per layer from ``k_off``
            bad = c.k_off + layout.num_layers * c.layer_stride > region.size or c.layer_stride < 2 * lb
        else:
            end = lb + (layout.num_layers - 1) * c.layer_stride
            bad = max(c.k_off, c.v_off) + end > region.size or c.layer_stride < lb
        if bad:
            raise ValueError("chunk destination outside the destination region")
    return region
