"""The data-plane service's store proxy: the store calls of hosts that cannot reach the store.

In the ShadowServe topology the data plane owns the path to the store; the serving processes keep only a
DPU client (and, here, no route to the store at all). Their lookups (``count_prefix``), write-backs
(``put_many``), generation markers (``get_many``) and corrupt-value deletions (``delete_many``) come to
this proxy as ``protocol.StoreRequest`` s on its own ZeroMQ ROUTER endpoint (``--store-endpoint``; CURVE with
the service's secret when it has one, required for ``tcp://``) and run against the service's store
backend. The host side is ``sgl_remote_kv.store.via_dpu`` (a ``KVStore`` behind the host's usual
``StoreClient``, which keeps its timeouts, breakers and framing: values pass through here verbatim).

Wire: ``[peer, StoreRequest frame, value frames...]`` in, ``[peer, StoreReply frame, value frames...]`` out
(``protocol.StoreRequest``/``StoreReply``). A malformed request is dropped (counted) or, when its id can
be read, answered with ``error="bad_request"``. Backend failures are answered with their ``StoreError``
kind; nothing a peer sends can stop the proxy.

Threads: ``run`` (the proxy's thread) owns the ROUTER socket and an inproc PULL socket; calls run on a
small worker pool (a slow put does not hold up lookups), each worker sends its reply through a
thread-local PUSH socket to the PULL, and ``run`` forwards it. ``stop`` may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from dataclasses import dataclass

import zmq

from sgl_remote_kv.contract import auth
from sgl_remote_kv.contract import protocol as P
from sgl_remote_kv.contract.endpoints import check_endpoint
from sgl_remote_kv.store.base import KVStore, StoreError, open_store, redact_url

from .ipc_file import BoundFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreProxyConfig:
    endpoint: str
    store_url: str
    auth_key: bytes = b""
    workers: int = 4

    def __post_init__(self) -> None:
        check_endpoint(
            self.endpoint,
            authenticated=bool(self.auth_key),
            what="store endpoint",
            key_hint="--auth-key-file (the store would be open to anyone)",
        )
        if self.workers < 1:
            raise ValueError("workers must be >= 1")


class StoreProxy:
    """See module docstring. ``start()`` binds and runs it on a daemon thread."""

    def __init__(self, cfg: StoreProxyConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self._store: KVStore | None = None
        self._store_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(cfg.workers, thread_name_prefix="store-proxy")
        self._local = threading.local()
        self._replies = f"inproc://store-proxy-{id(self)}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._zap = None
        self._socket_file: BoundFile | None = None
        self.stats = {"requests": 0, "errors": 0, "bad_frames": 0}

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_VALUE_BYTES)
        self._zap = auth.bind_server(self.ctx, self.router, self.cfg.endpoint, self.cfg.auth_key)
        self._socket_file = BoundFile.after_bind(self.cfg.endpoint)  # removed when the thread ends
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self._replies)
        self._thread = threading.Thread(target=self.run, name="store-proxy", daemon=True)
        self._thread.start()
        logger.debug("store proxy on %s for %s", self.cfg.endpoint, redact_url(self.cfg.store_url))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._zap is not None:
            self._zap.stop()
        with self._store_lock:
            if self._store is not None:
                try:
                    self._store.close()
                except Exception as e:  # best-effort close at shutdown, logged
                    logger.warning("closing the store: %r", e)

    # ---- the proxy's thread ------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock is self.pull:
                        self.router.send_multipart(self.pull.recv_multipart(), copy=False)
                    else:
                        self._accept(self.router.recv_multipart(copy=False))
        finally:
            self.router.close(0)
            self.pull.close(0)
            if self._socket_file is not None:
                self._socket_file.remove()

    def _accept(self, frames: list) -> None:
        if len(frames) < 2:
            self.stats["bad_frames"] += 1
            return
        peer, head, values = frames[0].bytes, frames[1].bytes, [f.bytes for f in frames[2:]]
        try:
            msg = P.decode(head)
        except P.ProtocolError as e:
            self.stats["bad_frames"] += 1
            logger.warning("store proxy: dropped a bad request: %s", e)
            return
        if not isinstance(msg, P.StoreRequest):
            self.stats["bad_frames"] += 1
            return
        if (msg.op == "put_many") != bool(values) or (values and len(values) != len(msg.keys)):
            self._send(peer, P.StoreReply(msg.req, error="bad_request"), [])
            return
        self.stats["requests"] += 1
        self._pool.submit(self._serve, peer, msg, values)

    # ---- workers -------------------------------------------------------------------------------------
    def _serve(self, peer: bytes, msg: P.StoreRequest, values: list[bytes]) -> None:
        out: list[bytes] = []
        try:
            store = self._backend()
            if msg.op == "count_prefix":
                reply = P.StoreReply(msg.req, count=int(store.count_prefix(msg.keys)))
            elif msg.op == "get_many":
                got = store.get_many(msg.keys)
                out = [g for g in got if g is not None]
                reply = P.StoreReply(msg.req, present=[g is not None for g in got])
            elif msg.op == "put_many":
                store.put_many(list(zip(msg.keys, values, strict=True)))
                reply = P.StoreReply(msg.req)
            else:
                store.delete_many(msg.keys)
                reply = P.StoreReply(msg.req)
        except StoreError as e:
            self.stats["errors"] += 1
            reply, out = P.StoreReply(msg.req, error=e.kind), []
        except Exception as e:  # a worker-thread boundary: any other failure is the backend's, counted
            self.stats["errors"] += 1
            logger.warning("store proxy: %s failed: %r", msg.op, e)
            reply, out = P.StoreReply(msg.req, error="error"), []
        self._send(peer, reply, out)

    def _send(self, peer: bytes, reply: P.StoreReply, values: list[bytes]) -> None:
        if threading.current_thread() is self._thread:  # a bad request answered by the proxy's thread
            self.router.send_multipart([peer, P.encode(reply), *values])
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(self._replies)
        push.send_multipart([peer, P.encode(reply), *values], copy=False)

    def _backend(self) -> KVStore:
        with self._store_lock:  # opened lazily: a store that is down at start comes up later
            if self._store is None:
                self._store = open_store(self.cfg.store_url)
            return self._store
