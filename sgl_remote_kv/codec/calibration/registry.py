"""One process-wide registry of content-addressed codec artifacts: the transform codec's calibrations
(``__init__.py``) and ``quant_rans``'s entropy tables (``tables.py``) both use it.

An artifact has a 16-byte id (a hash of its content) and lives in a directory of ``<id>.npz`` files under
the cache (``env.cache_dir() / subdir``). ``load_dir`` registers every valid file of a directory, oldest
first (so the newest-registered is the newest file), once per directory unless ``force``; a file that
does not load is logged and skipped. ``get`` finds an artifact by its full id or by a unique prefix of it.

Threads: every method may be called from any thread; one lock guards the table.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(
        self,
        what: str,
        subdir: str,
        load: Callable[[Path], T],
        ident: Callable[[T], bytes],
        errors: tuple[type[Exception], ...],
    ) -> None:
        """``load(path)`` reads one file, raising one of ``errors`` for a bad one; ``ident`` gives an
        artifact's id; ``what`` names the kind in log lines."""
        self.what, self.subdir, self._load, self._ident, self._errors = what, subdir, load, ident, errors
        self._lock = threading.Lock()
        self._by_id: dict[bytes, T] = {}
        self._loaded_dirs: set[Path] = set()

    def default_dir(self) -> Path:
        from sgl_remote_kv import env

        return env.cache_dir() / self.subdir

    def register(self, item: T) -> bytes:
        ident = self._ident(item)
        with self._lock:
            self._by_id[ident] = item
        return ident

    def unregister(self, ident: bytes) -> None:
        with self._lock:
            self._by_id.pop(bytes(ident), None)

    def load_dir(self, directory: str | Path | None = None, *, force: bool = False) -> int:
        """Register every valid file of ``directory`` (default ``default_dir()``); how many."""
        d = Path(directory) if directory else self.default_dir()
        with self._lock:
            if d in self._loaded_dirs and not force:
                return 0
            self._loaded_dirs.add(d)
        n = 0
        for p in sorted(d.glob("*.npz"), key=lambda f: (f.stat().st_mtime, f.name)) if d.is_dir() else []:
            try:
                self.register(self._load(p))
                n += 1
            except self._errors as e:
                logger.warning("skipping %s file: %s", self.what, e)
        return n

    def items(self) -> list[T]:
        """Every registered artifact, in registration order."""
        with self._lock:
            return list(self._by_id.values())

    def get(self, ident: bytes) -> T | None:
        """By full id, or by a prefix that only one registered id has."""
        ident = bytes(ident)
        with self._lock:
            if ident in self._by_id:
                return self._by_id[ident]
            hits = [item for i, item in self._by_id.items() if i[: len(ident)] == ident]
        return hits[0] if len(hits) == 1 else None
