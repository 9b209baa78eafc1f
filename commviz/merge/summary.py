"""The merged trace's per-process-group summary: one slice per collective instance, and a
bus bandwidth counter per group.

A summary slice spans the instance from its first start to its last end across ranks, so a
skewed collective is visibly wider than the kernels under it; its args carry the skew, the late
rank, the straggler (when the skew stands out), each rank's wait and the bandwidth.

Instances of one group can overlap in time (a broadcast root leaves early and starts the next
collective while the others are still in this one); a track of properly nested slices cannot
hold those, so each slice gets a ``row``: slices with the same (pg, row) never overlap, and
row 0 holds as many as it can. The counter is the bus bandwidth in use on the group: the sum
of busbw over the instances running at that moment (their comm time, last start to last end),
0 between them.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from commviz.match.model import CommEvent
from commviz.merge.instances import Instance, build_instances


# Up to this many ranks, a slice lists each rank's wait; beyond, only the largest (args stay small).
WAIT_ARGS_MAX_RANKS = 16


@dataclass
class SummarySlice:
    pg: str
    start_ns: int
    end_ns: int
    name: str
    args: dict
    row: int = 0


@dataclass
class CounterSample:
    pg: str
    ts_ns: int
    value: float          # bus bandwidth, GB/s


@dataclass
class SummaryTracks:
    slices: list[SummarySlice]
    counters: list[CounterSample]


def slice_args(inst: Instance) -> dict:
    """What a summary slice says about its instance (flat, scalar values only)."""
    args: dict = {
        "commviz.seq": inst.seq,
        "commviz.op": inst.op,
        "commviz.skew_ns": inst.skew_ns,
        "commviz.late_rank": inst.late_rank,
        "commviz.ranks": ",".join(str(r) for r in sorted(inst.events)),
        "commviz.total_wait_ns": inst.total_wait_ns,
    }
    if inst.straggler is not None:
        args["commviz.straggler"] = inst.straggler
    if inst.origin is not None:
        args["commviz.origin"] = inst.origin
    if inst.missing:
        args["commviz.missing_ranks"] = ",".join(str(r) for r in inst.missing)
    if len(inst.wait_ns) <= WAIT_ARGS_MAX_RANKS:
        for rank, wait in sorted(inst.wait_ns.items()):
            args[f"commviz.wait_ns.rank{rank}"] = wait
    elif inst.wait_ns:
        args["commviz.max_wait_ns"] = max(inst.wait_ns.values())
    comm_args(args, inst)
    return {k: v for k, v in args.items() if v is not None}


def comm_args(args: dict, inst: Any, *, algbw: bool = True) -> None:
    """Add an instance's comm time, bytes and bandwidth to its slice's ``args``: the same keys
    on the merged trace's summary and the overview's (``inst``: an ``Instance`` or the
    overview's ``Seen``). The overview leaves algbw out: its tracks plot busbw only."""
    comm_ns = inst.comm_ns
    if comm_ns is not None:
        args["commviz.comm_ns"] = comm_ns
    if inst.size_bytes is not None:
        args["commviz.size_bytes"] = inst.size_bytes
    if inst.bandwidth is not None:
        if algbw:
            args["commviz.algbw_GBps"] = round(inst.bandwidth.algbw_gbps, 3)
        args["commviz.busbw_GBps"] = round(inst.bandwidth.busbw_gbps, 3)


def rows_of(instances: list[Instance]) -> list[int]:
    """Greedy interval colouring: the lowest row whose last slice ended before this one."""
    free: list[tuple[int, int]] = []        # (end_ns, row) of each row's last slice
    rows, used = [], 0
    for inst in instances:
        if free and free[0][0] <= inst.first_start_ns:
            _, row = heapq.heappop(free)
        else:
            row, used = used, used + 1
        heapq.heappush(free, (inst.last_end_ns, row))
        rows.append(row)
    return rows


def bandwidth_counter(pg: str, instances: list[Instance]) -> list[CounterSample]:
    deltas: dict[int, float] = defaultdict(float)
    for inst in instances:
        if inst.bandwidth is None or not (inst.comm_ns or 0) > 0:
            continue
        deltas[inst.last_start_ns] += inst.bandwidth.busbw_gbps
        deltas[inst.last_end_ns] -= inst.bandwidth.busbw_gbps
    out, level = [], 0.0
    for ts in sorted(deltas):
        level += deltas[ts]
        out.append(CounterSample(pg, ts, round(max(level, 0.0), 6)))
    return out


def tracks_for(instances: Sequence[Any],
               args_of: Callable[[Any], dict] | None = None) -> SummaryTracks:
    """Summary slices and counters of already built instances (the report's ``Instance``, or
    the overview's folded ones with their own ``args_of``)."""
    args_of = args_of or slice_args
    by_pg: dict[str, list[Any]] = defaultdict(list)
    for inst in instances:
        by_pg[inst.pg].append(inst)
    slices: list[SummarySlice] = []
    counters: list[CounterSample] = []
    for pg in sorted(by_pg):
        insts = sorted(by_pg[pg], key=lambda i: (i.first_start_ns, i.last_end_ns))
        for inst, row in zip(insts, rows_of(insts)):
            slices.append(SummarySlice(pg=pg, start_ns=inst.first_start_ns,
                                       end_ns=inst.last_end_ns, name=inst.label,
                                       args=args_of(inst), row=row))
        counters.extend(bandwidth_counter(pg, insts))
    return SummaryTracks(slices=slices, counters=counters)


def summary_tracks(events: list[CommEvent]) -> SummaryTracks:
    """The per-group summary slices and bandwidth counters of a run's events."""
    return tracks_for(build_instances(events))
