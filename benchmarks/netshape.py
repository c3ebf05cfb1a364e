"""Bandwidth-shaped links for benchmarks: a network namespace + a veth pair + ``tc tbf``.

``shaped_link(rate_mbit)`` creates ``srkv-<id>`` (a namespace) and a veth pair ``srkvh<id>`` (root
namespace side) / ``srkvn<id>`` (inside the namespace) on a private /30 (10.231.x.0/30). A server
started inside the namespace (``ip netns exec``) listening on ``link.ns_addr`` is reached from the
root namespace only through the veth, and its replies (the fetch direction) leave through the
namespace side's egress qdisc, which is a ``tbf`` at the chosen rate. ``shape_both=True`` also
shapes the root side (uploads). ``netem`` is absent on the reference machine, so there is no added
delay or loss here (FACTS §4).

Everything created is deleted on exit (also on error): deleting the namespace destroys its veth end
and with it the pair; the root side is deleted explicitly if it survived. Only our own namespace's
addresses are ever targeted. Needs root (CAP_NET_ADMIN); ``netns_supported()`` says whether it works
here, without leaving anything behind.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "srkv"
_COUNTER = itertools.count()


def _run(*cmd: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    r = subprocess.run(full, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_supported() -> tuple[bool, str]:
    """(True, "") if we may create namespaces, veths and tbf qdiscs here; else (False, reason)."""
    try:
        with shaped_link(100.0):
            return True, ""
    except (RuntimeError, OSError) as e:
        return False, str(e)


def tbf_burst_bytes(rate_mbit: float) -> int:
    """About 1 ms of traffic, at least 16 KiB (tbf segments larger GSO packets itself)."""
    return max(16 * 1024, int(rate_mbit * 1e6 / 8 / 1000))


@dataclass(frozen=True)
class ShapedLink:
    netns: str
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str

    def set_rate(self, rate_mbit: float | None, shape_both: bool = False) -> None:
        """Replace the tbf rate (``None``: remove shaping)."""
        targets = [(self.ns_if, self.netns)] + ([(self.host_if, None)] if shape_both else [])
        for dev, ns in targets:
            if rate_mbit is None:
                _run("tc", "qdisc", "del", "dev", dev, "root", netns=ns, check=False)
                continue
            burst = tbf_burst_bytes(rate_mbit)
            _run(
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "100ms",
                netns=ns,
            )

    def qdisc(self) -> str:
        return _run("tc", "-s", "qdisc", "show", "dev", self.ns_if, netns=self.netns).stdout


def _subnet_octet(ident: int) -> int:
    used = _run("ip", "-4", "-o", "addr").stdout
    for k in range(250):
        octet = (ident + k) % 250 + 1
        if f"10.231.{octet}." not in used:
            return octet
    raise RuntimeError("no free 10.231.x.0/30 subnet")


@contextlib.contextmanager
def shaped_link(rate_mbit: float | None, shape_both: bool = False) -> Iterator[ShapedLink]:
    """Create a namespace + veth pair shaped at ``rate_mbit`` (``None``: unshaped); delete on exit."""
    ident = (os.getpid() % 10000) * 100 + next(_COUNTER) % 100
    tag = f"{ident:06d}"
    netns, host_if, ns_if = f"{PREFIX}-{tag}", f"{PREFIX}h{tag}", f"{PREFIX}n{tag}"
    octet = _subnet_octet(ident)
    host_addr, ns_addr = f"10.231.{octet}.1", f"10.231.{octet}.2"
    link = ShapedLink(netns, host_if, ns_if, host_addr, ns_addr)
    try:
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", netns)
        _run("ip", "addr", "add", f"{host_addr}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "addr", "add", f"{ns_addr}/30", "dev", ns_if, netns=netns)
        _run("ip", "link", "set", ns_if, "up", netns=netns)
        _run("ip", "link", "set", "lo", "up", netns=netns)
        link.set_rate(rate_mbit, shape_both)
        yield link
    finally:
        _run("ip", "netns", "del", netns, check=False)
        if _run("ip", "link", "show", host_if, check=False).returncode == 0:
            _run("ip", "link", "del", host_if, check=False)
