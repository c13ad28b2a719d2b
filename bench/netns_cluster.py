"""Two emulated nodes on one machine: two network namespaces joined by a veth pair whose bandwidth (and, where the
kernel has netem, latency) ``tc`` sets: the inter-node link of ``bench_hsdp_cluster.py``.

Each namespace has its own loopback (traffic between the ranks of one "node" stays on it: a packet to a local
address never leaves through the veth) and one end of the veth, 10.213.<k>.1 in node 0 and .2 in node 1, with
k from the process id so that concurrent runs never meet (the addresses exist only inside the two namespaces).
Shaping is on the egress of both ends (one direction each): ``tbf`` (token bucket: rate, a burst of 1 ms of the
rate, at least 64 KiB) and, when the kernel has it, ``netem`` for a one-way delay. Needs root and iproute2
(``ip``, ``tc``); :func:`unavailable` says why not, without changing anything. The namespaces (and the veth with
them) are removed by :meth:`EmulatedCluster.close`, also when the run fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def unavailable() -> Optional[str]:
    """Why two namespaces cannot be made here (not root, no iproute2), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (this process is not uid 0)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"iproute2 is missing: no {' or '.join(missing)} on PATH"
    probe = f"zxprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def parse_rate(text: str) -> Optional[float]:
    """'100mbit' / '1gbit' / '10gbit' -> bits per second; 'none' -> None (unshaped)."""
    text = text.strip().lower()
    if text in ("none", "unshaped", "0"):
        return None
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


class EmulatedCluster:
    """Namespaces ``names[0]`` and ``names[1]``, veth ends ``veths[i]`` with address ``addrs[i]`` in node i."""

    def __init__(self, tag: Optional[str] = None):
        tag = tag or str(os.getpid())
        k = 1 + os.getpid() % 250
        self.names = (f"zxn{tag}a", f"zxn{tag}b")
        self.vethw = (f"zxv{tag}a"[:15], f"zxv{tag}b"[:15])
        self.addrs = (f"10.213.{k}.1", f"10.213.{k}.2")
        self.netem = False  # whether the kernel took the delay
        self._made: list[str] = []
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
                self._made.append(name)
            _run("ip", "link", "add", self.vethw[0], "type", "veth", "peer", "name", self.vethw[1])
            for name, veth, addr in zip(self.names, self.vethw, self.addrs):
                _run("ip", "link", "set", veth, "netns", name)
                _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", veth)
                _run("ip", "-n", name, "link", "set", veth, "up")
                _run("ip", "-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node]]

    def shape(self, rate_bps: Optional[float], delay_s: float = 0.0) -> str:
        """Set both directions of the link to ``rate_bps`` (None: unshaped) and, with netem, ``delay_s`` one way.
        Returns the qdisc as ``tc`` shows it on node 0's end."""
        self.netem = False
        for name, veth in zip(self.names, self.vethw):
            _run("ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", veth, "root", check=False)
            if rate_bps is None and not delay_s:
                continue
            tbf = []
            if rate_bps is not None:
                burst = max(64 * 1024, int(rate_bps / 8 * 1e-3))
                tbf = ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "200ms"]
            if delay_s:
                netem = ["netem", "delay", f"{delay_s * 1e6:.0f}us"]
                done = _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", veth, "root", "handle", "1:",
                            *netem, check=False)  # fmt: skip
                if done.returncode == 0:
                    self.netem = True
                    if tbf:
                        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", veth, "parent", "1:1",
                             "handle", "10:", *tbf)  # fmt: skip
                    continue
            if tbf:
                _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", veth, "root", *tbf)
        return _run("ip", "netns", "exec", self.names[0], "tc", "qdisc", "show", "dev", self.vethw[0]).stdout.strip()

    def close(self) -> None:
        """Remove both namespaces (the veth goes with them); safe to call twice."""
        while self._made:
            _run("ip", "netns", "del", self._made.pop(), check=False)

    def __enter__(self) -> "EmulatedCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tx_bytes(veth: str) -> int:
    """Bytes sent through ``veth`` so far, read inside its namespace (``ip netns exec`` mounts that namespace's
    sysfs): what crossed the emulated inter-node link in this direction."""
    try:
        with open(f"/sys/class/net/{veth}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1
