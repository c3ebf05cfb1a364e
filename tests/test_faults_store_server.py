"""Store-side faults that need their own server (slow: one server start each, ~2-3 min on the box).

- embedded store (``file://``) on a small tmpfs: disk full (write-backs fail, reads still serve),
  read-only remount (same), then recovery once space / write access is back;
(Redis Cluster node loss: ``test_faults_cluster_server.py``.)

Same contract as ``test_faults_server.py``: exact tokens vs. cold recompute, server healthy, failure
counted, full remote hits once the fault clears.
"""

from __future__ import annotations

import contextlib
import subprocess

import pytest

from tests.fixtures.faults import (
    CHUNK,
    ask,
    failures,
    gen,
    healthy,
    make_case,
    metric,
    prime,
    wait_for,
    wait_full_hit,
)
from tests.fixtures.remote_kv_server import flush_cache, remote_kv_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@contextlib.contextmanager
def tmpfs(path, size_mb: int):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path) -> None:
    """Fill the filesystem to the last byte (dd stops at ENOSPC)."""
    subprocess.run(["dd", "if=/dev/zero", f"of={path / 'filler'}", "bs=1M"], capture_output=True, check=False)


def _remount(path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


@pytest.fixture(scope="module")
def mnt(tmp_path_factory):
    with tmpfs(tmp_path_factory.mktemp("embedded") / "mnt", 96) as m:
        yield m


@pytest.fixture(scope="module")
def embedded(model_dir, mnt, tok):
    """A server on the tmpfs store, plus a case stored while the disk was healthy."""
    with remote_kv_server(model_dir, f"file://{mnt / 'store'}") as srv:
        yield srv, prime(srv, make_case(tok, "embedded-served"))


def _cold(srv, case):
    flush_cache(srv)
    case.ref = gen(srv, case.ids)["output_ids"]
    return case


def test_embedded_store_disk_full(embedded, mnt, tok):
    srv, served = embedded
    _fill(mnt)
    try:
        before = failures(srv)
        full = _cold(srv, make_case(tok, "embedded-full"))
        wait_for(lambda: failures(srv) > before, 60, what="write-back failure on a full disk")
        assert metric(srv, "failures", kind="writeback:store") > 0
        _, hit = ask(srv, served)  # what is stored keeps being served
        assert hit == served.chunks * CHUNK
    finally:
        (mnt / "filler").unlink()
    assert wait_full_hit(srv, full, timeout=120) == full.chunks * CHUNK
    assert healthy(srv)


def test_embedded_store_read_only_write_backs_fail_counted_then_recover(embedded, mnt, tok):
    srv, _ = embedded
    _remount(mnt, "ro")
    try:
        before = failures(srv)
        ro = _cold(srv, make_case(tok, "embedded-ro"))
        wait_for(lambda: failures(srv) > before, 60, what="write-back failure on a read-only store")
        assert healthy(srv)
    finally:
        _remount(mnt, "rw")
    assert wait_full_hit(srv, ro, timeout=120) == ro.chunks * CHUNK


def test_embedded_store_read_only_still_serves_stored_chunks(embedded, mnt):
    srv, served = embedded
    _remount(mnt, "ro")
    try:
        _, hit = ask(srv, served)
        assert hit == served.chunks * CHUNK
    finally:
        _remount(mnt, "rw")
