"""One seeded fault trial: a real gloo job (``faults/job.py``) recorded by commviz, a fault
injected at a seed-chosen rank and onset, and commviz's own live path (``commviz watch``'s
``Watcher``, one window every ``WINDOW_S``) read window by window while it runs; then scored
against the planted fault (never against commviz's output).

A trial's outcome (``Outcome``): *right* when the planted rank (or, for a pipeline link, the
sender and receiver) is named with the planted cause within ``DEADLINE`` windows of the onset's
window and nobody else is named; *wrong* when someone else, or the right rank with another
cause, is named after the onset; *missed* when nobody is named by the deadline; a name before
the onset, or any name in a trial with no fault, is a *false name* (its trial *false*).
"""

from __future__ import annotations

import enum
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import orjson

from commviz.live import series
from commviz.live.watch import Watcher

from faults.inject import CpuQuota, Network, Pauser

JOB = Path(__file__).with_name("job.py")
WORLD = 4
WINDOW_S = 1.0
DEADLINE = 2                  # windows after the onset's window a fault must be named in
ONSET_S = (1.6, 2.6)          # the onset, seconds after every rank made its first step
READY_TIMEOUT_S = 90.0
SHAPED_MBIT = 40              # a shaped link: 256 KiB in ~50 ms instead of < 1 ms
CPU_SHARE = 0.1               # the slow rank's CPU quota: a tenth of one CPU
PAUSE_S, PAUSE_EVERY_S = 0.3, 2.0
P2P_LINK = "p2p_link"         # a pipeline link's cause: "rank" sends, "peer" receives
LATE = "late"                 # also the cause of a line that gives none (kept before causes)


class Name(NamedTuple):
    """Who a window names and why: a rank, or a pipeline link's (sender, receiver)."""

    who: int | tuple[int, int]
    cause: str


@dataclass(frozen=True)
class Kind:
    """A kind of fault: the workload it runs in, whether the ranks get network namespaces,
    and the cause commviz should give (None: nobody should be named)."""

    name: str
    workload: str
    netns: bool
    cause: str | None
    what: str


KINDS = {k.name: k for k in (
    Kind("late", "mesh", False, LATE, "one rank sleeps 20 ms before its DP all_reduce"),
    Kind("compute", "ddp", False, LATE, "one DDP rank's CPU quota cut to 0.1 CPU (cgroup)"),
    Kind("link", "mesh", True, "transfer", "one rank's egress shaped to 40 Mbit/s (tbf)"),
    Kind("pause", "mesh", False, "pause", "one rank SIGSTOPped 300 ms every 2 s"),
    Kind("stage", "pipe", True, P2P_LINK, "one pipeline stage's egress shaped to 40 Mbit/s"),
    Kind("healthy", "mesh", True, None, "no fault"),
    Kind("jitter", "mesh", False, None, "one rank sleeps 60 ms once"),
    Kind("shaped", "mesh", True, None, "every rank's egress shaped alike to 40 Mbit/s"),
)}


class Outcome(enum.Enum):
    RIGHT = "right"
    WRONG = "wrong"
    MISSED = "missed"
    FALSE = "false"            # someone named before the onset, or with no fault planted
    CLEAN = "clean"            # no fault planted, nobody named


@dataclass
class Plan:
    """What the seed chose."""

    kind: Kind
    seed: int
    rank: int                  # the faulty rank (the sender, for a pipeline link)
    onset_s: float             # after the job is warm (in-program faults: a step, below)
    step: int                  # the step an in-program sleep begins at

    @classmethod
    def of(cls, kind: Kind, seed: int) -> Plan:
        ranks = WORLD - 1 if kind.workload == "pipe" else WORLD
        rng = random.Random(f"{kind.name}:{seed}")
        first = random.Random(kind.name).randrange(ranks)    # consecutive seeds: every rank
        return cls(kind, seed, (first + seed) % ranks, rng.uniform(*ONSET_S),
                   rng.randrange(120, 200))

    @property
    def expected(self) -> Name | None:
        if self.kind.cause is None:
            return None
        who = (self.rank, self.rank + 1) if self.kind.workload == "pipe" else self.rank
        return Name(who, self.kind.cause)


@dataclass
class Result:
    plan: Plan
    outcome: Outcome
    latency: int | None                     # windows after the onset's window, when right
    onset_window: int | None
    injected: bool = False                  # the kernel shows the fault took hold
    bad_window: int | None = None           # the first window with a wrong or false name
    windows: list[dict[str, Any]] = field(default_factory=list)
    false_names: list[Name] = field(default_factory=list)   # before the onset, or none planted
    wrong_names: list[Name] = field(default_factory=list)


def names(window: dict[str, Any]) -> set[Name]:
    """Who a window of ``commviz watch --format json`` names, and why."""
    return {Name((s["rank"], s["peer"]) if s.get("cause") == P2P_LINK else s["rank"],
                 s.get("cause", LATE)) for s in window["stragglers"]}


def score(plan: Plan, windows: list[dict[str, Any]], onset_ns: int | None) -> Result:
    """Score the windows against the plan (``onset_ns``: when the fault began; None: it
    never did, or none was planted)."""
    expected = plan.expected
    onset_w = next((i for i, w in enumerate(windows) if onset_ns is not None
                    and w["end_ns"] > onset_ns), None)
    res = Result(plan, Outcome.CLEAN, None, onset_w, windows=windows)
    for i, w in enumerate(windows):
        for n in sorted(names(w), key=str):
            if expected is None or onset_w is None or i < onset_w:
                res.false_names.append(n)
            elif n == expected:
                if res.latency is None:
                    res.latency = i - onset_w
                continue
            else:
                res.wrong_names.append(n)
            if res.bad_window is None:
                res.bad_window = i
    if expected is None:
        res.outcome = Outcome.FALSE if res.false_names else Outcome.CLEAN
    elif res.wrong_names:
        res.outcome = Outcome.WRONG
    elif res.false_names:
        res.outcome = Outcome.FALSE
    elif res.latency is not None and res.latency <= DEADLINE:
        res.outcome = Outcome.RIGHT
    else:
        res.outcome = Outcome.MISSED
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """``job.py --serve``: torch imported once, each rank a fork of it (``job.serve``). One
    launcher serves every trial of a bench or a test module."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(JOB), "--serve"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))

    def start(self, argv: list[str], ranks: list[dict[str, Any]]) -> list[int]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"argv": argv, "ranks": ranks}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{JOB} --serve ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class Job:
    """The job's ranks, each with the env torchrun would give it (in its own network
    namespace when there is a ``net``), each leading a session of its own, killed on exit."""

    def __init__(self, launcher: Launcher, run_dir: Path, plan: Plan,
                 net: Network | None) -> None:
        self.launcher, self.run_dir, self.plan, self.net = launcher, run_dir, plan, net
        self.pids: list[int] = []

    def __enter__(self) -> Job:
        kind, plan = self.plan.kind, self.plan
        argv = [str(self.run_dir), kind.workload]
        if kind.name in ("late", "jitter"):
            argv += [f"--{kind.name}", str(plan.rank), str(plan.step)]
        port = 29500 if self.net else _free_port()
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True)
        ranks = []
        for r in range(WORLD):
            env = {"RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r),
                   "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_PORT": str(port),
                   "MASTER_ADDR": self.net.addr(0) if self.net else "127.0.0.1"}
            if self.net:
                env["GLOO_SOCKET_IFNAME"] = self.net.ifname(r)
            ranks.append({"env": env, "netns": self.net.ns(r) if self.net else None,
                          "log": str(logs / f"rank{r}.txt")})
        self.pids = self.launcher.start(argv, ranks)
        return self

    def wait_ready(self) -> None:
        end = time.monotonic() + READY_TIMEOUT_S
        while not all((self.run_dir / f"ready_rank{r}").exists() for r in range(WORLD)):
            dead = [r for r, pid in enumerate(self.pids) if not _alive(pid)]
            if dead or time.monotonic() > end:
                log = (self.run_dir / "logs" / f"rank{(dead or [0])[0]}.txt").read_text()
                raise RuntimeError(f"ranks {dead or 'all'} not ready: {log[-2000:]}")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 30
        while any(map(_alive, self.pids)) and time.monotonic() < end:
            time.sleep(0.01)


def _onset(plan: Plan, job: Job, stack: ExitStack) -> Callable[[], bool]:
    """Inject the plan's external fault now (in-program ones began at their step); returns
    whether it took hold, read from the kernel (the shaper's overlimits, the cgroup's
    throttled periods, the pauses sent), to be asked before the trial is torn down."""
    kind, pid, net = plan.kind.name, job.pids[plan.rank], job.net
    if kind == "compute":
        quota = stack.enter_context(CpuQuota([pid]))
        quota.cut(CPU_SHARE)
        return lambda: quota.throttled() > 0
    if kind in ("link", "stage", "shaped"):
        shaped = list(range(WORLD)) if kind == "shaped" else [plan.rank]
        net.shape(shaped, SHAPED_MBIT)
        return lambda: all(net.overlimits(r) > 0 for r in shaped)
    if kind == "pause":
        pauser = Pauser(pid, PAUSE_S, PAUSE_EVERY_S)
        stack.callback(pauser.stop)
        pauser.start()
        return lambda: bool(pauser.times)
    return lambda: True


def _planted_at(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / "fault.json").read_text())["time_ns"]
    except (FileNotFoundError, ValueError):
        return None


def run(launcher: Launcher, kind: str, seed: int, run_dir: Path, after: int = DEADLINE
          ) -> Result:
    """Run one trial into ``run_dir`` (created) and score it; it ends ``after`` windows
    after the onset's window."""
    plan = Plan.of(KINDS[kind], seed)
    external = plan.kind.name not in ("late", "jitter", "healthy")
    onset_ns: int | None = None
    windows: list[dict[str, Any]] = []
    took: Callable[[], bool] = lambda: onset_ns is not None
    with ExitStack() as stack:
        net = stack.enter_context(Network(WORLD)) if plan.kind.netns else None
        job = stack.enter_context(Job(launcher, run_dir, plan, net))
        job.wait_ready()
        watcher = Watcher(run_dir, keep=False)
        start = time.monotonic()
        inject_at = start + plan.onset_s
        tick = start
        while True:
            tick += WINDOW_S
            if external and onset_ns is None and inject_at < tick:
                time.sleep(max(0.0, inject_at - time.monotonic()))
                onset_ns = time.time_ns()
                took = _onset(plan, job, stack)
            time.sleep(max(0.0, tick - time.monotonic()))
            windows.append(orjson.loads(orjson.dumps(series.to_file(watcher.step()))))
            if onset_ns is None and not external:
                onset_ns = _planted_at(run_dir)
                if plan.kind.name == "healthy" and time.monotonic() >= inject_at:
                    onset_ns = time.time_ns()    # no fault: the windows it would have had
            if onset_ns is not None and windows[-1]["end_ns"] > onset_ns:
                seen = sum(w["end_ns"] > onset_ns for w in windows)
                if seen > after:
                    break
            if len(windows) > 20:
                raise RuntimeError(f"{kind} seed {seed}: no onset after 20 windows")
        injected = took()
    res = score(plan, windows, onset_ns)
    res.injected = injected
    return res
