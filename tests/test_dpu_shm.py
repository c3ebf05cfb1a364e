"""What a host's destination region and its data plane's endpoint leave behind when processes die.

- A server's own data plane: the region is anonymous memory the child inherits and the endpoint's
  socket file is gone once the child accepted its host, so a host SIGKILLed together with its data plane
  (what ``Engine.shutdown`` and SGLang's SIGTERM path do: ``kill_process_tree``) leaves nothing in
  /dev/shm or the temp dir.
- A client of a data-plane service names its region in /dev/shm; when that host dies together with the
  service, the next ``DpuClient.start`` removes the region (a real process group is SIGKILLed), and
  only that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from dpu_helpers import CHUNK, FP, codecs

from sgl_remote_kv.contract import shm_names
from sgl_remote_kv.contract.settings import DataPlaneSettings
from sgl_remote_kv.contract.sizing import chunk_bytes
from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig

SHM = Path("/dev/shm")
_CREATOR = textwrap.dedent(
    """
    import sys, time
    from sgl_remote_kv.contract import shm_names
    from sgl_remote_kv.fetch.dpu_client.host_region import HostRegion
    r = HostRegion(1 << 20, shm_names.region_name(), named=True)  # a service's client
    print(r.name, flush=True)
    time.sleep(600)
    """
)


def _creator() -> tuple[subprocess.Popen, str]:
    """A process (own process group) holding a region; (process, region name)."""
    p = subprocess.Popen(
        [sys.executable, "-c", _CREATOR], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    name = p.stdout.readline().strip()
    assert name.startswith(shm_names.PREFIX) and (SHM / name).exists(), name
    return p, name


def test_stale_regions_of_killed_process_groups_are_swept(tmp_path):
    dead, dead_name = _creator()
    live, live_name = _creator()
    reused = f"{shm_names.PREFIX}{os.getpid()}-1-0badc0de"  # our pid, another start time: pid reuse
    foreign = [f"srkv-other-{os.getpid()}", f"{shm_names.PREFIX}not-ours", "psm_h6_test_foreign"]
    client = None
    try:
        for n in [reused, *foreign]:
            (SHM / n).write_bytes(b"x")
        os.killpg(dead.pid, signal.SIGKILL)  # creator and its resource tracker die together
        dead.wait(timeout=10)
        assert (SHM / dead_name).exists(), "nobody unlinks it when the whole group is killed"
        spec = DataPlaneSettings(workers=(1, 1, 1, 1), slots=1, slot_bytes=chunk_bytes(FP.layout, CHUNK))
        cfg = DpuClientConfig(f"file://{tmp_path}/store", 1, chunk_bytes(FP.layout, CHUNK), process=spec)
        client = DpuClient(cfg, FP, codecs()["lossless"])
        client.start()
        assert not (SHM / dead_name).exists(), "the stale region was not swept"
        assert not (SHM / reused).exists(), "a region of a recycled pid was not swept"
        assert (SHM / live_name).exists(), "a live creator's region was removed"
        assert all((SHM / n).exists() for n in foreign), "a foreign name was touched"
        own = client.dest.name.lstrip("/")
        assert own.startswith(f"{shm_names.PREFIX}{os.getpid()}-") and shm_names.creator_alive(own)
    finally:
        if client is not None:
            client.close()
        os.killpg(live.pid, signal.SIGKILL)
        live.wait(timeout=10)
        for n in [dead_name, live_name, reused, *foreign]:
            (SHM / n).unlink(missing_ok=True)


_HOST = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from dpu_helpers import CHUNK, FP, codecs
    from sgl_remote_kv.fetch.dpu_client.client import DpuClient, DpuClientConfig
    from sgl_remote_kv.contract.sizing import chunk_bytes
    from sgl_remote_kv.contract.settings import DataPlaneSettings
    spec = DataPlaneSettings(workers=(1, 1, 1, 1), slots=1, slot_bytes=chunk_bytes(FP.layout, CHUNK))
    cfg = DpuClientConfig(sys.argv[2], 1, chunk_bytes(FP.layout, CHUNK), process=spec)
    c = DpuClient(cfg, FP, codecs()["lossless"])
    c.start()
    print(c.pid, flush=True)
    time.sleep(600)
    """
)


def _created_by(pid: int) -> set[str]:
    """Entries in /dev/shm and the temp dir named after creator ``pid`` (regions, run directories)."""
    pattern = f"{shm_names.PREFIX}{pid}-*"
    return {str(p) for d in (SHM, Path(tempfile.gettempdir())) for p in d.glob(pattern)}


def test_a_host_killed_with_its_own_data_plane_leaves_nothing(tmp_path):
    host = subprocess.Popen(
        [sys.executable, "-c", _HOST, str(Path(__file__).parent), f"file://{tmp_path}/store"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        dp_pid = int(host.stdout.readline())
        assert dp_pid > 0 and Path(f"/proc/{dp_pid}").exists()
        assert _created_by(host.pid) == set(), "a running host and data plane have nothing on disk"
    finally:
        os.killpg(host.pid, signal.SIGKILL)  # host and data plane at once, as kill_process_tree does
        host.wait(timeout=10)
    assert _created_by(host.pid) == set()


def test_stale_run_directories_are_swept(tmp_path):
    """Run directories (a data plane's endpoint while it starts) of dead creators go; directories of live
    creators and of other names stay."""
    dead = 4_194_000  # above any pid this box hands out (pid_max 4194304 at most)
    stale = []
    for i in range(3):
        d = tmp_path / f"srkv-dpu-{dead + i}-12345-0000000{i}"
        d.mkdir()
        (d / "dp.sock").write_text("")
        stale.append(d)
    live = tmp_path / shm_names.region_name()
    live.mkdir()
    other = tmp_path / "srkv-dpu-notours"
    other.mkdir()
    removed = shm_names.sweep_stale_dirs(str(tmp_path))
    assert sorted(removed) == sorted(str(d) for d in stale)
    assert not any(d.exists() for d in stale) and live.exists() and other.exists()


def test_data_plane_unlinking_its_dead_hosts_region_prints_no_tracker_traceback():
    """The data plane attaches untracked; unlinking must not make the resource tracker print a KeyError
    traceback at exit (every stopped server used to leave one in the data-plane log)."""
    code = textwrap.dedent(
        """
        import subprocess, sys
        from sgl_remote_kv.contract import shm_names
        from sgl_remote_kv.fetch.dpu_client.host_region import HostRegion
        name = shm_names.region_name()
        r = HostRegion(1 << 16, name, named=True)
        child = '''
        import sys
        from sgl_remote_kv.dpu.buffers import DestRegion
        d = DestRegion.attach(sys.argv[1])
        d.unlink()
        d.close()
        '''
        out = subprocess.run([sys.executable, "-c", child, name], capture_output=True, text=True)
        print(out.returncode, out.stderr)
        r.close()
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("0 ") and "KeyError" not in res.stdout + res.stderr, res.stdout + res.stderr
