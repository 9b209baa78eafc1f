"""The report's roll-ups of the cross-rank instances (``commviz.merge.instances``): per
process group, per rank, and per (group, op, size), each listing what cost the most time first.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from commviz.merge.instances import Instance


@dataclass(slots=True)
class GroupSummary:
    pg: str
    desc: str
    ranks: tuple[int, ...]
    count: int
    span_ns: int                  # sum of instance spans
    comm_ns: int                  # sum of comm times (bandwidth time)
    wait_ns: int                  # sum over instances and ranks of the time spent waiting
    max_skew_ns: int
    median_skew_ns: int
    stragglers: dict[int, tuple[int, int]]   # rank -> (times straggler, skew it caused in ns)


@dataclass(slots=True)
class RankSummary:
    rank: int
    count: int
    busy_ns: int                  # sum of this rank's call durations
    wait_ns: int                  # of which spent waiting for a later rank
    late: int                     # times this rank was the straggler
    caused_ns: int                # skew of the instances it straggled
    missing: int                  # instances of its groups it did not take part in


def group_summaries(instances: list[Instance]) -> list[GroupSummary]:
    """Per process group, the most waiting first."""
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
        skews = [i.skew_ns for i in insts]
        ranks = max((i.ranks for i in insts), key=len)
        out.append(GroupSummary(
            pg=pg, desc=insts[0].pg_desc, ranks=ranks, count=len(insts),
            span_ns=sum(i.span_ns for i in insts), comm_ns=sum(i.comm_ns or 0 for i in insts),
            wait_ns=sum(i.total_wait_ns for i in insts), max_skew_ns=max(skews),
            median_skew_ns=int(statistics.median(skews)),
            stragglers={r: (c, s) for r, (c, s) in sorted(strag.items(),
                                                          key=lambda kv: -kv[1][1])}))
    out.sort(key=lambda g: (-g.wait_ns, g.pg))
    return out


def rank_summaries(instances: list[Instance]) -> list[RankSummary]:
    """Per rank, the rank that made others wait longest first."""
    rows: dict[int, RankSummary] = {}

    def row(rank: int) -> RankSummary:
        if rank not in rows:
            rows[rank] = RankSummary(rank, 0, 0, 0, 0, 0, 0)
        return rows[rank]

    for inst in instances:
        for rank, ev in inst.events.items():
            r = row(rank)
            r.count += 1
            r.busy_ns += ev.duration_ns
            r.wait_ns += inst.wait_ns[rank]
        if inst.straggler is not None:
            r = row(inst.straggler)
            r.late += 1
            r.caused_ns += inst.skew_ns
        for rank in inst.missing:
            row(rank).missing += 1
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
            comm_ns=sum(comms), wait_ns=sum(i.total_wait_ns for i in insts),
            median_comm_ns=int(statistics.median(comms)) if comms else None,
            median_algbw=statistics.median(b.algbw_gbps for b in bws) if bws else None,
            median_busbw=statistics.median(b.busbw_gbps for b in bws) if bws else None,
            launch_only=sum(i.launch_only and not i.failed for i in insts),
            failed=sum(i.failed for i in insts)))
    out.sort(key=lambda c: (-(c.comm_ns + c.wait_ns), c.pg, c.op))
    return out
