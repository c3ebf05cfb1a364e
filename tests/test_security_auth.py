"""Authenticated values (``sgl_remote_kv/store/security.py``): a store others can write to cannot poison
answers. Real embedded store, real client, real fetch backend; the "attacker" writes the inner store
directly (no secret)."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from benchmarks import synthetic_kv as synthetic
from sgl_remote_kv.codec.base import get_codec
from sgl_remote_kv.codec.format import CRC, FIXED, crc32
from sgl_remote_kv.config import RemoteKVConfig
from sgl_remote_kv.fetch.inproc import InProcessFetchBackend
from sgl_remote_kv.store.base import open_store
from sgl_remote_kv.store.client import ClientConfig, StoreClient
from sgl_remote_kv.store.framing import frame, unframe
from sgl_remote_kv.store.local import LocalStore
from sgl_remote_kv.store.security import (
    MAC_LEN,
    AuthenticatedStore,
    AuthKeyError,
    auth_store_url,
    load_auth_key,
    seal,
    split_auth_url,
    unseal,
)

SECRET = bytes(range(32))
CHUNK = 32


@pytest.fixture
def key_file(tmp_path):
    p = tmp_path / "srkv.key"
    p.write_text(SECRET.hex() + "\n")
    p.chmod(0o600)
    return p


def _chunks(fp, n: int, seed: int = 0):
    k, v = synthetic.kv(fp.layout, n * CHUNK, seed=seed)
    codec = get_codec("lossless")
    blobs = [
        codec.encode(
            np.ascontiguousarray(k[:, i * CHUNK : (i + 1) * CHUNK]),
            np.ascontiguousarray(v[:, i * CHUNK : (i + 1) * CHUNK]),
            fp,
        )
        for i in range(n)
    ]
    return codec, k, v, blobs


def test_key_file_formats_and_errors(tmp_path, key_file):
    assert load_auth_key(key_file) == SECRET
    raw = tmp_path / "raw.key"
    raw.write_bytes(b"\x00\xff" * 12)
    assert load_auth_key(raw) == b"\x00\xff" * 12
    short = tmp_path / "short.key"
    short.write_text("abcd")
    big = tmp_path / "big.key"
    big.write_bytes(b"k" * 5000)
    cases = {
        tmp_path / "missing.key": "No such file",
        short: "need >= 16",
        big: "max 4096",
        tmp_path: "regular",
    }
    for path, msg in cases.items():
        with pytest.raises(AuthKeyError, match=msg) as e:
            load_auth_key(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_seal_binds_value_to_its_key():
    blob = seal(SECRET, b"a" * 32, b"payload")
    assert unseal(SECRET, b"a" * 32, blob) == b"payload"
    assert unseal(SECRET, b"b" * 32, blob) is None  # replay under another key
    assert unseal(b"x" * 32, b"a" * 32, blob) is None  # another secret
    assert unseal(SECRET, b"a" * 32, blob[:-1]) is None
    assert unseal(SECRET, b"a" * 32, blob[:10]) is None
    tampered = bytearray(blob)
    tampered[0] ^= 1
    assert unseal(SECRET, b"a" * 32, bytes(tampered)) is None


def _reseal_crafted(blob: bytes) -> bytes:
    """An attacker's edit that keeps every CRC valid: flip a payload byte, recompute the checksums."""
    from tests.test_security_fuzz import _reseal

    b = bytearray(blob)
    header_len = FIXED.unpack_from(b, 0)[11]
    b[header_len + (len(b) - header_len) // 2] ^= 0x01
    out = _reseal(b)
    assert CRC.unpack_from(out, header_len - CRC.size)[0] == crc32(bytes(out[: header_len - CRC.size]))
    return bytes(out)


def _poison(local, keys, blobs, source: int, target: int, authenticated: bool) -> None:
    """Replay chunk ``source`` under key ``target``. The client's framing CRC covers the key but is
    public, so the attacker re-frames; with auth they can only reuse the MAC stored for ``source``."""
    forged = frame(keys[target], blobs[source])
    if authenticated:
        forged += local.get_many([keys[source]])[0][-MAC_LEN:]
    local.put_many([(keys[target], forged)])


@pytest.mark.parametrize("authenticated", [False, True], ids=["no-secret", "with-secret"])
def test_replayed_and_crafted_values_are_served_only_without_the_secret(tmp_path, authenticated):
    """Without the MAC a replayed valid chunk is served as a hit (wrong KV: the threat); with it, the
    same replay and a CRC-resealed tamper are misses, and honest chunks before them decode exactly."""
    fp = synthetic.fingerprint(num_layers=3, dtype="float32")
    codec, k, v, blobs = _chunks(fp, 4)
    local = LocalStore(tmp_path / "s")
    inner = AuthenticatedStore(local, SECRET) if authenticated else local
    client = StoreClient(inner, ClientConfig(negative_ttl_s=0.0))
    backend = InProcessFetchBackend(client, codec, fp, CHUNK)
    keys = [bytes([i]) * 32 for i in range(4)]
    try:
        assert client.put_many(list(zip(keys, blobs, strict=True))) == 4
        _poison(local, keys, blobs, 0, 2, authenticated)  # attacker: raw access to the backing store
        h = backend.submit("replay", keys, 0)
        assert h.wait(30)
        if not authenticated:
            assert h.ok_chunks == 4  # poisoned: chunk 2 holds chunk 0's KV
            assert not np.array_equal(h.k[:, 2 * CHUNK : 3 * CHUNK], k[:, 2 * CHUNK : 3 * CHUNK])
            return
        assert h.ok_chunks == 2, h.failure
        assert np.array_equal(h.k[:, : 2 * CHUNK], k[:, : 2 * CHUNK])
        # An unauthenticated writer with a well-formed, CRC-consistent blob: still a miss.
        local.put_many([(keys[1], frame(keys[1], _reseal_crafted(blobs[1])))])
        h2 = backend.submit("crafted", keys, 0)
        assert h2.wait(30)
        assert h2.ok_chunks == 1
        assert inner.stats().extra["auth_rejected"] >= 2
    finally:
        backend.close()
        client.close()


def test_auth_url_round_trip_and_open_store(tmp_path, key_file):
    url = auth_store_url(f"file://{tmp_path / 's'}?max_bytes=1G", str(key_file))
    inner, kf = split_auth_url(url)
    assert kf == str(key_file) and inner == f"file://{tmp_path / 's'}?max_bytes=1G"
    store = open_store(url)
    assert isinstance(store, AuthenticatedStore)
    store.put_many([(b"k" * 32, b"v")])
    assert store.get_many([b"k" * 32]) == [b"v"]
    assert LocalStore(tmp_path / "s").get_many([b"k" * 32])[0] != b"v"  # sealed at rest
    store.close()
    with pytest.raises(ValueError, match="auth_key_file"):
        open_store(f"auth+file://{tmp_path / 's'}")
    faulty = open_store("auth+faulty+" + f"file://{tmp_path / 't'}?latency_s=0&auth_key_file={key_file}")
    assert isinstance(faulty, AuthenticatedStore)
    faulty.close()


def test_flag_wraps_the_store_url_for_every_process(tmp_path, key_file):
    parser = argparse.ArgumentParser()
    RemoteKVConfig.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--remote-kv",
            "dpu",
            "--remote-kv-store",
            "redis://h:1/0",
            "--remote-kv-auth-key-file",
            str(key_file),
        ]
    )
    cfg = RemoteKVConfig.from_namespace(ns)
    assert cfg.auth_key_file == str(key_file.resolve())
    assert RemoteKVConfig.from_json(cfg.to_json()) == cfg
    assert cfg.resolved_store_url().startswith("auth+redis://h:1/0?auth_key_file=")
    plain = RemoteKVConfig.from_namespace(parser.parse_args(["--remote-kv", "dpu"]))
    assert not plain.resolved_store_url().startswith("auth+")


def test_flag_errors_are_one_argparse_line(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="srv")
    RemoteKVConfig.add_cli_args(parser)
    short = tmp_path / "short.key"
    short.write_text("abcd")
    for bad in (str(tmp_path / "nope.key"), str(short)):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--remote-kv-auth-key-file", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("srv: error: argument --remote-kv-auth-key-file:"), err
        assert bad in err[-1]


def test_world_readable_key_warns_once(tmp_path, caplog):
    p = tmp_path / "open.key"
    p.write_text(SECRET.hex())
    os.chmod(p, 0o644)
    with caplog.at_level("WARNING", logger="sgl_remote_kv.store.security"):
        load_auth_key(p)
    assert sum("every user" in r.message for r in caplog.records) == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_real_server_with_auth_key_serves_sealed_chunks_and_rejects_replays(model_dir, tmp_path, key_file):
    """End to end with the data plane: write-backs are sealed, fetches through the DPU process verify
    them (full hit, exact tokens), and a chunk replayed under another key is a miss from there on."""
    from transformers import AutoTokenizer

    from tests.fixtures.faults import CHUNK, ask, make_case, prime
    from tests.fixtures.remote_kv_server import remote_kv_server

    tok = AutoTokenizer.from_pretrained(model_dir)
    store = tmp_path / "store"
    with remote_kv_server(model_dir, f"file://{store}", "--remote-kv-auth-key-file", str(key_file)) as srv:
        assert "auth+file://" in srv.log_text()
        case = prime(srv, make_case(tok, "auth-e2e"))
        _, hit = ask(srv, case)
        assert hit == case.chunks * CHUNK
        files = sorted((store / "objects").rglob("*"), key=lambda p: p.stat().st_mtime)
        blobs = [p for p in files if p.is_file()]
        assert len(blobs) == case.chunks
        # Attacker with write access: replay chunk A's KV under chunk B's key, re-framed for B (the
        # framing CRC is public) and carrying A's MAC (the secret is not theirs).
        (ka, pa), (kb, pb) = [(bytes.fromhex(p.name), p) for p in blobs[:2]]
        sealed = pa.read_bytes()
        payload = unframe(ka, sealed[:-MAC_LEN])
        assert payload is not None
        pb.write_bytes(frame(kb, payload) + sealed[-MAC_LEN:])
        _, hit = ask(srv, case)  # tokens still checked against the recompute inside ask
        assert hit < case.chunks * CHUNK
