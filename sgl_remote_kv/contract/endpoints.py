"""The endpoint rule of the data plane, in one place: every ZeroMQ endpoint a host or a data-plane service
binds or connects (the data plane's own socket, a shared service's, its store proxy's) is ``ipc://PATH``
or ``tcp://HOST:PORT``, and a ``tcp://`` endpoint must be authenticated (CURVE keys derived from a shared
secret, ``auth.py``): an ``ipc://`` socket file is protected by its file mode, a TCP port by nothing else.
"""

from __future__ import annotations

IPC = "ipc://"
TCP = "tcp://"
SCHEMES = (IPC, TCP)


def is_endpoint(text: str) -> bool:
    """``ipc://`` or ``tcp://`` followed by something."""
    return text.startswith(SCHEMES) and text not in SCHEMES


def check_endpoint(endpoint: str, *, authenticated: bool, what: str, key_hint: str) -> str:
    """``endpoint`` when it follows the rule (module docstring); else ValueError naming ``what`` (the flag
    or setting) and ``key_hint`` (where the shared secret comes from)."""
    if not is_endpoint(endpoint):
        raise ValueError(f"{what} must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
    if endpoint.startswith(TCP) and not authenticated:
        raise ValueError(f"a tcp:// {what} must be authenticated: it needs {key_hint}")
    return endpoint


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint; None for ``tcp://`` and abstract sockets (``ipc://@``)."""
    if not endpoint.startswith(IPC) or endpoint.startswith(IPC + "@"):
        return None
    return endpoint[len(IPC) :]
