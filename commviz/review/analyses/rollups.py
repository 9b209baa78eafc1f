"""The report's roll-ups of the cross-rank instances (``commviz.merge.instances``): per
process group, per rank, and per (group, op, size), each listing what cost the most time first.

Waits here are the time ranks spent waiting for a late or missing rank; a pipeline schedule's
transfers are counted but their waits are its bubbles (``review.analyses.pipeline``), left out.
A rank missing from an instance that the others waited in held them up for as long as the
longest of them waited, unless it was itself held at the time (inside a call that never
completed, begun before that instance's last arrival): it then only passed the wait on. The
rank of a pipeline's slowest stage held the other stages up for as long as they waited for it.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from commviz import metadata as md
from commviz.match.artifact import PgInfo
from commviz.merge.instances import Instance, held
from commviz.review.analyses.pipeline import StageWaits, slowest


@dataclass(slots=True)
class GroupSummary:
    pg: str
    desc: str
    ranks: tuple[int, ...]        # the group's own, as torch lists them
    count: int
    pipeline: int                 # of which transfers of a pipeline schedule
    span_ns: int                  # sum of instance spans
    comm_ns: int                  # sum of comm times (bandwidth time)
    wait_ns: int                  # sum over instances and ranks of the time spent waiting
    max_skew_ns: int | None       # None: only pipeline transfers
    median_skew_ns: int | None
    stragglers: dict[int, tuple[int, int]]   # rank -> (times straggler, skew it caused in ns)
    measured: int = 0             # instances with a comm time: a kernel or a CPU span that waited
    launch_only: dict[str, int] = field(default_factory=dict)   # why (LaunchOnly) -> instances
    measured_bytes: int = 0       # the bytes of the measured instances ...
    launch_only_bytes: int = 0    # ... and of the launch-only ones (whose time is not known)

    @property
    def title(self) -> str:
        return md.group_title(self.pg, self.desc, self.ranks)

    @property
    def unmeasured(self) -> int:
        """Instances with no comm time: launch only, failed, or missing a rank."""
        return self.count - self.measured


@dataclass(slots=True)
class RankSummary:
    rank: int
    count: int
    busy_ns: int                  # sum of this rank's call durations
    wait_ns: int                  # of which spent waiting for a later rank
    late: int                     # times this rank was the straggler
    caused_ns: int                # skew of the instances it straggled, waits it was missing from
    missing: int                  # instances of its groups it did not take part in
    slow_stage: int | None = None  # the pipeline's slowest stage, when it runs here


def wait_ns(inst: Instance) -> int:
    """What the ranks waited in ``inst`` for a late or missing rank (a pipeline's bubble: 0)."""
    return 0 if inst.pipeline else inst.total_wait_ns


def group_summaries(instances: list[Instance], pgs: dict[str, PgInfo] | None = None
                    ) -> list[GroupSummary]:
    """Per process group, the most waiting first; ``pgs``: each group's description and ranks
    as its records and the profiler have them (a group's instances may hold only some of its
    ranks: a transfer has two)."""
    by_pg: dict[str, list[Instance]] = defaultdict(list)
    for inst in instances:
        by_pg[inst.pg].append(inst)
    out = []
    for pg, insts in by_pg.items():
        strag: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for i in insts:
            if i.straggler is not None:
                strag[i.straggler][0] += 1
                strag[i.straggler][1] += i.skew_ns
        skews = [i.skew_ns for i in insts if not i.pipeline]
        info = (pgs or {}).get(pg)
        ranks = (md.group_ranks(info.ranks) if info is not None else ()) or \
            max((i.ranks for i in insts), key=len)
        desc = info.desc if info is not None and info.desc else insts[0].pg_desc
        measured = [i for i in insts if i.comm_ns is not None]
        launch = [i for i in insts if launch_only(i)]
        out.append(GroupSummary(
            pg=pg, desc=desc, ranks=ranks, count=len(insts),
            pipeline=sum(i.pipeline for i in insts),
            span_ns=sum(i.span_ns for i in insts), comm_ns=sum(i.comm_ns or 0 for i in insts),
            wait_ns=sum(wait_ns(i) for i in insts), max_skew_ns=max(skews, default=None),
            median_skew_ns=int(statistics.median(skews)) if skews else None,
            stragglers={r: (c, s) for r, (c, s) in sorted(strag.items(),
                                                          key=lambda kv: -kv[1][1])},
            measured=len(measured), launch_only=dict(Counter(str(i.launch_reason) for i in launch)),
            measured_bytes=sum(i.size_bytes or 0 for i in measured),
            launch_only_bytes=sum(i.size_bytes or 0 for i in launch)))
    out.sort(key=lambda g: (-g.wait_ns, g.pg))
    return out


def launch_only(inst: Instance) -> bool:
    """Whether an instance is counted as launch only: its spans cover only the launch, and it
    neither failed nor missed a rank (those are counted as such)."""
    return inst.launch_only and not inst.failed and not inst.missing


def rank_summaries(instances: list[Instance], pipeline: list[StageWaits] | None = None
                   ) -> list[RankSummary]:
    """Per rank, the rank that made others wait longest first (``pipeline``: its stages; the
    other stages' waits for the slowest one count as held up by its rank)."""
    rows: dict[int, RankSummary] = {}

    def row(rank: int) -> RankSummary:
        if rank not in rows:
            rows[rank] = RankSummary(rank, 0, 0, 0, 0, 0, 0)
        return rows[rank]

    stuck_since: dict[int, int] = {}      # rank -> when it entered a call it never completed
    for inst in instances:
        for rank, ev in inst.events.items():
            if held(ev):
                stuck_since[rank] = min(stuck_since.get(rank, ev.start_ns), ev.start_ns)
    for inst in instances:
        for rank, ev in inst.events.items():
            r = row(rank)
            r.count += 1
            r.busy_ns += ev.duration_ns
            r.wait_ns += 0 if inst.pipeline else inst.wait_ns[rank]
        if inst.straggler is not None:
            r = row(inst.straggler)
            r.late += 1
            r.caused_ns += inst.skew_ns
        longest = max(inst.wait_ns.values(), default=0)
        for rank in inst.missing:
            r = row(rank)
            r.missing += 1
            if stuck_since.get(rank, inst.last_start_ns + 1) > inst.last_start_ns:
                r.caused_ns += longest
    slow = slowest(pipeline or [])
    if slow is not None:
        r = row(slow.rank)
        r.slow_stage, r.caused_ns = slow.stage, r.caused_ns + slow.waited_on_ns
    return sorted(rows.values(), key=lambda r: (-r.caused_ns, -r.wait_ns, r.rank))


@dataclass(slots=True)
class CollectiveSummary:
    """Instances of one type and size in one group: how often, how long, how fast."""

    pg: str
    ctype: str
    op: str
    size_bytes: int | None
    count: int
    comm_ns: int
    wait_ns: int
    median_comm_ns: int | None
    median_algbw: float | None
    median_busbw: float | None
    launch_only: int = 0          # instances whose spans cover only the launch (no comm time)
    failed: int = 0               # instances that raised on some rank
    incomplete: int = 0           # instances some rank never joined (not failed)


def collective_summaries(instances: list[Instance]) -> list[CollectiveSummary]:
    """Per (group, op, size), the most time (comm + wait) first."""
    groups: dict[tuple, list[Instance]] = defaultdict(list)
    for inst in instances:
        groups[(inst.pg, inst.op, inst.size_bytes)].append(inst)
    out = []
    for (pg, op, size), insts in groups.items():
        comms = [i.comm_ns for i in insts if i.comm_ns is not None]
        bws = [i.bandwidth for i in insts if i.bandwidth is not None]
        out.append(CollectiveSummary(
            pg=pg, ctype=insts[0].ctype, op=op, size_bytes=size, count=len(insts),
            comm_ns=sum(comms), wait_ns=sum(wait_ns(i) for i in insts),
            median_comm_ns=int(statistics.median(comms)) if comms else None,
            median_algbw=statistics.median(b.algbw_gbps for b in bws) if bws else None,
            median_busbw=statistics.median(b.busbw_gbps for b in bws) if bws else None,
            launch_only=sum(map(launch_only, insts)),
            failed=sum(i.failed for i in insts),
            incomplete=sum(bool(i.missing) and not i.failed for i in insts)))
    out.sort(key=lambda c: (-(c.comm_ns + c.wait_ns), c.pg, c.op))
    return out
