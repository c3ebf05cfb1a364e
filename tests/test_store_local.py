"""Embedded directory store: LRU eviction under a cap, atomic publish, multi-process safety."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from sgl_remote_kv.store.local import LocalStore


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_lru_eviction_keeps_recently_read_entries(tmp_path) -> None:
    s = LocalStore(tmp_path, max_bytes=1_000_000, low_water=0.9, rescan_s=3600)
    blob = b"x" * 100_000
    for i in range(10):
        s.put_many([(key(i), blob)])
        time.sleep(0.01)  # distinct mtimes
    assert s.usage_bytes() == 1_000_000
    assert s.get_many([key(0)]) == [blob]  # touch: key 0 becomes most recently used
    time.sleep(0.01)
    s.put_many([(key(i), blob) for i in range(10, 13)])
    present = [i for i in range(13) if s.get_many([key(i)])[0] is not None]
    # 1.3 MB > cap: the 4 least recently used (1..4) go, leaving 0.9 MB <= 0.9 * cap
    assert present == [0, 5, 6, 7, 8, 9, 10, 11, 12]
    assert s.usage_bytes() <= 0.9 * 1_000_000
    assert s.stats().extra["keys_evicted"] == 4 and s.stats().extra["bytes_evicted"] == 400_000


def test_cap_holds_with_several_writers_sharing_a_directory(tmp_path) -> None:
    a = LocalStore(tmp_path, max_bytes=500_000, rescan_s=0)
    b = LocalStore(tmp_path, max_bytes=500_000, rescan_s=0)
    for i in range(20):
        (a if i % 2 else b).put_many([(key(i), b"y" * 50_000)])
        assert a.usage_bytes() <= 500_000
    assert a.count_prefix([key(19)]) == 1  # the newest entry survives


def test_failed_write_publishes_nothing_and_leaves_no_temp_file(tmp_path) -> None:
    s = LocalStore(tmp_path)
    with pytest.raises(TypeError):
        s.put_many([(key(1), b"complete"), (key(2), object())])  # type: ignore[list-item]
    assert s.get_many([key(1), key(2)]) == [b"complete", None]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_stale_temp_files_of_crashed_writers_are_removed(tmp_path) -> None:
    LocalStore(tmp_path)
    stale, fresh = tmp_path / "tmp" / "dead.part", tmp_path / "tmp" / "live.part"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    LocalStore(tmp_path)  # opening scans
    assert not stale.exists() and fresh.exists()


WORKER = r"""
import json, sys, time
from sgl_remote_kv.store.local import LocalStore
root, wid, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
values = {w: bytes([w]) * (300_000 + 7919 * w) for w in range(1, 5)}
keys = [i.to_bytes(32, "big") for i in range(6)]
s = LocalStore(root, max_bytes=10**9)
bad = reads = writes = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    s.put_many([(k, values[wid]) for k in keys[wid % 2 :: 2]])
    writes += 1
    for v in s.get_many(keys):
        if v is not None:
            reads += 1
            bad += v not in values.values()
print(json.dumps({"bad": bad, "reads": reads, "writes": writes}))
"""


def test_several_processes_write_and_read_same_keys_without_partial_reads(tmp_path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path), str(w), "3"], stdout=subprocess.PIPE, text=True
        )
        for w in range(1, 5)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        results.append(json.loads(out))
    assert sum(r["bad"] for r in results) == 0
    assert all(r["writes"] > 5 and r["reads"] > 20 for r in results)
    assert list((tmp_path / "tmp").iterdir()) == []  # no leftover temp files
