"""What staging rows hold: whatever each fetch path delivered, in one byte arena (``arena.py``).

``RowStore`` is the fetch paths' destination (``StagedPages.writer``): the ``KVWriter`` calls a path
makes (``write``, ``write_quantized``, ``write_quantized_layers``) with staging *rows* where a pool
writer takes slots. Each call becomes one *record* in the arena:

- **plain**: K and V ``[n_layers, T, H, D]`` in the layout's storage dtype (NVDEC frames, the lossless
  codec, the data plane's ``kv`` output, and, on a host pool, the host decode of codes);
- **codes** (``keep_codes``, set when the pool's writer dequantizes on the device): one layer of ``T``
  tokens as the codec's lossless-stage views (``quant.LayerView`` / ``transform.TransformView``, one per
  chunk, in token order) with every array copied into the arena. Nothing is dequantized on the host: the
  load hands the views to the pool's writer (``KVWriter.write_quantized``), which uploads them and
  dequantizes on the device.

Each (layer, row) cell names the record holding it and the token position in it; a later write of a
cell supersedes the earlier one. A record's bytes return to the arena once no cell names it (its rows
freed or overwritten). ``windows`` gives a load, per layer, the runs of its rows that are consecutive
tokens of one record: each run is one contiguous plain slice (uploaded from where it lies) or one
window of a codes record.

Arena: allocated once (``nbytes``); a device pool's writer pins it in place (``register_host``). A write
that does not fit raises ``KVWriteError``: its chunks are misses, as for any failed write.

Threads: writes from any fetch thread, ``windows`` from the load thread; one lock guards the tables and
the arena, and the copy into a new record runs outside it (no cell names the record until it is done).
A record is immutable once published; a reader holds pinned rows, which nothing rewrites.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgl_remote_kv.types import KVLayout, numpy_storage_dtype

from .arena import Arena, align
from .writer import KVWriteError, dequant_views


@dataclass
class Record:
    """One write: plain (``k``/``v`` ``[n, T, H, D]``) or codes (``views`` of layer ``layer_lo``)."""

    layer_lo: int
    n_layers: int
    tokens: int
    start: int  # arena extent
    nbytes: int
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    views: tuple | None = None
    cells: int = 0  # (layer, row) cells that name this record

    @property
    def is_codes(self) -> bool:
        return self.views is not None


class RowStore:
    """See module docstring."""

    def __init__(self, layout: KVLayout, rows: int, nbytes: int, keep_codes: bool = False) -> None:
        self.layout, self.rows, self.keep_codes = layout, rows, keep_codes
        self.device_dequant = keep_codes  # what fetch paths ask a writer: stage codes, not KV
        self.storage = numpy_storage_dtype(layout.dtype)
        self.arena = Arena(nbytes)
        self._owner = np.full((layout.num_layers, rows), -1, np.int64)  # record id per (layer, row)
        self._pos = np.zeros((layout.num_layers, rows), np.int64)  # token position within that record
        self._records: dict[int, Record] = {}
        self._next = 0
        self._lock = threading.Lock()
        # tokens x layers staged as codes / as KV, and of the KV how much the host dequantized from codes
        self.stats = {"codes": 0, "kv": 0, "host_dequant": 0, "full": 0}

    @property
    def bytes_per_token(self) -> float:
        return self.arena.nbytes / self.rows

    # -- the writer calls of the fetch paths ----------------------------------------------------------
    def write(self, k: np.ndarray, v: np.ndarray, rows: torch.Tensor, layer_lo: int = 0) -> None:
        """Plain KV ``[n, T, H, D]`` of layers ``layer_lo..`` into ``rows``. Raises ``KVWriteError``."""
        idx = self._rows(rows)
        lay = self.layout
        if k.ndim != 4 or k.shape != v.shape or k.shape[2:] != (lay.num_kv_heads, lay.head_dim):
            raise KVWriteError(f"KV source shapes {k.shape}/{v.shape} do not match the layout {lay}")
        if k.dtype != self.storage or v.dtype != self.storage or k.shape[1] != len(idx):
            raise KVWriteError(f"{k.shape[1]} tokens of {k.dtype} for {len(idx)} rows of {self.storage}")
        n = k.shape[0]
        self._check_layers(layer_lo, n)
        rec, buf = self._new(2 * k.nbytes, layer_lo, n, len(idx))
        rec.k = buf[: k.nbytes].view(self.storage).reshape(k.shape)
        rec.v = buf[k.nbytes :].view(self.storage).reshape(k.shape)
        rec.k[...], rec.v[...] = k, v
        self._publish(rec, idx, "kv")

    def write_quantized(self, views: Sequence, rows: torch.Tensor, layer: int) -> None:
        """One layer of consecutive chunks as their codes views: kept (``keep_codes``), or dequantized here
        into a plain record. Raises ``KVWriteError``."""
        idx = self._rows(rows)
        t = sum(vw.tokens for vw in views)
        if t != len(idx) or not views:
            raise KVWriteError(f"{len(idx)} rows for {t} quantized tokens of layer {layer}")
        self._check_layers(layer, 1)
        if not self.keep_codes:
            return self._dequant(views, idx, layer)
        arrays = [
            (i, name, a)
            for i, vw in enumerate(views)
            for name in _field_names(type(vw))
            if _array(a := getattr(vw, name))
        ]
        rec, buf = self._new(sum(align(a.nbytes) for _, _, a in arrays), layer, 1, t)
        copied: list[dict] = [{} for _ in views]
        o = 0
        for i, name, a in arrays:
            dst = buf[o : o + a.nbytes].view(a.dtype).reshape(a.shape)
            dst[...] = a
            copied[i][name] = dst
            o += align(a.nbytes)
        rec.views = tuple(dataclasses.replace(vw, **c) for vw, c in zip(views, copied, strict=True))
        self._publish(rec, idx, "codes")

    def write_quantized_layers(self, views_by_layer: Sequence[Sequence], rows: torch.Tensor) -> None:
        for layer, views in enumerate(views_by_layer):
            self.write_quantized(views, rows, layer)

    def _dequant(self, views: Sequence, idx: np.ndarray, layer: int) -> None:
        lay, t = self.layout, len(idx)
        shape = (1, t, lay.num_kv_heads, lay.head_dim)
        nb = int(np.prod(shape)) * self.storage.itemsize
        rec, buf = self._new(2 * nb, layer, 1, t)
        rec.k = buf[:nb].view(self.storage).reshape(shape)
        rec.v = buf[nb:].view(self.storage).reshape(shape)
        try:
            dequant_views(views, lay.dtype, rec.k[0], rec.v[0])
        except Exception as e:  # a failed decode is a failed write: its chunks are misses
            with self._lock:
                self.arena.free(rec.start, rec.nbytes)
            raise KVWriteError(f"host dequant of layer {layer} failed: {e!r}") from e
        self._publish(rec, idx, "kv", "host_dequant")

    # KVWriter's reader calls: staging is host memory, written synchronously
    def wait_layer(self, layer: int) -> None:
        return None

    def fence(self) -> None:
        return None

    def register_host(self, array: np.ndarray) -> None:
        return None

    def unregister_host(self, array: np.ndarray) -> None:
        return None

    # -- the load ---------------------------------------------------------------------------------------
    def windows(self, rows: np.ndarray, layer: int) -> list[tuple[Record, int, int, int]]:
        """``layer`` of ``rows`` (pinned) as runs ``(record, a, b, i)``: ``rows[i : i + b - a]`` are the
        record's tokens ``a..b``. Raises ``KVWriteError`` if a row's layer was never written."""
        with self._lock:
            own, pos = self._owner[layer, rows], self._pos[layer, rows]
            if len(rows) and int(own.min()) < 0:
                raise KVWriteError(f"layer {layer} of a staged row holds no KV")
            cut = np.flatnonzero((own[1:] != own[:-1]) | (pos[1:] != pos[:-1] + 1)) + 1
            starts, ends = [0, *cut.tolist()], [*cut.tolist(), len(rows)]
            return [
                (self._records[int(own[s])], int(pos[s]), int(pos[s]) + e - s, s)
                for s, e in zip(starts, ends, strict=True)
                if e > s
            ]

    def release(self, rows: np.ndarray) -> None:
        """``rows`` return to the free list: the records they named lose those cells."""
        with self._lock:
            self._drop(self._owner[:, rows])
            self._owner[:, rows] = -1

    # -- internals --------------------------------------------------------------------------------------
    def _rows(self, rows: torch.Tensor) -> np.ndarray:
        idx = rows.to("cpu", torch.int64).numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        if idx.ndim != 1 or (len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.rows)):
            raise KVWriteError(f"staging rows outside 0..{self.rows}")
        return idx

    def _check_layers(self, layer_lo: int, n: int) -> None:
        if layer_lo < 0 or layer_lo + n > self.layout.num_layers:
            raise KVWriteError(
                f"layers {layer_lo}..{layer_lo + n} outside the model's {self.layout.num_layers}"
            )

    def _new(self, nbytes: int, layer_lo: int, n_layers: int, tokens: int) -> tuple[Record, np.ndarray]:
        with self._lock:
            start = self.arena.alloc(nbytes)
        if start is None:
            with self._lock:
                self.stats["full"] += 1
            raise KVWriteError(
                f"staging arena full: {nbytes} bytes wanted, {self.arena.nbytes - self.arena.used} of "
                f"{self.arena.nbytes} free (--remote-kv-staging-tokens)"
            )
        return Record(layer_lo, n_layers, tokens, start, nbytes), self.arena.view(start, nbytes)

    def _publish(self, rec: Record, idx: np.ndarray, *counted: str) -> None:
        """``rec`` (its bytes written) names the cells of its layers x ``idx``; ``counted``: the stats it adds
        its tokens x layers to."""
        layers = slice(rec.layer_lo, rec.layer_lo + rec.n_layers)
        with self._lock:
            for name in counted:
                self.stats[name] += rec.n_layers * len(idx)
            rid = self._next
            self._next += 1
            self._records[rid] = rec
            self._drop(self._owner[layers, idx])
            self._owner[layers, idx] = rid
            self._pos[layers, idx] = np.arange(len(idx))
            rec.cells = rec.n_layers * len(idx)

    def _drop(self, owners: np.ndarray) -> None:
        """Lock held: the cells ``owners`` (record ids, -1 none) stop naming their records."""
        ids, counts = np.unique(owners[owners >= 0], return_counts=True)
        for rid, n in zip(ids.tolist(), counts.tolist(), strict=True):
            rec = self._records[rid]
            rec.cells -= n
            if rec.cells <= 0:
                del self._records[rid]
                self.arena.free(rec.start, rec.nbytes)


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    """A view class's fields in declaration order: the order its arrays take in a record (and the order the
    device writer uploads them in, so a record's arrays go H2D in one copy)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _array(a) -> bool:
    return isinstance(a, np.ndarray) and a.size > 0
