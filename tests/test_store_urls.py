"""Store URL parsing, the registry and the default embedded store URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_remote_kv import env
from sgl_remote_kv.store.base import default_store_url, open_store
from sgl_remote_kv.store.faulty import FaultConfig, FaultyStore
from sgl_remote_kv.store.local import LocalStore, parse_size


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("s3://bucket/x", "unknown scheme 's3'"),
        ("redis://", "missing host"),
        ("redis://:6379/0", "missing host"),
        ("redis://localhost:notaport/0", "bad port"),
        ("redis://localhost:70000/0", "bad port"),
        ("redis://localhost:6379/abc", "bad database"),
        ("redis://a:1,b:2/0", "one host"),
        ("redis://localhost:6379/0?bogus=1", "unknown options"),
        ("redis+cluster://", "missing host"),
        ("redis+cluster://127.0.0.1:7000,:7001", "missing host"),
        ("redis+cluster://127.0.0.1:7000,127.0.0.1:x", "bad port"),
        ("file://otherhost/tmp/x", "must be local"),
        ("file:///tmp/x?max_bytes=lots", "bad size"),
        ("file:///tmp/x?colour=red", "unknown options"),
        ("faulty+file:///tmp/x?error_rate=2", "error_rate"),
    ],
)
def test_bad_urls_give_one_clear_value_error(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        open_store(url)


def test_default_store_url_is_embedded_store_under_cache_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "cache"))
    url = default_store_url()
    assert url == (tmp_path / "cache" / "store").as_uri()
    for s in (open_store(None), open_store(""), open_store(url)):
        assert isinstance(s, LocalStore)
        assert s.root == tmp_path / "cache" / "store"


def test_plain_path_and_file_url_open_the_same_store(tmp_path) -> None:
    a = open_store(str(tmp_path / "s"))
    b = open_store(f"file://{tmp_path / 's'}?max_bytes=1G&fsync=1")
    assert isinstance(a, LocalStore) and isinstance(b, LocalStore)
    assert a.root == b.root == Path(tmp_path / "s")
    assert b.max_bytes == 1024**3 and b.fsync
    key = bytes(32)
    a.put_many([(key, b"v")])
    assert b.get_many([key]) == [b"v"]


def test_faulty_url_splits_fault_and_inner_options(tmp_path) -> None:
    s = open_store(f"faulty+file://{tmp_path / 's'}?error_rate=0.25&seed=7&max_bytes=5M&down=1")
    assert isinstance(s, FaultyStore)
    assert s.faults == FaultConfig(error_rate=0.25, seed=7, down=True)
    assert isinstance(s.inner, LocalStore) and s.inner.max_bytes == 5 * 1024**2


@pytest.mark.parametrize(
    ("text", "n"), [("512", 512), ("4k", 4096), ("1.5M", 1572864), ("2GiB", 2 * 1024**3)]
)
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:1/0", "redis://:***@h:1/0"),
        ("redis://tenant:hunter2@h:1/0?timeout=1", "redis://tenant:***@h:1/0?timeout=1"),
        ("redis+cluster://u:hunter2@h1:1,h2:2", "redis+cluster://u:***@h1:1,h2:2"),
        ("auth+redis://:hunter2@h/0?key_file=/k", "auth+redis://:***@h/0?key_file=/k"),
        ("file:///x", "file:///x"),
    ],
)
def test_store_url_passwords_never_shown(url: str, shown: str) -> None:
    from sgl_remote_kv.store.base import redact_url

    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url", ["redis://:hunter2@h:99999/0", "redis://u:hunter2@h:1/x", "redis://:hunter2@h:1/0?bogus=1"]
)
def test_bad_url_errors_hide_the_password(url: str) -> None:
    with pytest.raises(ValueError) as e:
        open_store(url)
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


def test_faulty_link_gbps_paces_gets_and_a_control_file_changes_it_at_runtime(tmp_path) -> None:
    """`link_gbps` makes returned bytes cross an emulated link of that rate; `control=` re-reads faults."""
    import json
    import os
    import time

    control = tmp_path / "faults.json"
    s = open_store(f"faulty+file://{tmp_path / 's'}?link_gbps=0.08&control={control}")  # 10 MB/s
    assert s.faults.link_gbps == 0.08
    key, value = bytes(32), bytes(500_000)
    s.put_many([(key, value)])  # puts are not shaped
    t0 = time.monotonic()
    assert s.get_many([key]) == [value]
    assert time.monotonic() - t0 >= 0.05  # 0.5 MB at 10 MB/s
    control.write_text(json.dumps({"link_gbps": 0}))
    t0 = time.monotonic()
    assert s.get_many([key]) == [value]
    assert time.monotonic() - t0 < 0.04 and s.faults.link_gbps == 0
    control.write_text(json.dumps({"bogus": 1}))
    os.utime(control, ns=(1, 1))  # a new mtime: re-read, refused, the faults in force stay
    s.get_many([key])
    assert s.faults.link_gbps == 0
    with pytest.raises(ValueError, match="link_gbps"):
        FaultConfig(link_gbps=-1)
