"""Faults injected from outside the job, as on a cluster: a network namespace per rank on a
bridge with one rank's egress shaped (``tc ... tbf``), a CPU quota cut through cgroup v1's
``cpu`` controller, SIGSTOP/SIGCONT. Each is a context manager that leaves nothing behind
(namespaces, bridge, cgroup, a stopped process), also when the trial fails.

Addresses: 10.213.0.0/24 inside namespaces this module creates, the bridge in a namespace of
its own ("switch"): nothing is added to the machine's own network namespace.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
SUBNET = "10.213.0"
CFS_PERIOD_US = 100_000


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def can_inject() -> str | None:
    """Why faults cannot be injected here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"no `{tool}` (iproute2)"
    return None


class Network:
    """``world`` namespaces, one per rank, each with a veth whose peer sits on a bridge in a
    switch namespace. ``prefix(r)`` runs a command inside rank r's namespace; ``shape``
    limits a rank's egress with a token bucket (``tbf``: netem is not available)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.tag = "cvf" + secrets.token_hex(3)       # 9 chars: veth names stay under 16
        self.switch = f"{self.tag}sw"
        self.made: list[str] = []

    def ns(self, rank: int) -> str:
        return f"{self.tag}r{rank}"

    def ifname(self, rank: int) -> str:
        return f"{self.tag}v{rank}"

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(rank)]

    def __enter__(self) -> Network:
        try:
            _run("ip", "netns", "add", self.switch)
            self.made.append(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for r in range(self.world):
                ns, veth, peer = self.ns(r), self.ifname(r), f"{self.tag}p{r}"
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
                _run("ip", "-n", ns, "link", "add", veth, "type", "veth", "peer", "name", peer,
                     "netns", self.switch)
                _run("ip", "-n", self.switch, "link", "set", peer, "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", veth)
                _run("ip", "-n", ns, "link", "set", veth, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, ranks: list[int], rate_mbit: float) -> None:
        """Each of ``ranks``' egress at ``rate_mbit``, all at once (one ``tc`` each, side by
        side: shaped one after the other, the first would be the one slow link for a while): a
        token bucket with a queue long enough that nothing is dropped (a drop costs TCP a
        200 ms retransmit, not a slower link)."""
        procs = [subprocess.Popen(["ip", "netns", "exec", self.ns(r), "tc", "qdisc", "replace",
                                   "dev", self.ifname(r), "root", "tbf", "rate",
                                   f"{rate_mbit}mbit", "burst", "32kb", "limit", "16mb"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in ranks]
        errors = [p.communicate()[1] for p in procs if p.wait()]
        if errors:
            raise RuntimeError(f"tc tbf: {errors[0].decode().strip()}")

    def overlimits(self, rank: int) -> int:
        """Packets rank's shaper held back for want of tokens (0: the shaping never bit)."""
        out = subprocess.run(["ip", "netns", "exec", self.ns(rank), "tc", "-s", "qdisc", "show",
                              "dev", self.ifname(rank)], capture_output=True, text=True).stdout
        words = out.replace(",", " ").replace(")", " ").split()
        return sum(int(words[i + 1]) for i, w in enumerate(words) if w == "overlimits")

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self.made):             # a namespace's veths go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


class CpuQuota:
    """A cgroup v1 ``cpu`` group the given processes join at once; ``cut`` sets its CFS
    quota (a share of one CPU) from then on. On exit the processes still alive go back to the
    root group and the group is removed."""

    def __init__(self, pids: list[int]) -> None:
        self.path = CGROUP_CPU / f"cvf-{secrets.token_hex(3)}"
        self.pids = pids

    def __enter__(self) -> CpuQuota:
        self.path.mkdir()
        try:
            for pid in self.pids:
                (self.path / "cgroup.procs").write_text(str(pid))
        except BaseException:
            self.__exit__()
            raise
        return self

    def cut(self, share: float) -> None:
        (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(CFS_PERIOD_US * share)))

    def throttled(self) -> int:
        """Periods the group was throttled in (0: the quota never bit)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("nr_throttled", 0))

    def __exit__(self, *exc: object) -> None:
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
            except OSError:                      # gone meanwhile
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:                      # a task still leaving
                time.sleep(0.02)


class Pauser(threading.Thread):
    """SIGSTOP ``pid`` for ``pause_s`` every ``every_s`` from ``start()`` on, until ``stop``
    (which always leaves it running). ``times``: when each pause began (wall ns)."""

    def __init__(self, pid: int, pause_s: float, every_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.pause_s, self.every_s = pid, pause_s, every_s
        self.times: list[int] = []
        self._done = threading.Event()

    def run(self) -> None:
        try:
            while not self._done.is_set():
                self.times.append(time.time_ns())
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.pause_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.every_s - self.pause_s)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._done.set()
        self.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
