"""Embedded directory store: one file per key, no server, safe for several processes on one host.

Layout under ``root``::

    objects/<2 hex>/<64 hex>      one blob per key (key = hex of the 32-byte digest)
    tmp/<unique>.part             in-flight writes
    evict.lock                    flock'd by the process that is evicting

Publish after full write: a value is written to ``tmp/`` and ``os.replace``d into ``objects/``.
``rename(2)`` within one filesystem is atomic, so a reader opens either the old complete file, the new
complete file, or nothing; a failed write deletes its temp file and publishes nothing. A reader that
opened a file keeps reading it even if another process replaces or evicts it (POSIX unlink semantics).
Temp files of crashed writers are removed after an hour.

LRU under a size cap: a hit touches the file's mtime, so mtime is the last access time. When the bytes
this process believes are stored exceed ``max_bytes`` (and at most every ``rescan_s`` seconds
otherwise, to account for other processes' writes), it rescans the directory under a non-blocking
``flock`` and deletes least recently used files until usage is below ``low_water * max_bytes``.

No fsync by default (``fsync=1`` to enable): this is a cache; after a power loss a zero-length or
truncated file is possible on some filesystems, and ``client.StoreClient`` detects it by checksum.

URL: ``file:///abs/path?max_bytes=10G&fsync=0`` or a plain path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .base import KEY_BYTES, Counters, StoreStats, check_keys, redact_url, url_options

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 20 * 1024**3
_STALE_TMP_S = 3600.0
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """``"512M"`` / ``"10G"`` / ``"12345"`` -> bytes."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    number = t[: len(t) - len(unit)]
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"bad size {text!r}") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


class LocalStore:
    """Directory-backed ``KVStore``. Thread-safe; several processes may share one ``root``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        low_water: float = 0.9,
        rescan_s: float = 5.0,
        fsync: bool = False,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.low_water = low_water
        self.rescan_s = rescan_s
        self.fsync = fsync
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._objects.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._counters = Counters("local")
        self._lock = threading.Lock()
        self._approx_bytes = 0
        self._last_scan = 0.0
        self._evict_lock_path = self.root / "evict.lock"
        self._maybe_evict(force=True)

    # -- paths ---------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self._objects / h[:2] / h

    # -- KVStore -------------------------------------------------------------------------------
    def count_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._counters.timed("count_prefix"):
            n = 0
            for k in keys:
                if not self._path(k).is_file():
                    break
                n += 1
        self._counters.add(hits=n, misses=int(n < len(keys)))
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        out: list[bytes | None] = []
        with self._counters.timed("get_many"):
            for k in keys:
                out.append(self._read(self._path(k)))
        hits = sum(v is not None for v in out)
        nbytes = sum(len(v) for v in out if v is not None)
        self._counters.add(hits=hits, misses=len(out) - hits, bytes_read=nbytes)
        return out

    def _read(self, path: Path) -> bytes | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)  # LRU: mtime = last access (best effort)
        except OSError:
            # evicted/replaced meanwhile, or a read-only filesystem (EROFS): we already hold the complete
            # content; only the LRU order loses this touch.
            pass
        return data

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Write each value to a temp file, then rename it into place (atomic publish per key).

        Values are only read during the call. On failure the temp file is removed and the exception
        propagates; keys published before the failure stay (each is complete).
        """
        check_keys([k for k, _ in items])
        written = 0
        with self._counters.timed("put_many"):
            for key, value in items:
                self._write(self._path(key), value)
                written += len(value)
        self._counters.add(bytes_written=written, keys_written=len(items))
        with self._lock:
            self._approx_bytes += written
        self._maybe_evict()

    def _write(self, path: Path, value: bytes | bytearray | memoryview) -> None:
        tmp = self._tmp / f"{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.replace(tmp, path)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def delete_many(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        n = 0
        for k in keys:
            try:
                self._path(k).unlink()
                n += 1
            except FileNotFoundError:
                pass
        self._counters.add(keys_deleted=n)

    def scan(self, batch: int = 512) -> Iterator[list[bytes]]:
        """Every stored key, in batches (admin walks; not the serving path). Keys written meanwhile may
        or may not appear; no key appears twice."""
        out: list[bytes] = []
        for sub in sorted(os.scandir(self._objects), key=lambda e: e.name):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                name = e.name
                if len(name) == 2 * KEY_BYTES and all(ch in "0123456789abcdef" for ch in name):
                    out.append(bytes.fromhex(name))
                    if len(out) >= batch:
                        yield out
                        out = []
        if out:
            yield out

    def stats(self) -> StoreStats:
        with self._lock:
            approx = self._approx_bytes
        return self._counters.snapshot(extra={"bytes_stored_approx": approx, "max_bytes": self.max_bytes})

    def close(self) -> None:
        pass

    # -- eviction ------------------------------------------------------------------------------
    def usage_bytes(self) -> int:
        """Exact bytes of published blobs (a directory scan)."""
        return sum(size for _, size, _ in self._scan())

    def _scan(self) -> list[tuple[float, int, str]]:
        entries = []
        for sub in os.scandir(self._objects):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, e.path))
        return entries

    def _maybe_evict(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            due = now - self._last_scan >= self.rescan_s
            if not (force or due or self._approx_bytes > self.max_bytes):
                return
            self._last_scan = now
        with open(self._evict_lock_path, "a+b") as lockf:
            try:
                fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another process is evicting right now
            try:
                self._evict_locked()
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)

    def _evict_locked(self) -> None:
        entries = self._scan()
        total = sum(size for _, size, _ in entries)
        freed = removed = 0
        if total > self.max_bytes:
            target = int(self.low_water * self.max_bytes)
            entries.sort()  # oldest access first
            for _, size, path in entries:
                if total - freed <= target:
                    break
                try:
                    os.unlink(path)
                    freed += size
                    removed += 1
                except FileNotFoundError:
                    pass
            self._counters.add(keys_evicted=removed, bytes_evicted=freed, eviction_runs=1)
            log.debug("local store %s: evicted %d bytes (%d -> %d)", self.root, freed, total, total - freed)
        with self._lock:
            self._approx_bytes = total - freed
        self._remove_stale_tmp()

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        for e in os.scandir(self._tmp):
            try:
                if e.stat().st_mtime < cutoff:
                    os.unlink(e.path)
            except FileNotFoundError:
                pass


def open_local(url: str) -> LocalStore:
    """Factory for ``file://`` URLs and plain paths."""
    opts = url_options(url)
    if "://" in url:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"store URL {redact_url(url)!r}: file:// URLs must be local (file:///abs/path)")
        path = unquote(parts.path)
    else:
        path = url.split("?", 1)[0]
    if not path:
        raise ValueError(f"store URL {redact_url(url)!r}: missing path")
    known = {"max_bytes", "low_water", "rescan_s", "fsync"}
    unknown = set(opts) - known
    if unknown:
        raise ValueError(
            f"store URL {redact_url(url)!r}: unknown options {sorted(unknown)} (known: {sorted(known)})"
        )
    return LocalStore(
        Path(path).expanduser(),
        max_bytes=parse_size(opts["max_bytes"]) if "max_bytes" in opts else DEFAULT_MAX_BYTES,
        low_water=float(opts.get("low_water", 0.9)),
        rescan_s=float(opts.get("rescan_s", 5.0)),
        fsync=opts.get("fsync", "0").lower() in ("1", "true", "yes"),
    )
