"""Names of the DPU client's shared-memory destination regions and data-plane run directories, and the
sweep of stale ones.

A region (128 MiB+) has its name only while a data plane attaches to it (``host_region.py``); when the
host and its data plane die at once in that window (SIGKILL of the server's processes, the OOM killer)
nobody removes it and the segment would stay in /dev/shm until reboot. So every region is named after
its creator:
``srkv-dpu-<pid>-<start time>-<random>`` (start time: field 22 of ``/proc/<pid>/stat``, in clock ticks
since boot, so a recycled pid is not mistaken for the creator), and ``sweep_stale`` -- run by every
``DpuClient.start`` -- unlinks the regions whose creator is gone. It never touches a name of another
pattern, nor a region whose creator is alive (or cannot be checked: no /proc).

A spawned data plane's run directory (its IPC endpoint until the host connected, under the temp dir;
``fetch/dpu_client/link.py``) carries the same kind of name; a host killed with its data plane while it starts
leaves it behind, so ``sweep_stale_dirs`` removes the directories of dead creators.

Threads: pure functions; the sweeps run on the thread calling ``DpuClient.start``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import tempfile

logger = logging.getLogger(__name__)

PREFIX = "srkv-dpu-"
_NAME = re.compile(r"^srkv-dpu-(\d{1,10})-(\d{1,20})-[0-9a-f]{8}\Z")
SHM_DIR = "/dev/shm"


def _start_time(pid: int) -> tuple[int, str] | None:
    """(start time, state) of ``pid`` from /proc, or ``None`` if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, start 22
    return int(fields[19]), fields[0]


def region_name(pid: int | None = None) -> str:
    """A fresh region name owned by ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    st = _start_time(pid) if os.path.isdir("/proc") else None
    return f"{PREFIX}{pid}-{st[0] if st else 0}-{secrets.token_hex(4)}"


def creator_alive(name: str) -> bool:
    """False only when ``name`` is one of ours and its creating process is certainly gone (no such
    pid, a zombie, or another process reusing the pid)."""
    m = _NAME.match(name)
    if m is None or not os.path.isdir("/proc"):
        return True
    st = _start_time(int(m.group(1)))
    if st is None:
        return False
    start, state = st
    return state != "Z" and (int(m.group(2)) in (0, start))


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink our regions whose creator is gone; the names removed. Never raises."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except OSError as e:
        logger.debug("cannot list %s: %s", shm_dir, e)
        return removed
    for name in names:
        if creator_alive(name):
            continue
        try:
            size = os.stat(os.path.join(shm_dir, name)).st_size
            os.unlink(os.path.join(shm_dir, name))
        except OSError:  # gone already (another client swept it) or not ours to remove
            continue
        removed.append(name)
        # INFO: the sweep doing its job after a crash (whatever killed that host was the event to report)
        logger.info("removed stale DPU destination region %s (%.0f MiB; creator gone)", name, size / 2**20)
    return removed


def run_dir() -> str:
    """A fresh private (0700) run directory for a data plane of this process (named like a region)."""
    path = os.path.join(tempfile.gettempdir(), region_name())
    os.mkdir(path, 0o700)
    return path


def sweep_stale_dirs(parent: str | None = None) -> list[str]:
    """Remove our run directories whose creator is gone; the paths removed. Never raises."""
    parent = parent or tempfile.gettempdir()
    try:
        stale = [
            os.path.join(parent, n)
            for n in os.listdir(parent)
            if _NAME.match(n) and os.path.isdir(os.path.join(parent, n)) and not creator_alive(n)
        ]
    except OSError as e:
        logger.debug("cannot list %s: %s", parent, e)
        return []
    removed = []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d stale data-plane run directories", len(removed))
    return removed


def is_region_name(name: str) -> bool:
    """``name`` (without a leading ``/``) has the pattern of a DPU client's destination region."""
    return _NAME.match(name) is not None
