"""Putting every rank on one clock: rank 0's wall clock (the merged clock).

Ranks on one host share the wall clock: no shift. Across hosts a rank's shift is the offset
commviz measured over the process group when it recorded (``record["clock"]``). A rank on
another host without a measured offset (a plain profiler directory, an old record) gets one
derived from collective end times: the ranks of a collective leave it at about the same moment
(the last arrival releases everyone), so the median difference of end times of the instances
it shares with an aligned rank is its offset. What was used for each rank is reported.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

from commviz.match.artifact import Clock, RankArtifact
from commviz.trace.run import Run

SAME_HOST, MEASURED, DERIVED, NONE = "same-host", "measured", "derived", "none"
PENDING = "pending"                   # on its own clock until derived from collective ends


@dataclass
class ClockPlan:
    offsets: dict[int, int] = field(default_factory=dict)      # ns added to the rank's times
    sources: dict[int, str] = field(default_factory=dict)      # how each offset was found
    pending: list[int] = field(default_factory=list)           # ranks still to derive

    def clock(self, rank: int) -> Clock:
        """The rank's clock as known now (a pending rank stays on its own until derived)."""
        if rank in self.pending or rank not in self.offsets:
            return Clock(0, PENDING)
        return Clock(self.offsets[rank], self.sources[rank])

    def describe(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank, source in sorted(self.sources.items()):
            groups.setdefault(source, []).append(rank)
        return "; ".join(f"{source}: ranks {ranks}" for source, ranks in groups.items())


def plan_clock(run: Run) -> ClockPlan:
    """Offsets from hosts and records; ranks that need deriving are left in ``pending``."""
    plan = ClockPlan()
    hosts = {rank: inp.host for rank, inp in run.ranks.items()}
    ref = min(run.ranks) if run.ranks else 0
    for rank, inp in sorted(run.ranks.items()):
        clock = (inp.record or {}).get("clock") or {}
        recorded = int(clock.get("offset_ns") or 0)
        if len({h for h in hosts.values() if h}) <= 1 or hosts[rank] == hosts.get(ref):
            plan.offsets[rank], plan.sources[rank] = recorded, SAME_HOST
        elif clock.get("offset_source") in (MEASURED, SAME_HOST):
            plan.offsets[rank], plan.sources[rank] = recorded, clock["offset_source"]
        else:
            plan.pending.append(rank)
    return plan


def derive(plan: ClockPlan, ends: dict[int, dict[tuple, int]]) -> list[str]:
    """Fill the pending ranks from collective end times (``ends[rank][instance key]``, ns on
    the rank's own clock for pending ranks and on the merged clock for the others).

    Each instance's reference end is the median of its ends on the aligned ranks; a pending
    rank's offset is the median over its instances of reference minus own end. A rank that
    shares nothing with the aligned ranks waits until a rank derived before it gives one of
    its instances a reference (its end, shifted onto the merged clock). Each rank's ends are
    read once or twice, whatever the number of ranks.

    Returns one problem per rank no offset could be derived for (it keeps offset 0).
    """
    aligned: dict[tuple, list[int]] = defaultdict(list)
    for other in plan.offsets:
        for key, end in ends.get(other, {}).items():
            aligned[key].append(end)
    reference = {key: statistics.median(found) for key, found in aligned.items()}
    waiting: dict[tuple, list[int]] = defaultdict(list)    # key -> pending ranks holding it
    queue = deque(plan.pending)
    while queue:
        rank = queue.popleft()
        if rank in plan.offsets:
            continue
        mine = ends.get(rank, {})
        diffs = [reference[key] - end for key, end in mine.items() if key in reference]
        if not diffs:
            for key in mine:
                waiting[key].append(rank)
            continue
        offset = plan.offsets[rank] = int(statistics.median(diffs))
        plan.sources[rank] = f"{DERIVED} ({len(diffs)} collective ends)"
        for key, end in mine.items():
            if key not in reference:
                reference[key] = end + offset
                queue.extend(waiting.pop(key, ()))
    problems = []
    for rank in plan.pending:
        if rank not in plan.offsets:
            plan.offsets[rank], plan.sources[rank] = 0, NONE
            problems.append(f"rank {rank}: on another host with no measured clock offset and "
                            "no collective shared with an aligned rank; its times are left as "
                            "recorded")
    plan.pending = []
    return problems


def align(plan: ClockPlan, ranks: dict[int, RankArtifact]) -> tuple[dict[int, RankArtifact],
                                                                    list[str]]:
    """Every rank on the merged clock: pending ranks' offsets derived from the others' ends
    (``derive``), then each artifact moved to its rank's clock (``RankArtifact.aligned``)."""
    problems: list[str] = []
    if plan.pending:
        ends = {rank: (art.own_ends() if rank in plan.pending else
                       {ev.key: ev.end_ns for ev in art.events if ev.key is not None})
                for rank, art in ranks.items()}
        problems = derive(plan, ends)
    return {rank: art.aligned(plan.clock(rank)) for rank, art in ranks.items()}, problems
