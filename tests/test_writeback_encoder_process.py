"""The write-back's host encode leaves the scheduler process (issue 51 item 2): with ``processes`` the chunks
are encoded in encoder processes (``writeback/encoders.py``, ``writeback/encoder_process.py``) into the same
bytes as an in-process encode with the encoders' one numeric thread (the transform codec's float GEMM may
round otherwise with more BLAS threads: a valid encode either way); this process's codec never encodes; an
encoder that dies fails one job and is replaced; one that cannot start, or cannot start again after it was
lost, leaves the encode in-process, with the reason logged. Also the frames' checks (``writeback/wire.py``).
Real processes, a host pool, a file store."""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import calibration_helpers
import numpy as np
import pytest
import torch
from dpu_helpers import FP, LAYOUT, codecs

from sgl_remote_kv import env, runtime
from sgl_remote_kv.codec import calibration as cm
from sgl_remote_kv.codec.transform import TransformCodec
from sgl_remote_kv.kvpool import PoolTensors, writer_for
from sgl_remote_kv.metrics import RemoteKVMetrics
from sgl_remote_kv.sglang_glue.assemble import WriteBackRequests
from sgl_remote_kv.store.client import open_client
from sgl_remote_kv.types import KVLayout, ModelFingerprint, numpy_storage_dtype
from sgl_remote_kv.writeback import wire
from sgl_remote_kv.writeback.encoders import EncoderPool, EncoderUnavailable
from sgl_remote_kv.writeback.worker import WriteBack

CH = 32
TD = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class _Setup:
    def __init__(self, tmp_path, codec, fp=FP, chunks: int = 3, processes: bool = True, share: float = 1.0):
        lay = fp.layout
        gen = torch.Generator().manual_seed(0)
        pool = [
            (torch.randn(chunks * CH, lay.num_kv_heads, lay.head_dim, generator=gen) * 0.5).to(TD[lay.dtype])
            for _ in range(2 * lay.num_layers)
        ]
        self.writer = writer_for(PoolTensors(pool[: lay.num_layers], pool[lay.num_layers :]), lay)
        self.store = open_client(f"file://{tmp_path / 'store'}")
        self.keys = runtime.KeySpace(fp, codec, CH)
        self.metrics = RemoteKVMetrics()
        r2t = types.SimpleNamespace(req_to_token=torch.arange(chunks * CH)[None, :].clone())
        self.wb = WriteBack(
            codec,
            fp,
            self.store,
            self.keys,
            self.metrics,
            self.writer,
            WriteBackRequests(r2t),
            1 << 30,
            cpu_share=share,
            processes=processes,
            nice=5,
        )
        self.codec, self.fp, self.chunks = codec, fp, chunks

    def offer(self, rid: str, first_id: int) -> list[bytes]:
        ids = list(range(first_id, first_id + self.chunks * CH))
        req = types.SimpleNamespace(
            rid=rid,
            cache_salt=None,
            extra_key=None,
            kv=types.SimpleNamespace(req_pool_idx=0),
            full_untruncated_fill_ids=ids,
        )
        self.wb.offer(req, self.chunks * CH)
        assert self.wb.flush(120)
        return self.keys.keys_for(ids, self.chunks, None)

    def want(self, tmp_path=None) -> list[bytes]:
        """The blobs an in-process encode writes for the pool's chunks; with ``tmp_path``, encoded by a child
        process with the encoders' one numeric thread (``env.single_threaded_env``; the codec from its name
        and params, e.g. a transform codec's saved calibration)."""
        k, v = self.writer.read_later(torch.arange(self.chunks * CH)).result()
        parts = [
            (
                np.ascontiguousarray(k[:, j * CH : (j + 1) * CH]),
                np.ascontiguousarray(v[:, j * CH : (j + 1) * CH]),
            )
            for j in range(self.chunks)
        ]
        if tmp_path is None:
            return [self.codec.encode(kj, vj, self.fp, start=j * CH) for j, (kj, vj) in enumerate(parts)]
        np.savez(tmp_path / "kv.npz", *(a for kv in parts for a in kv))
        script = (
            "import sys, numpy as np\n"
            "from sgl_remote_kv.codec.base import codec_from_params\n"
            "from sgl_remote_kv.types import ModelFingerprint\n"
            "name, params, fp, d = sys.argv[1:5]\n"
            "codec = codec_from_params(name, params.encode())\n"
            "fp = ModelFingerprint.from_canonical(fp.encode())\n"
            "a = np.load(d + '/kv.npz')\n"
            "for j in range(len(a.files) // 2):\n"
            f"    blob = codec.encode(a[f'arr_{{2 * j}}'], a[f'arr_{{2 * j + 1}}'], fp, start=j * {CH})\n"
            "    open(f'{d}/blob{j}', 'wb').write(blob)\n"
        )
        args = [
            self.codec.name,
            self.codec.params_bytes().decode(),
            self.fp.canonical().decode(),
            str(tmp_path),
        ]
        subprocess.run([sys.executable, "-c", script, *args], env=env.single_threaded_env(), check=True)
        return [(tmp_path / f"blob{j}").read_bytes() for j in range(self.chunks)]


def _no_parent_encode(monkeypatch, codec) -> None:
    def refuse(*a, **kw):
        raise AssertionError("the scheduler process encoded a chunk")

    monkeypatch.setattr(codec, "encode", refuse)


@pytest.mark.parametrize("name", ["lossless", "quant"])
def test_encoder_processes_write_the_in_process_bytes_and_this_process_encodes_nothing(
    tmp_path, monkeypatch, name
) -> None:
    codec = codecs()[name]
    s = _Setup(tmp_path, codec, processes=True)
    want = s.want()
    pids = s.wb.encoder_pids()
    assert len(pids) == 1 and pids[0] != os.getpid()
    assert int(open(f"/proc/{pids[0]}/stat").read().split(")")[1].split()[16]) >= 5  # niceness 5 (field 19)
    _no_parent_encode(monkeypatch, codec)
    keys = s.offer("r", 100)
    assert s.store.get_many(keys) == want
    assert s.metrics.snapshot()["written_chunks"] == s.chunks
    s.wb.close()


def test_the_transform_codec_encodes_in_processes_from_its_saved_calibration(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "cache"))  # the encoders inherit it
    fp = ModelFingerprint("Arch", KVLayout(2, 2, 64, "float32"), "t" * 16)
    cal = calibration_helpers.make_calibration(fp)
    cal.save()
    try:
        codec = TransformCodec(cal.calib_id.hex(), "0.0005", "deflate", quantizer="trellis")
        s = _Setup(tmp_path, codec, fp, chunks=2, processes=True, share=2.0)  # two encoders side by side
        want = s.want(tmp_path)
        assert len(s.wb.encoder_pids()) == 2
        _no_parent_encode(monkeypatch, codec)
        assert s.store.get_many(s.offer("r", 7)) == want
        s.wb.close()
    finally:
        cm.unregister(cal.calib_id)


def _kill_the_encoder_mid_job(tmp_path, caplog) -> tuple[_Setup, list[bytes], int]:
    """A lossless write-back whose one encoder is killed before a job: that job is lost (not stored).
    Returns the setup, the blobs an encode writes, the killed pid."""
    s = _Setup(tmp_path, codecs()["lossless"], processes=True)
    want = s.want()
    (pid,) = s.wb.encoder_pids()
    os.kill(pid, signal.SIGKILL)
    caplog.set_level(logging.WARNING)
    assert s.store.count_prefix(s.offer("lost", 100)) == 0  # not stored: counted as a write-back failure
    return s, want, pid


def test_a_killed_encoder_fails_one_job_and_a_new_one_takes_the_next(tmp_path, caplog) -> None:
    s, want, pid = _kill_the_encoder_mid_job(tmp_path, caplog)
    assert s.metrics.snapshot()["failures|kind=writeback"] == 1
    assert any("encoder pid" in r.getMessage() for r in caplog.records)
    keys = s.offer("next", 5000)
    assert s.store.get_many(keys) == want
    (new_pid,) = s.wb.encoder_pids()
    assert new_pid != pid
    s.wb.close()


def test_a_lost_encoder_that_cannot_start_again_leaves_the_encode_in_process(
    tmp_path, monkeypatch, caplog
) -> None:
    """A killed encoder whose fresh start fails: that job and every later one are encoded in this process
    (the bytes an encoder writes), with one WARNING; nothing more is lost than the job the kill cut."""
    from sgl_remote_kv.writeback import encoders

    s, want, _ = _kill_the_encoder_mid_job(tmp_path, caplog)  # the job the kill cut
    starts = []

    def cannot_start(self):
        starts.append(1)
        raise EncoderUnavailable("the interpreter cannot start (simulated)")

    monkeypatch.setattr(encoders._Encoder, "start", cannot_start)
    assert s.store.get_many(s.offer("next", 5000)) == want  # encoded here instead
    assert s.store.get_many(s.offer("later", 9000)) == want
    assert len(starts) == 1  # tried once, not once per chunk
    assert s.metrics.snapshot()["failures|kind=writeback"] == 1  # only the cut job
    assert s.wb.encoder_pids() == []
    why = [r.getMessage() for r in caplog.records if "from now on" in r.getMessage()]
    assert len(why) == 1 and "simulated" in why[0]
    s.wb.close()


def test_an_encoder_that_cannot_build_the_codec_leaves_the_encode_in_process(
    tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("SRKV_CACHE_DIR", str(tmp_path / "empty-cache"))
    fp = FP
    cal = calibration_helpers.make_calibration(fp)  # registered here, never saved: the encoder lacks it
    try:
        codec = TransformCodec(cal.calib_id.hex(), "0.0005", "deflate", quantizer="scalar")
        caplog.set_level(logging.WARNING)
        s = _Setup(tmp_path, codec, fp, chunks=2, processes=True)
        assert s.wb.encoder_pids() == []
        why = [r.getMessage() for r in caplog.records if "encodes in the scheduler process" in r.getMessage()]
        assert len(why) == 1 and "calibration" in why[0]
        assert s.store.get_many(s.offer("r", 1)) == s.want()  # encoded here instead
        s.wb.close()
    finally:
        cm.unregister(cal.calib_id)


@pytest.mark.parametrize("cpu_s", [0.01, 0.3])
def test_while_serving_the_pause_follows_the_encoder_s_cpu_not_its_wall_time(tmp_path, cpu_s) -> None:
    """An encoder niced under a busy forward takes longer in wall time than in CPU time; the write-back's
    share bounds the encode's CPU, so the pause after a chunk is ``cpu_s * (1 - share) / share``."""
    n, wall_s, share = 4, 0.4, 0.25
    s = _Setup(tmp_path, codecs()["lossless"], chunks=n, processes=True, share=share)
    assert len(s.wb.encoder_pids()) == 1
    pool = s.wb._host.pool
    real = pool.encode

    def slow(k, v, start):  # the wall time of a starved encoder, reporting its real-world CPU
        time.sleep(wall_s)
        return real(k, v, start)[0], cpu_s

    pool.encode = slow
    stop = threading.Event()

    def serving():
        while not stop.is_set():
            s.wb.note_serving()
            time.sleep(0.01)

    threading.Thread(target=serving, daemon=True).start()
    t0 = time.monotonic()
    s.offer("r", 1)
    took = time.monotonic() - t0
    stop.set()
    pauses = (n - 1) * cpu_s * (1 - share) / share  # 0.09 s or 2.7 s; by wall time it would be 3.6 s
    assert n * wall_s + 0.9 * pauses <= took < n * wall_s + pauses + 1.5, took
    s.wb.close()


def test_a_chunk_not_of_the_layout_is_refused_as_in_process_and_the_encoder_serves_on() -> None:
    pool = EncoderPool(codecs()["lossless"], FP, CH)
    pool.start()
    try:
        dt = numpy_storage_dtype(LAYOUT.dtype)
        bad = np.zeros((LAYOUT.num_layers + 1, CH // 2, LAYOUT.num_kv_heads, LAYOUT.head_dim), dt)
        with pytest.raises(ValueError, match="does not match layout"):
            pool.encode(bad, bad, 0)  # fits the slot, but the encoder would read it as another shape
        with pytest.raises(ValueError, match="dtype"):
            pool.encode(bad[:-1].astype(np.float32), bad[:-1].astype(np.float32), 0)
        big = np.zeros((LAYOUT.num_layers, 2 * CH, LAYOUT.num_kv_heads, LAYOUT.head_dim), dt)
        with pytest.raises(ValueError, match="slot"):
            pool.encode(big, big, 0)
        k = np.ones((LAYOUT.num_layers, CH, LAYOUT.num_kv_heads, LAYOUT.head_dim), dt)
        blob, cpu_s = pool.encode(k, k, 0)
        assert blob == codecs()["lossless"].encode(k, k, FP) and 0.0 < cpu_s < 10.0
    finally:
        pool.close()
    assert pool.pids() == []


def test_the_fingerprint_travels_as_its_canonical_json() -> None:
    assert ModelFingerprint.from_canonical(FP.canonical()) == FP
    assert ModelFingerprint.from_canonical(FP.canonical().decode()) == FP
    for bad in (b'{"x": 1}', b"[]", b"not json", FP.canonical().replace(b"}", b', "extra": 1}', 1)):
        with pytest.raises(ValueError, match="canonical model fingerprint"):
            ModelFingerprint.from_canonical(bad)
    spaced = FP.canonical().replace(b",", b", ")  # the same fields, not the canonical bytes
    with pytest.raises(ValueError, match="canonical"):
        ModelFingerprint.from_canonical(spaced)


def test_the_frames_checks() -> None:
    a, b = socket.socketpair()
    with a, b:
        wire.send(a, wire.Encode(tokens=3, start=7))
        assert wire.recv(b) == wire.Encode(tokens=3, start=7)
        a.sendall(struct.pack("<4sHI", b"XXXX", 1, 0))
        with pytest.raises(wire.WireError, match="magic"):
            wire.recv(b)
        a.sendall(struct.pack("<4sHI", wire.MAGIC, wire.WIRE_VERSION, 1 << 30))
        with pytest.raises(wire.WireError, match="bound"):
            wire.recv(b)
        body = b"\x81\xa4type\xa6encode"  # msgpack {"type": "encode"}: fields missing
        a.sendall(struct.pack("<4sHI", wire.MAGIC, wire.WIRE_VERSION, len(body)) + body)
        with pytest.raises(wire.WireError, match="bad frame"):
            wire.recv(b)
        a.close()
        with pytest.raises(EOFError):
            wire.recv(b)


def test_an_encoder_given_a_frame_that_is_not_ours_exits_2() -> None:
    ours, theirs = socket.socketpair()
    fd = os.memfd_create("t")
    os.ftruncate(fd, 1 << 16)
    cmd = [sys.executable, "-m", "sgl_remote_kv.writeback.encoder_process"]
    proc = subprocess.Popen(
        cmd + ["--sock", str(theirs.fileno()), "--slot", str(fd)], pass_fds=(theirs.fileno(), fd)
    )
    theirs.close()
    os.close(fd)
    with ours:
        hello = wire.Hello(
            "lossless", codecs()["lossless"].params_bytes().decode(), FP.canonical().decode(), 1 << 16, 0
        )
        wire.send(ours, hello)
        assert wire.recv(ours, 1 << 20) == wire.Ready()
        wire.send(ours, wire.Encode(tokens=1 << 20, start=0))  # more than the slot holds: refused, serves on
        assert "do not fit the slot" in wire.recv(ours, 1 << 20).error
        zero = np.zeros((LAYOUT.num_layers, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.uint16)
        wire.send(ours, wire.Encode(tokens=1, start=0))  # the slot's first token: zeros
        assert wire.recv(ours, 1 << 20).blob == codecs()["lossless"].encode(zero, zero, FP)
        ours.sendall(b"garbage!" * 4)
        assert proc.wait(timeout=30) == 2
    t0 = time.monotonic()
    with pytest.raises(EncoderUnavailable):
        bad = EncoderPool(types.SimpleNamespace(name="nope", params_bytes=lambda: b"{}"), FP, CH)
        bad.start()
    assert time.monotonic() - t0 < 30
