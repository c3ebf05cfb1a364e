"""``sgl-remote-kv-admin`` against real stores (an embedded file store, a real redis-server) filled with
real chunk blobs and every kind of bad value; one warm-up through a real server.

What must hold: ``stats`` counts chunks, tokens, bytes and ages per model / codec / tenant exactly;
``verify`` finds exactly the bad values (corrupt frame, truncated, bad header, bad layer CRC, foreign,
bad MAC), never flags a generation marker (current or legacy) or a version-1 chunk, and ``--delete``
removes only them; ``evict`` selects by fingerprint, tenant, shared namespace and age (AND), and never
takes an untagged version-1 chunk for a shared or timed one; every backend lists its keys (file, auth+,
redis, redis cluster); ``--json`` parses; errors are one line, exit 2,
the password redacted; ``warm`` makes the first request of a restarted server a remote hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sgl_remote_kv.admin import cli, scan
from sgl_remote_kv.admin.scan import ValueKind
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.store.base import open_store
from sgl_remote_kv.store.framing import frame
from sgl_remote_kv.store.keys import GENERATION_MAGIC, tenant_salt, tenant_tag
from sgl_remote_kv.store.security import seal
from sgl_remote_kv.types import KVLayout, ModelFingerprint

pytest_plugins = ["fixtures.redis_servers"]

LAYOUT = KVLayout(4, 2, 16, "float32")
FP_A = ModelFingerprint("A", LAYOUT, "a" * 16)
FP_B = ModelFingerprint("B", LAYOUT, "b" * 16)
T = 16  # tokens per chunk
NOW = time.time()
DAY = 86400
N = 15  # values that ``fill`` stores


def _blob(codec: str, fp: ModelFingerprint, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    k, v = (
        rng.standard_normal((LAYOUT.num_layers, T, LAYOUT.num_kv_heads, LAYOUT.head_dim), dtype=np.float32)
        for _ in range(2)
    )
    return get_codec(codec).encode(k, v, fp)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _v1(key: bytes, payload: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack("<4sBxxxQI", b"SRKV", 1, len(payload), zlib.crc32(payload, zlib.crc32(key))) + payload


def fill(store, seal_with: bytes | None = None) -> dict[str, list[bytes]]:
    """The test population; returns keys by what they are."""
    t1 = tenant_tag(tenant_salt("t1", None))
    items, kinds = [], {"good": [], "bad": [], "generation": []}

    def put(i: int, value: bytes, kind: str) -> None:
        items.append((_key(i), value))
        kinds[kind].append(_key(i))

    for i in range(3):  # model A, lossless, shared, written now
        put(i, frame(_key(i), _blob("lossless", FP_A, i), written_at=int(NOW)), "good")
    for i in range(3, 5):  # model A, quant_deflate, tenant t1, 10 days old
        put(i, frame(_key(i), _blob("quant_deflate", FP_A, i), t1, written_at=int(NOW - 10 * DAY)), "good")
    put(5, frame(_key(5), _blob("lossless", FP_B, 5), written_at=int(NOW - 2 * DAY)), "good")  # model B
    put(6, _v1(_key(6), _blob("lossless", FP_B, 6)), "good")  # an old-format frame: still a chunk
    put(7, frame(_key(7), GENERATION_MAGIC + os.urandom(16)), "generation")
    bad = bytearray(frame(_key(8), _blob("lossless", FP_A, 8)))
    bad[-5] ^= 1
    put(8, bytes(bad), "bad")  # corrupt frame
    put(9, frame(_key(9), _blob("lossless", FP_A, 9))[:-10], "bad")  # truncated
    put(10, frame(_key(10), b"hello, not a chunk"), "bad")  # foreign
    blob = bytearray(_blob("lossless", FP_A, 11))
    blob[-3] ^= 1  # inside the last layer's section: only its layer CRC sees it
    put(11, frame(_key(11), bytes(blob)), "bad")
    blob = bytearray(_blob("lossless", FP_A, 12))
    blob[10] ^= 1  # in the fixed header: the header CRC fails
    put(12, frame(_key(12), bytes(blob)), "bad")
    put(13, frame(_key(99), _blob("lossless", FP_A, 13)), "bad")  # another key's value
    put(14, _v1(_key(14), os.urandom(16)), "generation")  # as releases before the SKVG magic wrote it
    if seal_with is not None:
        items = [(k, seal(seal_with, k, v)) for k, v in items]
    store.put_many(items)
    return kinds


@pytest.fixture()
def file_store(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    s = open_store(url)
    kinds = fill(s)
    s.close()
    return url, kinds


def _entries(url: str, deep: bool = True):
    adm = scan.open_admin(url)
    try:
        return {e.key: e for e in scan.walk(adm, deep=deep)}
    finally:
        adm.close()


def test_every_value_is_classified(file_store):
    url, kinds = file_store
    e = _entries(url)
    assert len(e) == N
    assert {e[k].kind for k in kinds["good"]} == {ValueKind.CHUNK, ValueKind.V1_CHUNK}
    assert e[_key(7)].kind is ValueKind.GENERATION and e[_key(14)].kind is ValueKind.GENERATION
    assert [e[_key(i)].kind for i in (8, 9, 10, 11, 12, 13)] == [
        ValueKind.CORRUPT_FRAME,
        ValueKind.CORRUPT_FRAME,
        ValueKind.FOREIGN,
        ValueKind.BAD_LAYER_CRC,
        ValueKind.BAD_HEADER,
        ValueKind.CORRUPT_FRAME,
    ]
    assert e[_key(3)].tenant == tenant_tag(tenant_salt("t1", None)).hex() and e[_key(0)].tenant == "shared"
    v1 = e[_key(6)]  # a version-1 frame carries no time and no tenant tag
    assert v1.kind is ValueKind.V1_CHUNK and v1.written_at is None and v1.tenant == "untagged"


def test_stats_counts_exactly(file_store):
    url, _ = file_store
    report = cli.stats(list(_entries(url, deep=False).values()), NOW)
    # stats reads headers only: the value with a bad layer CRC counts as a chunk here (verify finds it)
    assert report["values"] == N
    assert report["by_kind"] == {
        "chunk": 7,
        "v1_chunk": 1,
        "generation": 2,
        "corrupt_frame": 3,
        "foreign": 1,
        "bad_header": 1,
    }
    groups = {(g["fingerprint"], g["codec"], g["tenant"]): g for g in report["groups"]}
    a = FP_A.digest().hex()[:16]
    shared_a = groups[(a, "lossless", "shared")]
    assert shared_a["chunks"] == 4 and shared_a["tokens"] == 4 * T  # 0, 1, 2 and 11 (by its header)
    assert shared_a["raw_bytes"] == 4 * T * LAYOUT.bytes_per_token()
    assert shared_a["ratio"] == pytest.approx(shared_a["raw_bytes"] / shared_a["stored_bytes"], abs=1e-3)
    t1 = groups[(a, "quant_deflate", tenant_tag(tenant_salt("t1", None)).hex())]
    assert t1["chunks"] == 2 and t1["oldest_s"] == pytest.approx(10 * DAY, abs=5) and t1["ratio"] > 1.5
    b_shared, b_v1 = (groups[(FP_B.digest().hex()[:16], "lossless", t)] for t in ("shared", "untagged"))
    assert b_shared["chunks"] == 1 and b_shared["oldest_s"] == pytest.approx(2 * DAY, abs=5)
    assert b_v1["chunks"] == 1 and b_v1["oldest_s"] is None and b_v1["tokens"] == T
    assert len(groups) == 4


def test_verify_finds_and_deletes_exactly_the_bad_values(file_store, capsys):
    url, kinds = file_store
    assert cli.main(["verify", "--store", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {bytes.fromhex(f["key"]) for f in report["failures"]} == set(kinds["bad"])
    assert cli.main(["verify", "--store", url, "--delete"]) == 0
    left = _entries(url)
    assert set(left) == set(kinds["good"]) | set(kinds["generation"])
    assert cli.main(["verify", "--store", url]) == 0


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--tenant", "t1"], {3, 4}),
        (["--tenant", "t2"], set()),
        (["--shared"], {0, 1, 2, 5, 11}),  # 6 is untagged (version 1): its tenant is unknown
        (["--older-than", "1d"], {3, 4, 5}),
        (["--shared", "--older-than", "1d"], {5}),  # 6 has no time: never evicted by age
        (["--fingerprint", FP_A.digest().hex()[:10]], {0, 1, 2, 3, 4, 11}),  # 11: a chunk by its header
        (["--fingerprint", FP_A.digest().hex()[:10], "--older-than", "7d"], {3, 4}),
    ],
)
def test_evict_selects_by_model_tenant_and_age(file_store, flags, expect, capsys):
    url, kinds = file_store
    assert cli.main(["evict", "--store", url, *flags, "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["matched"] == len(expect)
    assert len(_entries(url)) == N  # dry run
    assert cli.main(["evict", "--store", url, *flags]) == 0
    gone = {i for i in range(N) if _key(i) not in _entries(url)}
    assert gone == expect


def test_verify_delete_spares_a_value_rewritten_since_the_walk(file_store):
    url, kinds = file_store
    s = open_store(url)
    s.put_many([(_key(8), frame(_key(8), _blob("lossless", FP_A, 8)))])  # a server rewrote it meanwhile
    s.close()
    adm = scan.open_admin(url)
    try:
        cli._delete(adm, kinds["bad"], recheck=True)
    finally:
        adm.close()
    assert set(_entries(url)) == set(kinds["good"]) | set(kinds["generation"]) | {_key(8)}


def test_bad_mac_values_on_an_authenticated_store(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k" * 64)
    url = f"auth+file://{tmp_path / 'store'}?auth_key_file={key_file}"
    s = open_store(f"file://{tmp_path / 'store'}")
    kinds = fill(s, seal_with=b"k" * 64)
    s.put_many([(_key(50), seal(b"x" * 64, _key(50), frame(_key(50), _blob("lossless", FP_A, 50))))])
    s.close()
    e = _entries(url)
    assert e[_key(50)].kind is ValueKind.BAD_MAC
    assert {e[k].kind for k in kinds["good"]} == {ValueKind.CHUNK, ValueKind.V1_CHUNK}
    auth = open_store(url)  # the wrapper lists its inner store's keys
    assert sorted(k for batch in auth.scan(4) for k in batch) == sorted(e)
    auth.close()


def test_redis_store_and_the_console_script(redis_server):
    url = redis_server.url + "?prefix=admintest:"
    s = open_store(url)
    kinds = fill(s)
    s.close()
    script = Path(sys.executable).with_name("sgl-remote-kv-admin")
    out = subprocess.run(
        [str(script), "stats", "--store", url, "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["values"] == N
    assert report["by_kind"]["chunk"] + report["by_kind"]["v1_chunk"] == len(kinds["good"]) + 1  # + 11
    assert cli.main(["verify", "--store", url, "--delete"]) == 0
    assert set(_entries(url)) == set(kinds["good"]) | set(kinds["generation"])


def test_redis_cluster_lists_the_keys_of_every_primary(redis_cluster):
    url = redis_cluster.url + "?prefix=admintest:"
    s = open_store(url)
    kinds = fill(s)
    s.close()
    e = _entries(url)
    assert len(e) == N and {e[k].kind for k in kinds["bad"]} <= {k for k in ValueKind if k.failed}


def test_errors_are_one_line_with_the_password_redacted(tmp_path, capsys):
    assert cli.main(["stats", "--store", "redis://admin:hunter2@127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and err.count("\n") == 1 and "Traceback" not in err
    assert cli.main(["stats", "--store", f"file://{tmp_path / 'nothing'}"]) == 2
    assert "no store" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()
    assert cli.main(["evict", "--store", f"file://{tmp_path}", "--older-than", "soon"]) == 2
