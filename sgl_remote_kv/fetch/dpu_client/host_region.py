"""The host's destination region: the shared memory its data plane writes decoded KV (or codes) into.

Two kinds, chosen by who attaches:

- for a data plane the host spawns, *anonymous* memory (``memfd_create``): it never has a name in any
  file system; the child inherits the descriptor (``link.py``: ``--region-fd``, also every restarted
  child) and the kernel frees the memory when the last process holding it is gone. So a server that
  stops or is killed in any way -- SIGTERM, ``Engine.shutdown`` (SGLang SIGKILLs the scheduler and its
  data plane together: ``kill_process_tree``), the OOM killer -- leaves nothing in /dev/shm. It is not
  limited by the size of /dev/shm either (64 MiB in a default container).
- for a shared data-plane service (``--remote-kv-dpu-endpoint``: another process that may restart and
  attach again), a file under /dev/shm named after its creator (``shm_names.region_name``). ``close``
  removes it; when the host dies the service removes it once it dropped the client (creator gone); when
  both die the next ``DpuClient.start`` sweeps it (``shm_names.sweep_stale``).

Where anonymous memory is unavailable (no ``memfd_create``), the region is the named kind (logged once).
``name`` identifies the region in the protocol either way (``Register.regions``, ``SubmitFetch``).

Threads: created and closed by the client's owner; ``array`` is read and written by many (``RoundIO``).
"""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np

from sgl_remote_kv.contract.shm_names import SHM_DIR

logger = logging.getLogger(__name__)
_fallback_logged = False


class HostRegion:
    """See module docstring. ``fd``: the descriptor a spawned data plane inherits; ``array``: a uint8
    view of the whole region (zero-filled, every page faulted in)."""

    def __init__(self, nbytes: int, name: str, *, named: bool, shm_dir: str = SHM_DIR) -> None:
        if nbytes < 1 or "/" in name:
            raise ValueError(f"bad region: {nbytes} bytes named {name!r}")
        self.name, self.size = name, nbytes
        self.path = ""  # the named kind's file
        self.fd = -1 if named else _anonymous(name)
        if self.fd < 0:
            self.path = os.path.join(shm_dir, name)
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
            self.fd = os.open(self.path, flags, 0o600)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mmap = mmap.mmap(self.fd, nbytes)
        except BaseException:
            self.remove_name()
            os.close(self.fd)
            raise
        self.array = np.ndarray((nbytes,), np.uint8, buffer=self._mmap)
        self.array.fill(0)  # fault every page in now, not under the first copy

    @property
    def named(self) -> bool:
        return bool(self.path)

    def remove_name(self) -> None:
        """Remove the named kind's file (mappings stay valid); first thing at close: a data plane that
        sees it gone need not clean up after us. Idempotent; nothing to do for anonymous memory."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Remove the name (if any) and unmap; with views of ``array`` still alive the mapping stays (it
        goes with the process). Idempotent."""
        if self.fd < 0:
            return
        self.remove_name()
        self.array = None  # drop our exported buffer before closing the mapping
        try:
            self._mmap.close()
        except BufferError:
            logger.warning("destination region %s still has views; leaving it mapped", self.name)
        os.close(self.fd)
        self.fd = -1


def _anonymous(name: str) -> int:
    """A memfd for the region, or -1 where there is none (logged once)."""
    global _fallback_logged
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except (OSError, AttributeError) as e:  # AttributeError: no memfd_create on this platform
        if not _fallback_logged:
            _fallback_logged = True
            logger.info(
                "DPU destination regions are files in %s (no anonymous shared memory: %s)", SHM_DIR, e
            )
        return -1
