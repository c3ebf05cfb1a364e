"""Staged pages: fetched KV (or its codes) held in host memory until SGLang's linker loads it into the pool.

The linker integration (``sglang_glue/linker.py``) never writes fetched KV into slots SGLang has not
handed it: SGLang allocates a request's slots only in the linker's ``load``, after ``lookup`` promised the
pages. So every fetch path writes into *rows* of this host area instead (through ``writer``, a
``rows.RowStore``: the ``KVWriter`` calls, with rows for slots), the admission queue ``stage``s the rows
under SGLang's page hashes, ``leading`` answers ``lookup`` from memory alone, and ``pin`` + ``copy_out``
feed the per-layer load. On a device pool whose writer dequantizes (``KVWriter.device_dequant``) the rows
hold codes, not KV: the load uploads them and the pool's writer decodes on the device.

Ownership: rows are the queue's from ``alloc`` until ``stage`` (or ``free``); a staged entry owns its rows
until the last ``Pin`` on it is released, then they return to the free list. A page hash indexes at most
one entry (a second staging of the same page keeps the first); ``forget`` unindexes everything (a tier
flush) while pinned rows stay valid until released.

Threads: any thread (one lock guards the index, the pins and the free list). The KV in a row is written
by the one fetch the rows were reserved for, before ``stage``; loads read it only through a pin.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sgl_remote_kv.types import KVLayout

from .rows import RowStore


@dataclass
class Pin:
    """Pages held for a reader: ``rows`` are their KV rows, page after page. ``release`` once."""

    entries: tuple[int, ...]
    rows: torch.Tensor
    released: bool = field(default=False, repr=False)


@dataclass
class _Entry:
    rows: torch.Tensor
    hashes: list[str]
    refs: int = 1


class StagedPages:
    """See module docstring. ``keep_codes``: rows keep codes for the pool's writer to dequantize on the
    device (``rows.RowStore``); ``nbytes``: the arena's size (default: every row's KV in the storage
    dtype, enough for any mix of writes)."""

    def __init__(
        self, layout: KVLayout, rows: int, page_size: int, keep_codes: bool = False, nbytes: int | None = None
    ) -> None:
        if rows <= 0 or page_size <= 0:
            raise ValueError(f"staging needs rows > 0 and page_size > 0, got {rows}, {page_size}")
        self.layout, self.page, self.capacity = layout, page_size, rows
        nbytes = rows * layout.bytes_per_token() if nbytes is None else nbytes
        self.writer = RowStore(layout, rows, nbytes, keep_codes)  # the fetch paths' destination
        self._lock = threading.Lock()
        self._free = list(range(rows - 1, -1, -1))
        self._index: dict[str, tuple[int, int]] = {}  # page hash -> (entry id, page within the entry)
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()

    # -- rows (the admission queue) ----------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        with self._lock:
            if n > len(self._free):
                return None
            got = self._free[len(self._free) - n :]
            del self._free[len(self._free) - n :]
        return torch.tensor(got[::-1], dtype=torch.int64)

    def free(self, rows: torch.Tensor | None) -> None:
        if rows is not None and rows.numel():
            self.writer.release(rows.numpy())
            with self._lock:
                self._free.extend(rows.tolist())

    def stage(self, hashes: list[str], rows: torch.Tensor) -> Pin:
        """``rows`` hold the KV of consecutive pages named ``hashes`` (a trailing partial page is owned
        but not indexed). Returns the stager's pin on the new entry."""
        if len(rows) < len(hashes) * self.page:
            raise ValueError(f"{len(rows)} rows for {len(hashes)} pages of {self.page}")
        with self._lock:
            eid = next(self._ids)
            self._entries[eid] = _Entry(rows, list(hashes))
            for i, h in enumerate(hashes):
                self._index.setdefault(h, (eid, i))
        return Pin((eid,), rows[: len(hashes) * self.page])

    # -- pages (lookup and load) ---------------------------------------------------------------------
    def leading(self, hashes: list[str]) -> int:
        """How many of ``hashes``, from the first, are staged."""
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n] in self._index:
                n += 1
            return n

    def pin(self, hashes: list[str]) -> Pin | None:
        """Hold the pages ``hashes`` (all staged) for a reader; None if one of them is not."""
        p = self.page
        with self._lock:
            where = [self._index.get(h) for h in hashes]
            if any(w is None for w in where):
                return None
            ids = tuple(dict.fromkeys(eid for eid, _ in where))
            for eid in ids:
                self._entries[eid].refs += 1
            parts = [self._entries[eid].rows[i * p : (i + 1) * p] for eid, i in where]
        return Pin(ids, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))

    def release(self, pin: Pin | None) -> None:
        if pin is None or pin.released:
            return
        pin.released = True
        with self._lock:
            for eid in pin.entries:
                e = self._entries[eid]
                e.refs -= 1
                if e.refs == 0:
                    del self._entries[eid]
                    for h in e.hashes:
                        if self._index.get(h, (None,))[0] == eid:
                            del self._index[h]
                    self.writer.release(e.rows.numpy())
                    self._free.extend(e.rows.tolist())

    def forget(self) -> None:
        """Unindex every page (nothing new can be pinned); pinned rows stay until released."""
        with self._lock:
            self._index.clear()

    def copy_out(
        self,
        batch: Sequence[tuple[Pin, torch.Tensor]],
        writer,
        on_layer: Callable[[int], None],
        ready: Callable[[int], None] | None = None,
    ) -> None:
        """Layer by layer, each pin's pages into its pool slots (``[(pin, slots)]``) through ``writer`` (the
        pool's ``KVWriter``: a layer is complete when it returns); ``ready(layer)`` first (returns once the
        layer is in the rows: layer-wise installs still decoding into them), ``on_layer(layer)`` after.
        Each run of rows that are consecutive tokens of one staged record is one write: a contiguous slice
        of plain KV (``write``) or a token window of codes (``write_quantized``, dequantized by the pool's
        writer); runs of codes records that continue one another (a record's end, the next one's start, the
        same kind of view) go in one write. Raises ``KVWriteError`` (and whatever ``ready`` raises)."""
        batch = [(pin.rows.numpy(), slots.to("cpu", torch.int64)) for pin, slots in batch]
        for layer in range(self.layout.num_layers):
            if ready is not None:
                ready(layer)
            for rows, slots in batch:
                for rec, a, b, i in _joined(self.writer.windows(rows, layer)):
                    s = slots[i : i + b - a]
                    if isinstance(rec, list):  # codes views of one or more records
                        writer.write_quantized(rec, s, layer, window=(a, b))
                    else:
                        j = layer - rec.layer_lo
                        writer.write(rec.k[j : j + 1, a:b], rec.v[j : j + 1, a:b], s, layer_lo=layer)
            on_layer(layer)


def _joined(runs):
    """``RowStore.windows`` runs with consecutive codes runs joined: ``(views, a, b, i)`` for codes (``a..b``
    within the joined views' tokens), ``(record, a, b, i)`` for plain KV. Codes runs join when the first ends
    its record, the next starts its own, the rows follow on and the views are of one kind."""
    out: list = []
    end = False  # the last codes entry ends at its last record's end
    for rec, a, b, i in runs:
        if not rec.is_codes:
            out.append((rec, a, b, i))
            end = False
            continue
        last = out[-1] if out else None
        if (
            end
            and a == 0
            and isinstance(last[0], list)
            and last[3] + last[2] - last[1] == i
            and type(last[0][0]) is type(rec.views[0])
        ):
            out[-1] = (last[0] + list(rec.views), last[1], last[2] + b, last[3])
        else:
            out.append((list(rec.views), a, b, i))
        end = b == rec.tokens
    return out


@dataclass(frozen=True)
class StagingPlan:
    """What staging rows hold and the arena's bytes per row (token)."""

    keep_codes: bool
    bytes_per_token: int
    reasons: tuple[str, ...]  # why rows hold KV, not codes (empty when every path stages codes)


def codes_bytes_per_token(layout: KVLayout) -> int:
    """Arena bytes a token's codes take at most, all layers, as the quantized and transform codecs stage
    them: 1 byte per value for K and V, room for escapes and outlier channels on 1/32 of the values (2
    bytes each), per-head float32 scales for K and V, and the 64-byte alignment of a chunk's arrays."""
    c = layout.num_kv_heads * layout.head_dim
    return layout.num_layers * (2 * c + c // 8 + 8 * layout.num_kv_heads + 8)


def staging_plan(layout: KVLayout, device_dequant: bool, codec, plain: Sequence[str]) -> StagingPlan:
    """Rows hold codes when the pool's writer dequantizes on the device (``KVWriter.device_dequant``) and
    the codec has a device stage; the arena is sized for codes only if no path writes KV (``plain``: one
    reason per path that does), for KV otherwise (any mix then fits)."""
    kv = layout.bytes_per_token()
    if not device_dequant:
        return StagingPlan(
            False, kv, ("the KV pool is in host memory: fetched chunks are decoded on the host",)
        )
    if not codec.device_dequant:
        return StagingPlan(False, kv, tuple(plain))
    return StagingPlan(True, kv if plain else min(kv, codes_bytes_per_token(layout)), tuple(plain))
