"""Collective instances across ranks: arrival skew, the late rank, waits, stragglers.

An *instance* is one collective as every rank of its group saw it: the ``CommEvent`` s that
share an instance key (process group + sequence number; p2p: group, src, dst, sequence).
Times are ns on the merged clock. Per instance:

- ``skew`` = last start - first start: how far apart the ranks arrived;
- ``late_rank``: the rank that started last; ``wait[r]`` = time rank ``r`` spent in the call
  before the late rank arrived (``min(last start, r's end) - r's start``: a rank that left
  before the late one arrived, like a broadcast root, waited only while it was inside);
- ``span`` = first start -> last end (what the merged trace's summary slice covers);
- ``comm`` = last start -> last end: the time the collective ran with every rank present, the
  time the bandwidth is computed over (``bandwidth.py``), free of the waiting;
- ``straggler``: the late rank, only when the skew stands out (``mark_stragglers``): some rank
  always arrives last by a few microseconds, and that is noise, not a straggler.

A CPU span (the record or the profiler range, not a GPU kernel) covers only the launch
(``launch_only``) when the call does not block: ``async_op=True``, or a group whose collectives
run as GPU kernels on that rank (other calls of the same rank and group matched kernels: an
NCCL call returns once enqueued, so its record outside the profiled window is a launch). Such
an instance keeps its skew (the CPU arrival skew) but gets no ``comm`` time, no bandwidth, no
wait (all 0) and no straggler. A call that raised on some rank (``commviz.error``: a timeout,
an op the backend lacks) keeps its times but gets no comm time or bandwidth.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from commviz import metadata as md
from commviz.match.model import CommEvent
from commviz.review import bandwidth as bw

# Set by the wrappers on a call that raised (a timeout, an unsupported op): it moved no data.
# A skew counts as a straggler when it is at least this long ...
STRAGGLER_MIN_NS = 1_000_000
# ... and at least this many times the group's median skew.
STRAGGLER_FACTOR = 5.0


def parse_ranks(text: object) -> tuple[int, ...]:
    """The profiler's "Process Group Ranks" value ("[0, 1]") as a tuple of ints."""
    if isinstance(text, (list, tuple)):
        return tuple(int(r) for r in text)
    body = str(text or "").strip().strip("[]")
    try:
        return tuple(int(p) for p in body.split(",") if p.strip())
    except ValueError:
        return ()


class Span:
    """Timing shared by every cross-rank view of an instance (the report's ``Instance``, the
    overview's folded one): the skew between the first and last start, the time spent
    communicating once the last rank arrived."""

    __slots__ = ()
    first_start_ns: int
    last_start_ns: int
    last_end_ns: int
    launch_only: bool
    failed: bool

    @property
    def skew_ns(self) -> int:
        return self.last_start_ns - self.first_start_ns

    @property
    def comm_ns(self) -> int | None:
        if self.launch_only or self.failed:
            return None
        return max(0, self.last_end_ns - self.last_start_ns)


@dataclass(slots=True)
class Instance(Span):
    """One collective (or p2p transfer) across the ranks that took part."""

    key: tuple
    pg: str
    pg_desc: str
    seq: int | None
    op: str
    ctype: str                           # nccl-tests type (bandwidth.COLLECTIVE_TYPES)
    kind: str                            # collective | p2p | batch
    events: dict[int, CommEvent]         # rank -> its event
    ranks: tuple[int, ...]               # ranks that should take part
    missing: tuple[int, ...]             # of those, ranks present in the run without this one
    first_start_ns: int
    last_start_ns: int
    last_end_ns: int
    late_rank: int
    wait_ns: dict[int, int]
    launch_only: bool
    failed: bool                         # raised on some rank (md.ERROR)
    size_bytes: int | None
    bandwidth: bw.Bandwidth | None
    straggler: int | None = None

    @property
    def span_ns(self) -> int:
        return self.last_end_ns - self.first_start_ns

    @property
    def total_wait_ns(self) -> int:
        return sum(self.wait_ns.values())

    @property
    def label(self) -> str:
        return instance_label(self.key, self.op, self.seq)


def instance_label(key: tuple, op: str, seq: int | None) -> str:
    """How an instance is named in tables and on summary slices ("all_reduce #3")."""
    if key[0] == "p":
        text = f"{op} {key[2]}->{key[3]} #{key[4]}"
    elif key[0] == "b":
        text = f"{op} " + " ".join(f"{s}->{d}#{q}" for s, d, q in key[2])
    else:
        seq = seq if seq is not None else (key[2] if key[0] == "c" and len(key) > 2 else None)
        text = op if seq is None else f"{op} #{seq}"
    if "replay" in key:                      # one CUDA graph replay's copy of the call
        replay = key[key.index("replay") + 1]
        replay = " ".join(map(str, replay)) if isinstance(replay, tuple) else replay
        text += f" replay {replay}"
    return text


def expected_ranks(key: tuple, args: dict) -> tuple[int, ...]:
    """The ranks that should take part in an instance: its two p2p ends, else its group's."""
    if key[0] == "p":
        return tuple(sorted({int(key[2]), int(key[3])}))
    if key[0] == "b":
        return tuple(sorted({int(r) for pair in key[2] for r in pair[:2]}))
    return parse_ranks(args.get(md.PG_RANKS))


def _make(key: tuple, evs: dict[int, CommEvent], present: set[int],
          gpu: set[tuple[int, str]]) -> Instance:
    first = next(iter(evs.values()))
    args = first.args
    starts = {r: e.start_ns for r, e in evs.items()}
    late_rank = max(starts, key=lambda r: (starts[r], r))
    last_start = starts[late_rank]
    launch_only = any(is_launch_only(e, gpu) for e in evs.values())
    wait = {r: 0 if launch_only else max(0, min(last_start, e.end_ns) - e.start_ns)
            for r, e in evs.items()}
    expected = expected_ranks(key, args) or tuple(sorted(evs))
    ctype = bw.collective_type(args)
    sizes = [s for s in (bw.size_bytes(e.args) for e in evs.values()) if s is not None]
    size = max(sizes) if sizes else None
    last_end = max(e.end_ns for e in evs.values())
    inst = Instance(
        key=key, pg=first.pg, pg_desc=str(args.get(md.PG_DESC, "")), seq=first.seq,
        op=first.op, ctype=ctype, kind=str(args.get(md.KIND, "collective")), events=evs,
        ranks=expected, missing=tuple(r for r in expected if r in present and r not in evs),
        first_start_ns=min(starts.values()), last_start_ns=last_start, last_end_ns=last_end,
        late_rank=late_rank, wait_ns=wait, launch_only=launch_only,
        failed=any(md.ERROR in e.args for e in evs.values()), size_bytes=size, bandwidth=None)
    n = len(expected) if key[0] == "c" else 2
    inst.bandwidth = bw.bandwidth(ctype, size, inst.comm_ns, n)
    return inst


def kernel_groups(events: Iterable[CommEvent]) -> set[tuple[int, str]]:
    """(rank, pg) pairs whose collectives ran as GPU kernels on that rank."""
    return {(ev.rank, ev.pg) for ev in events if ev.source == "kernel"}


def is_launch_only(ev: CommEvent, gpu: set[tuple[int, str]]) -> bool:
    """Whether the event's span covers only the call's launch (see the module docstring)."""
    return ev.source != "kernel" and bool(ev.args.get(md.ASYNC) or (ev.rank, ev.pg) in gpu)


def build_instances(events: Iterable[CommEvent], *, present: set[int] | None = None,
                    straggler_min_ns: int = STRAGGLER_MIN_NS,
                    straggler_factor: float = STRAGGLER_FACTOR) -> list[Instance]:
    """Group events by instance key, in order of first start.

    ``present``: the ranks the run has data for (default: the ranks seen in ``events``);
    ``Instance.missing`` lists only those, so a rank with no record at all is one problem
    reported once, not a "missing" on every collective.
    """
    events = list(events)
    groups: dict[tuple, dict[int, CommEvent]] = defaultdict(dict)
    ranks_seen: set[int] = set()
    gpu = kernel_groups(events)
    for ev in events:
        ranks_seen.add(ev.rank)
        if ev.key is None:
            continue
        groups[ev.key].setdefault(ev.rank, ev)
    present = ranks_seen if present is None else present
    out = [_make(key, evs, present, gpu) for key, evs in groups.items()]
    out.sort(key=lambda i: (i.first_start_ns, i.pg, i.seq or 0))
    mark_stragglers(out, min_ns=straggler_min_ns, factor=straggler_factor)
    return out


def mark_stragglers(instances: list[Instance], *, min_ns: int = STRAGGLER_MIN_NS,
                    factor: float = STRAGGLER_FACTOR) -> None:
    """Set ``straggler`` where the skew is >= ``min_ns`` and >= ``factor`` x the group's median.

    The median of a process group's skews is its normal jitter (launch noise, clock error);
    a late arrival that is many times that, and long in absolute terms, is a straggler.
    Launch-only instances name none: nobody was measured waiting for them.
    """
    by_pg: dict[str, list[Instance]] = defaultdict(list)
    for inst in instances:
        inst.straggler = None
        if len(inst.events) > 1 and not inst.launch_only:
            by_pg[inst.pg].append(inst)
    for insts in by_pg.values():
        threshold = straggler_threshold([i.skew_ns for i in insts], min_ns, factor)
        for inst in insts:
            inst.straggler = inst.late_rank if inst.skew_ns >= threshold else None


def straggler_threshold(skews: list[int], min_ns: int = STRAGGLER_MIN_NS,
                        factor: float = STRAGGLER_FACTOR) -> float:
    """The skew from which a group's late rank is a straggler (``mark_stragglers``)."""
    return max(min_ns, factor * statistics.median(skews))


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
