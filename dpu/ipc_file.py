"""The socket file of an ``ipc://`` endpoint this process bound, removed when it stops serving.

libzmq (4.3) leaves the file of an explicitly named ``ipc://`` endpoint behind when the socket closes, so
a stopped data-plane service (or store proxy) removes it itself -- only if it is still the file it bound:
another process may have bound the same path since (libzmq replaces an existing file at bind).

Threads: whoever owns the bound socket (the server thread, the proxy's thread).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from sgl_remote_kv.contract.endpoints import ipc_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoundFile:
    path: str
    dev: int
    ino: int

    @classmethod
    def after_bind(cls, endpoint: str) -> BoundFile | None:
        """The file ``endpoint`` was just bound on; None for tcp://, an abstract socket or no file."""
        path = ipc_path(endpoint)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(path, st.st_dev, st.st_ino)

    def remove(self) -> None:
        """Unlink the file if it is still ours (call after closing the socket). Never raises."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == (self.dev, self.ino):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("cannot remove the socket file %s: %s", self.path, e)
