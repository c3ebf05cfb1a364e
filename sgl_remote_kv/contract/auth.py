"""Authentication of the data plane's endpoint: ZeroMQ CURVE keys derived from the shared secret.

The secret is the project's one shared secret (``--remote-kv-auth-key-file`` on the serving side,
``--auth-key-file`` on a standalone data plane; ``security.load_auth_key``). Both ends derive, with
domain-separated SHA-256, one CURVE key pair for the data plane and one for its clients, so knowing
the secret is what lets a client connect: a client with another secret computes another server public
key and its handshake fails; a client with the right server key but another client key is refused by
the ZAP handler (``serve``), which accepts only the derived client public key. CURVE also encrypts the
control channel. The KV itself never crosses this socket (it goes through the host's shared region);
the store proxy's socket (``store_proxy.py``), which carries stored values, is secured the same way.

Threads: ``serve`` starts pyzmq's ZAP authenticator thread in the given context (stopped by
``ZapHandle.stop``); everything else is pure.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from .endpoints import IPC

logger = logging.getLogger(__name__)

_TAG = b"sgl-remote-kv/dpu-curve/v1/"


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE keys derived from one shared secret (secret halves not shown in ``repr``)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)


def curve_keys(secret: bytes) -> CurveKeys:
    if not secret:
        raise ValueError("empty shared secret")
    if not zmq.has("curve"):
        raise ValueError("this libzmq has no CURVE support; cannot authenticate the endpoint")
    ss = z85.encode(hashlib.sha256(_TAG + b"server\0" + secret).digest())
    cs = z85.encode(hashlib.sha256(_TAG + b"client\0" + secret).digest())
    return CurveKeys(zmq.curve_public(ss), ss, zmq.curve_public(cs), cs)


class _OnlyOurClients:
    """ZAP credentials provider: accepts exactly the derived client public key; counts refusals."""

    def __init__(self, client_public: bytes) -> None:
        self._want = client_public  # Z85, as pyzmq's authenticator passes the client's key
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(bytes(key), self._want)
        if not ok:
            self.refused += 1
            logger.warning("refused a CURVE client with an unknown key")
        return ok


class ZapHandle:
    def __init__(self, auth, provider: _OnlyOurClients) -> None:
        self._auth, self.provider = auth, provider

    @property
    def refused(self) -> int:
        return self.provider.refused

    def stop(self) -> None:
        self._auth.stop()


def serve(ctx: zmq.Context, sock: zmq.Socket, secret: bytes) -> ZapHandle:
    """Make ``sock`` (not yet bound) a CURVE server for ``secret``'s clients only."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = curve_keys(secret)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    provider = _OnlyOurClients(keys.client_public)
    auth.configure_curve_callback("*", credentials_provider=provider)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    return ZapHandle(auth, provider)


def bind_server(ctx: zmq.Context, sock: zmq.Socket, endpoint: str, secret: bytes) -> ZapHandle | None:
    """Bind ``sock`` on ``endpoint`` as an authenticated endpoint: a CURVE server for ``secret``'s clients
    when ``secret`` is given (the ZAP handle, to stop at shutdown; else None), and an ``ipc://`` socket
    file created 0600 (umask 077: only this user may connect, the local socket's authentication)."""
    zap = serve(ctx, sock, secret) if secret else None
    if not endpoint.startswith(IPC):
        sock.bind(endpoint)
        return zap
    old = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    return zap


def connect_as_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of a data plane serving ``secret``."""
    keys = curve_keys(secret)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
