"""Page-locking host memory in place (``cudaHostRegister``), shared by every writer of the process.

Two rules of the CUDA runtime shape this module:

- A failed ``cudaHostRegister`` also sets the calling thread's *last error*. torch checks
  ``cudaGetLastError`` after its own kernel launches, so a failure left uncleared surfaces later as an
  unrelated error in whatever the thread launches next (on the scheduler thread: a forward pass).
  torch's ``torch.cuda.cudart()`` bindings have no ``cudaGetLastError``, so ``CudartRuntime`` calls the
  loaded ``libcudart``'s own through ctypes, and pins nothing when it cannot find it: a region that is
  not pinned is still written correctly (staged through pinned buffers), only slower.
- Registering a range twice fails (``cudaErrorHostMemoryAlreadyRegistered``): two writers of one
  process (a draft and a target pool, two TP ranks in one process) can share one DPU region. The
  ``HostPinner`` counts registrations per range: the first pins, the last unpins.

Threads: any; one lock guards the table. Owns nothing it did not pin.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Protocol

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1


class Runtime(Protocol):
    def register(self, ptr: int, nbytes: int, flags: int) -> int: ...  # 0 or a cudaError_t
    def unregister(self, ptr: int) -> int: ...
    def clear_error(self) -> int: ...  # cudaGetLastError: returns and resets the thread's last error


class HostPinner:
    """See module docstring."""

    def __init__(self, runtime: Runtime | None) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], int] = {}  # (ptr, nbytes) -> registrations

    def pin(self, ptr: int, nbytes: int) -> bool:
        """True when ``[ptr, ptr + nbytes)`` is pinned for the caller (until its ``unpin``)."""
        if self.runtime is None or nbytes <= 0:
            return False
        with self._lock:
            key = (ptr, nbytes)
            if key in self._ranges:
                self._ranges[key] += 1
                return True
            err = int(self.runtime.register(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
            if err != 0:
                self.runtime.clear_error()  # the failure must not surface in a later launch
                logger.warning(
                    "cudaHostRegister of %d bytes failed (cudaError %d); KV writes from it are staged",
                    nbytes,
                    err,
                )
                return False
            self._ranges[key] = 1
            return True

    def unpin(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            key = (ptr, nbytes)
            n = self._ranges.get(key, 0)
            if n > 1:
                self._ranges[key] = n - 1
            elif n == 1:
                del self._ranges[key]
                if int(self.runtime.unregister(ptr)) != 0:
                    self.runtime.clear_error()

    def pinned(self) -> int:
        with self._lock:
            return len(self._ranges)


class CudartRuntime:
    """``Runtime`` over torch's cudart bindings plus the loaded ``libcudart``'s ``cudaGetLastError``."""

    def __init__(self, cudart, get_last_error) -> None:
        self._cudart, self._get_last_error = cudart, get_last_error

    @classmethod
    def load(cls) -> CudartRuntime | None:
        """None when the process has no ``libcudart`` mapped (torch linked it statically): no pinning."""
        import torch

        torch.cuda.init()
        path = _mapped_library("libcudart.so")
        if path is None:
            logger.warning("libcudart is not mapped in this process: host regions will not be pinned")
            return None
        fn = ctypes.CDLL(path).cudaGetLastError  # the loaded instance: dlopen returns its handle
        fn.restype = ctypes.c_int
        return cls(torch.cuda.cudart(), fn)

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._cudart.cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> int:
        return int(self._cudart.cudaHostUnregister(ptr))

    def clear_error(self) -> int:
        return int(self._get_last_error())


def _mapped_library(prefix: str) -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.rsplit("/", 1)[-1].startswith(prefix):
                    return path
    except OSError:
        return None
    return None


_PINNER: HostPinner | None = None
_PINNER_LOCK = threading.Lock()


def cuda_pinner() -> HostPinner:
    """The process's one pinner over the CUDA runtime (created on first use)."""
    global _PINNER
    with _PINNER_LOCK:
        if _PINNER is None:
            _PINNER = HostPinner(CudartRuntime.load())
        return _PINNER
