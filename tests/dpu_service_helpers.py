"""Shared by the data-plane service tests: a real ``python -m sgl_remote_kv.dpu`` service process on the
embedded file store, the ``service_env`` fixture body (services and clients it made are stopped/closed at
the end), and a raw ZeroMQ peer for speaking the protocol directly."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq
from dpu_helpers import CHUNK, codecs, pool_tokens

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
from sgl_remote_kv.types import KVLayout, ModelFingerprint

LAYOUT32 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32")
CB = chunk_bytes(LAYOUT32, CHUNK)


def rank_fp(rank: int, size: int = 2) -> ModelFingerprint:
    return ModelFingerprint("TestArch", LAYOUT32, "w" * 16, rank, size)


def random_kv(n: int, seed: int):
    rng = np.random.default_rng(seed)
    shape = (LAYOUT32.num_layers, CHUNK, LAYOUT32.num_kv_heads, LAYOUT32.head_dim)
    return [
        (rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)) for _ in range(n)
    ]


class Service:
    """One ``python -m sgl_remote_kv.dpu`` service process (killed and reaped on ``stop``)."""

    def __init__(self, endpoint: str, store_url: str, log: Path, *flags: str) -> None:
        self.endpoint, self.store_url, self.log, self.flags = endpoint, store_url, log, flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> Service:
        cmd = [
            sys.executable,
            "-m",
            "sgl_remote_kv.dpu",
            "--endpoint",
            self.endpoint,
            "--store",
            self.store_url,
        ]
        cmd += ["--fetch-workers", "1", "--layer-group", "2", "--log-level", "INFO", *self.flags]
        started = self.log.read_bytes().count(b"serving on") if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + 30  # serving: clients registering now are answered at once
        while self.log.read_bytes().count(b"serving on") == started and self.proc.poll() is None:
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


def settings_service(tmp_path: Path, store_url: str, spec: DataPlaneSettings, *flags: str) -> Service:
    """A service (``ipc://`` in ``tmp_path``, started) running exactly ``spec``, as a host hands it to
    its own data plane: for tests that talk to a data plane over a connection of their own (a server's
    own data plane accepts its host only). ``kill`` it at the end."""
    spec = dataclasses.replace(spec, log_level="INFO")  # Service.start waits for the start line
    ep = f"ipc://{tmp_path}/dpu.sock"
    return Service(ep, store_url, tmp_path / "service.log", "--settings-json", spec.to_json(), *flags).start()


def service_env(tmp_path: Path):
    """The ``env`` fixture of the service tests (``yield from service_env(tmp_path)``): yields (store url,
    make_service, make_client); everything made is stopped/closed at the end."""
    url = f"file://{tmp_path}/store"
    services: list[Service] = []
    clients: list[DpuClient] = []

    def make_service(*flags: str, endpoint: str | None = None, store_url: str | None = None) -> Service:
        ep = endpoint or f"ipc://{tmp_path}/dpu.sock"
        svc = Service(ep, store_url or url, tmp_path / "service.log", *flags).start()
        services.append(svc)
        return svc

    def make_client(svc: Service, fp: ModelFingerprint, dest_chunks: int = 3, **kw) -> DpuClient:
        kw.setdefault("heartbeat_s", 0.2)
        kw.setdefault("heartbeat_timeout_s", 1.5)
        kw.setdefault("start_timeout_s", 30.0)
        cfg = DpuClientConfig(
            url, dest_slots=2, dest_slot_bytes=dest_chunks * CB, endpoint=svc.endpoint, **kw
        )
        c = DpuClient(cfg, fp, codecs()["lossless"])
        clients.append(c)
        c.start()
        return c

    yield url, make_service, make_client
    for c in clients:
        c.close()
    for s in services:
        s.kill()


def slots_flags(slots: int = 2, chunks_per_slot: int = 2) -> list[str]:
    return ["--slots", str(slots), "--slot-bytes", str(chunks_per_slot * CB)]


def assert_exact(target, chunks, n: int) -> None:
    for i in range(n):
        pk, pv = pool_tokens(target, LAYOUT32, i * CHUNK, (i + 1) * CHUNK)
        k, v = chunks[i]
        assert np.array_equal(pk, k) and np.array_equal(pv, v), f"chunk {i} is not token-identical"


def service_stats(c: DpuClient, timeout: float = 5.0) -> dict:
    """The service's stats from ``c``'s next Pong."""
    seen = c.last_pong
    deadline = time.monotonic() + timeout
    while c.last_pong is seen and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(c.stats()["dataplane"])


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def raw_socket(endpoint: str):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        yield s
    finally:
        s.close()
        ctx.term()


def ask(s, msg, want=P.Registered, timeout: float = 20.0):
    s.send(P.encode(msg))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.poll(200):
            got = P.decode(s.recv())
            if isinstance(got, want):
                return got
    raise AssertionError(f"no {want.__name__}")


def register_msg(fp: ModelFingerprint, regions: list[str], digest: bytes | None = None) -> P.Register:
    lay = fp.layout
    wire = P.Fingerprint(
        fp.architecture,
        P.Layout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype),
        fp.weights_id,
        fp.tp_rank,
        fp.tp_size,
        digest or fp.digest(),
    )
    codec = codecs()["lossless"]
    return P.Register(os.urandom(16), "raw", wire, codec.name, codec.params_bytes(), regions)
