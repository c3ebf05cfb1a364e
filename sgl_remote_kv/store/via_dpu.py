"""``dpu+ipc://`` / ``dpu+tcp://`` store URLs: the store, reached through a data-plane service's store proxy.

For hosts that cannot reach the store themselves (the ShadowServe topology: the data plane owns the
path to the store, docs/DPU.md): ``--remote-kv-store dpu+ipc:///run/srkv/store.sock`` sends every store
call of this process (lookups, write-backs, generation markers) to the proxy the service runs on
``--store-endpoint`` (``dpu/store_proxy.py``). This is a plain ``KVStore`` backend: the serving path still
wraps it in ``StoreClient``, so timeouts, retries, breakers and the integrity framing are unchanged, and
a service that is down or slow is a miss like a store that is down. ``scan`` is not offered (the admin
command talks to the store directly).

Options (URL query): ``timeout`` (seconds one call may wait for its answer, default 30: above the
``StoreClient`` deadline of any batch it sends), ``auth_key_file`` (the service's shared secret: CURVE;
required for ``dpu+tcp://``).

Threads: any thread may call; each calling thread gets its own DEALER socket (ZeroMQ sockets are not
thread-safe), so a slow put on a write-back thread never delays a lookup on the scheduler thread. A reply
that arrives after its call timed out is recognised by its request id and dropped.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import zmq

from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.endpoints import IPC, check_endpoint

from .base import (
    Counters,
    StoreAuthError,
    StoreError,
    StoreStats,
    StoreTimeout,
    StoreUnavailable,
    check_keys,
    url_options,
)

_KINDS = {"unavailable": StoreUnavailable, "timeout": StoreTimeout, "auth": StoreAuthError}


class ServiceStore:
    """See module docstring."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, auth_key: bytes = b"") -> None:
        check_endpoint(
            endpoint,
            authenticated=bool(auth_key),
            what="store proxy endpoint (dpu+ URL)",
            key_hint="auth_key_file (the service's shared secret)",
        )
        if not timeout_s > 0:
            raise ValueError("timeout must be > 0")
        self.endpoint, self.timeout_s, self._auth_key = endpoint, timeout_s, auth_key
        self.ctx = zmq.Context.instance()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._counters = Counters("dpu-proxy")

    # ---- KVStore -------------------------------------------------------------------------------------
    def count_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._counters.timed("count_prefix"):
            return self._call("count_prefix", keys)[0].count

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        with self._counters.timed("get_many"):
            reply, values = self._call("get_many", keys)
        if len(reply.present) != len(keys) or sum(reply.present) != len(values):
            raise StoreError(f"store proxy answered {len(values)} values for {len(keys)} keys")
        it = iter(values)
        return [next(it) if p else None for p in reply.present]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        keys = [k for k, _ in items]
        check_keys(keys)
        with self._counters.timed("put_many"):
            self._call("put_many", keys, [bytes(v) for _, v in items])

    def delete_many(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        self._call("delete_many", keys)

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            for s in self._sockets:
                s.close(0)
            self._sockets.clear()

    # ---- wire ----------------------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None or sock.closed:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_VALUE_BYTES)
            if self._auth_key:
                from sgl_remote_kv.contract import auth

                auth.connect_as_client(sock, self._auth_key)
            sock.connect(self.endpoint)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def _call(self, op: str, keys: Sequence[bytes], values: list[bytes] | None = None):
        if len(keys) > P.MAX_STORE_KEYS:
            raise ValueError(f"{len(keys)} keys in one call; at most {P.MAX_STORE_KEYS}")
        if self.endpoint.startswith(IPC) and not os.path.exists(self.endpoint[len(IPC) :]):
            raise StoreUnavailable(f"no store proxy at {self.endpoint}")  # not listening: fail fast
        req = next(self._ids)
        sock = self._socket()
        sock.send_multipart([P.encode(P.StoreRequest(req, op, list(keys))), *(values or [])], copy=False)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                self._reset(sock)  # a late reply must not meet the next call
                raise StoreTimeout(f"store proxy {self.endpoint}: no answer to {op} in {self.timeout_s} s")
            frames = sock.recv_multipart()
            try:
                reply = P.decode(frames[0])
            except P.ProtocolError as e:
                raise StoreError(f"store proxy sent a bad reply: {e}") from None
            if not isinstance(reply, P.StoreReply):
                raise StoreError("store proxy sent something other than a StoreReply")
            if reply.req != req:
                continue  # the answer to an earlier call that timed out
            if reply.error:
                raise _KINDS.get(reply.error, StoreError)(f"store proxy: {op}: {reply.error}")
            return reply, frames[1:]

    def _reset(self, sock: zmq.Socket) -> None:
        sock.close(0)
        self._local.sock = None
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)


def open_via_dpu(url: str) -> ServiceStore:
    """``dpu+ipc:///path`` or ``dpu+tcp://host:port`` (query options: ``timeout``, ``auth_key_file``)."""
    parts = urlsplit(url)
    opts = url_options(url)
    scheme = parts.scheme.lower().removeprefix("dpu+")
    endpoint = f"{scheme}://{parts.netloc}{parts.path}"
    key = b""
    if opts.get("auth_key_file"):
        from sgl_remote_kv.store.security import load_auth_key

        key = load_auth_key(opts["auth_key_file"])
    try:
        timeout = float(opts.get("timeout", 30.0))
    except ValueError:
        raise ValueError(f"store URL {url!r}: timeout must be a number") from None
    return ServiceStore(endpoint, timeout, key)
