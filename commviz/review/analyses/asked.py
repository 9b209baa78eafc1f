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


@dataclass
class Starting:
    """Ranks of one host that started but record nothing yet (no record, no stacks file)."""

    host: str
    here: bool                     # on this host (then whether each still runs is known)
    ranks: list[int]
    pids: list[int]
    since_ns: int | None           # the earliest of their processes' starts
    gone: bool = False             # here: their processes no longer run


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
