"""While a job runs, every rank of its run dir asked for its stacks without stopping it
(``commviz.record.stacks.LIVE_SIGNAL``): those on this host directly, those on other nodes
through the run dir, which their node's ``commviz launch`` answers (``commviz.record.asking``).
``ask_every_rank`` waits for them and says which ranks gave their stacks and which did not, and
why not where it can tell. A rank that started but records nothing yet (importing torch,
joining the process group, building the c10d boundary kernel: a fresh node's first import takes
about 30 s) is told from the placement file its worker wrote first thing
(``review.analyses.placed``): since when, and whether its process still runs. ``commviz
status`` and a launch's hang watch judge the ranks with those stacks (``review.analyses.judge``).
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from commviz.merge.select import format_ranks
from commviz.record import asking, stacks
from commviz.review.analyses import placed
from commviz.review.analyses.exits import log_dir
from commviz.trace.run import Run

DEFAULT_WAIT_S = 5.0
POLL_S = 0.1                   # how often the stacks and the answers are looked for


@dataclass
class Asked:
    """Who was asked for stacks, by whom, and what came back."""

    wait_s: float
    here: list[int]                                       # signalled from this process
    wrote_here: set[int]
    answered: list[asking.AnswerFile] = field(default_factory=list)   # launches that asked some
    silent: dict[tuple[int, str], list[int]] = field(default_factory=dict)  # (node, host): ranks
    unanswered: dict[str, list[int]] = field(default_factory=dict)   # host -> ranks no launch took
    absent: list[int] = field(default_factory=list)       # ranks with no live stacks file here
    starting: list[Starting] = field(default_factory=list)   # started, not recording yet
    problems: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        """Every rank asked, here or by its node's launch."""
        return sorted(set(self.here) | {r for a in self.answered for r in a["signalled"]})

    def render(self, run_dir: Path) -> str:
        return "\n".join([f"commviz status: {run_dir}", *self.lines()]) + "\n"

    def lines(self) -> list[str]:
        """Who was asked where, and which ranks or nodes did not answer."""
        lines = []
        if self.here:
            lines.append(f"  stacks asked here of ranks {format_ranks(self.here)}"
                         + _not_written(self.here, self.wrote_here))
        elif not any(s.here for s in self.starting):
            lines.append("  no rank of it runs on this host")
        lines += [s.line() for s in self.starting]
        for a in self.answered:
            lines.append(f"  node {a['node']} ({a['host']}, ranks {format_ranks(a['ranks'])}): "
                         f"its launch asked ranks {format_ranks(a['signalled']) or 'none'}"
                         + _not_written(a["signalled"], set(a["written"])))
            gone = sorted(set(a["ranks"]) - set(a["signalled"]) - set(self.here))
            if gone:
                lines.append(f"    ranks {format_ranks(gone)}: no process of theirs on "
                             f"{a['host']} (ended?)")
        for (node, host), ranks in sorted(self.silent.items()):
            lines.append(f"  node {node} ({host}, ranks {format_ranks(ranks)}): no answer in "
                         f"{self.wait_s:g} s: its launch is gone or stuck")
        for host, ranks in sorted(self.unanswered.items()):
            lines.append(f"  ranks {format_ranks(ranks)} on {host}: no answer in "
                         f"{self.wait_s:g} s: no commviz launch of this run dir runs there "
                         "(plain torchrun? a run dir not shared with this one?)")
        if self.absent:
            lines.append(f"  ranks {format_ranks(self.absent)}: no live stacks file in this run "
                         "dir (not started, or ended; or their node's run dir is not this one)")
        lines += [f"  problem: {p}" for p in self.problems]
        return lines


@dataclass
class Starting:
    """Ranks of one host that started but record nothing yet (no record, no stacks file)."""

    host: str
    here: bool                     # on this host (then whether each still runs is known)
    ranks: list[int]
    pids: list[int]
    since_ns: int | None           # the earliest of their processes' starts
    gone: bool = False             # here: their processes no longer run

    def line(self) -> str:
        pids = f", pid(s) {', '.join(map(str, self.pids))}" if self.here and self.pids else ""
        since = "" if self.since_ns is None else (
            f" {max(0, time.time_ns() - self.since_ns) / 1e9:.0f} s ago (at "
            f"{time.strftime('%H:%M:%S', time.localtime(self.since_ns / 1e9))})")
        head = f"  ranks {format_ranks(self.ranks)} on {self.host}{pids}: started{since}"
        if self.gone:
            return head + "; their process is gone, and left no record"
        return head + (", not recording yet (no record or stacks file: importing torch, "
                       "joining the process group, or building commviz's c10d boundary kernel)")


def starting(placements: list[placed.Placement], run: Run, live: set[int]) -> list[Starting]:
    """The ranks whose workers wrote their placement (``commviz launch``) but no record and no
    live stacks file yet, per host, those still running apart from those gone."""
    here = socket.gethostname()
    by: dict[tuple[str, bool], list[placed.Placement]] = defaultdict(list)
    for p in placements:
        ri = run.ranks.get(p.rank)
        if p.rank not in live and (ri is None or ri.record is None):
            by[p.host, p.host == here and not placed.alive(p)].append(p)
    return [Starting(host=host, here=host == here, ranks=[p.rank for p in ps],
                     pids=[p.pid for p in ps if p.pid is not None],
                     since_ns=min((p.started_ns for p in ps if p.started_ns), default=None),
                     gone=gone)
            for (host, gone), ps in sorted(by.items())]


def _not_written(asked: list[int], wrote: set[int]) -> str:
    missing = sorted(set(asked) - wrote)
    return f"; ranks {format_ranks(missing)} wrote no stacks in time" if missing else ""


def ask_every_rank(run_dir: Path, run: Run, wait_s: float) -> Asked:
    """Signal this host's ranks, ask the other nodes' launches for theirs (when some rank runs
    elsewhere), and wait until every rank asked here wrote its stacks and every other rank's
    launch answered, or ``wait_s`` passed."""
    live = stacks.live_pids(run_dir)
    dumps = stacks.Dumps(run_dir, live)
    here = stacks.signal_here(run_dir)
    elsewhere = set(live) - set(here)
    token = asking.ask(run_dir, here) if elsewhere else None
    deadline = time.monotonic() + wait_s
    while True:
        wrote = dumps.poll(here)
        found, problems = asking.answers(run_dir) if token else ([], [])
        answered = [a for a in found if a["token"] == token]
        taken = {r for a in answered for r in a["ranks"]}
        if (wrote == set(here) and elsewhere <= taken) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    quiet = {a["host"]: a["node"] for a in found if a["token"] != token}   # launches, by host
    hosts = {r: str((ri.record or {}).get("host") or "?") for r, ri in run.ranks.items()}
    silent: dict[tuple[int, str], list[int]] = defaultdict(list)
    unanswered: dict[str, list[int]] = defaultdict(list)
    for r in sorted(elsewhere - taken):
        host = hosts.get(r, "?")
        if host in quiet:
            silent[quiet[host], host].append(r)
        else:
            unanswered[host].append(r)
    placements = placed.read_all(log_dir(run_dir))
    begun = starting(placements, run, set(live))
    size = run.world_size or max((p.world_size or 0 for p in placements), default=0)
    told = set(live) | {r for s in begun for r in s.ranks}
    return Asked(wait_s=wait_s, here=here, wrote_here=wrote,
                 answered=[a for a in answered if set(a["ranks"]) & elsewhere],
                 silent=dict(silent), unanswered=dict(unanswered),
                 absent=sorted(set(range(size)) - told), starting=begun, problems=problems)
