"""Names of the DPU client's shared-memory destination regions, and the sweep of stale ones.

A region (128 MiB+) is unlinked by ``DpuClient.close`` or, when only the host died, by its data plane;
when both die at once (SIGKILL of the server's process group, the OOM killer) nobody does and the
segment stays in /dev/shm until reboot. So every region is named after its creator:
``srkv-dpu-<pid>-<start time>-<random>`` (start time: field 22 of ``/proc/<pid>/stat``, in clock ticks
since boot, so a recycled pid is not mistaken for the creator), and ``sweep_stale`` -- run by every
``DpuClient.start`` -- unlinks the regions whose creator is gone. It never touches a name of another
pattern, nor a region whose creator is alive (or cannot be checked: no /proc).

Threads: pure functions; ``sweep_stale`` runs on the thread calling ``DpuClient.start``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets

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
        logger.warning("removed stale DPU destination region %s (%.0f MiB; creator gone)", name, size / 2**20)
    return removed
