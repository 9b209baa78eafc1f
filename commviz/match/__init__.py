"""Step 3 of the flow: put each rank's recorded collectives onto its profiler trace.

``match_rank`` joins one trace with one record: eager NCCL kernels keep the profiler's metadata
and gain commviz's keys (``eager``), a SendRecv kernel NCCL launched for a group of coalesced
sends and receives gets them all (``coalesced``), calls without kernels are their CPU range (``cpu``),
graphed kernels go to the CUDA graph matcher (``graphed``), and without a record the profiler's
own metadata is all there is (``derive``). Whatever is not certain is reported, not labelled.
"""

from __future__ import annotations

from typing import Any, Iterable

from commviz.errors import RecordError, TraceError
from commviz.match import coalesced, cpu, derive, eager
from commviz.match.graphed import match_graphed
from commviz.match.index import TraceIndex
from commviz.match.model import (CommEvent, InstanceKey, KeyKind, Source, events_from_record,
                                 instance_key)
from commviz.match.ranges import pair_ranges
from commviz.match.result import Conflict, RankMatch, Unmatched

__all__ = ["CommEvent", "Conflict", "InstanceKey", "KeyKind", "RankMatch", "Source", "Unmatched",
           "events_from_record", "instance_key", "match_rank", "match_run", "match_traces"]

def _check_rank(trace: Any, record: dict | None, rank: int) -> None:
    if trace is not None and trace.rank != rank:
        raise TraceError(str(trace.path), f"is rank {trace.rank}'s trace, matched as rank {rank}")
    if record is not None and int(record.get("rank", rank)) != rank:
        raise RecordError(f"record of rank {record.get('rank')}",
                          f"matched as rank {rank}'s record")


def match_rank(trace: Any, record: dict | None, *, rank: int) -> RankMatch:
    """Match one rank's trace (a ``commviz.trace.load.Trace``) with its record; either may be
    None. Times stay on the rank's own clock: ``commviz.match.artifact`` aligns them."""
    _check_rank(trace, record, rank)
    result = RankMatch(rank=rank, trace_path=getattr(trace, "path", None))
    if trace is None:
        if record is not None:
            collectives = record["collectives"]
            result.events.extend(cpu.recorded_spans(collectives, set(range(len(collectives))),
                                                    rank=rank))
            result.bump("records_outside_trace", len(result.events))
        return result.finish()
    index = TraceIndex(trace)
    eager_kernels = [k for k in index.nccl if not k.graphed]
    graphed = [k for k in index.nccl if k.graphed]
    result.stats.update(kernels=index.kernels, nccl_kernels=len(index.nccl),
                        eager_kernels=len(eager_kernels), graphed_kernels=len(graphed))
    if record is None:
        derive.derive(index, eager_kernels, result, rank=rank)
    else:
        collectives = record["collectives"]
        pairing = pair_ranges(index, collectives)
        result.stats.update(records=len(collectives), ranges=len(index.ranges),
                            op_events=len(index.op_events),
                            ranges_by_identity=pairing.by_identity,
                            ranges_by_time=pairing.by_time, ranges_by_op=pairing.by_op,
                            range_time_mismatch=pairing.time_mismatch)
        with_kernels, strays = eager.match_eager(index, collectives, pairing, eager_kernels,
                                                 result, rank=rank)
        strays = coalesced.match_coalesced(index, collectives, pairing, eager_kernels, strays,
                                           with_kernels, result, rank=rank)
        derive.derive(index, strays, result, rank=rank, recorded=True)
        cpu.match_cpu(index, record, pairing, with_kernels, result, rank=rank)
    result.absorb(match_graphed(trace, record))
    return result.finish()


def match_traces(traces: Iterable[Any], record: dict | None, *, rank: int) -> RankMatch:
    """One rank's traces (profiler steps: any number, matched one at a time) with its record.

    Several traces give one RankMatch per trace in ``per_trace`` and every recorded call once
    in ``events``; no trace gives the record's own spans.
    """
    parts = [match_rank(trace, record, rank=rank) for trace in traces]
    if not parts:
        return match_rank(None, record, rank=rank)
    return parts[0] if len(parts) == 1 else _combine(rank, parts)


def match_run(run: Any) -> dict[int, RankMatch]:
    """Match every rank of a ``commviz.trace.run.Run`` (``match_traces`` per rank).

    A trace that cannot be parsed is added to ``run.problems`` and left out; the rank's record
    (and its other traces) still count.
    """
    return {rank: match_traces(item.load_traces(run.problems), item.record, rank=rank)
            for rank, item in sorted(run.ranks.items())}


def _combine(rank: int, parts: list[RankMatch]) -> RankMatch:
    """One rank's matches over several traces: each recorded call once, from a trace if one
    had it."""
    combined = RankMatch(rank=rank, per_trace=parts)
    by_record: dict[int, CommEvent] = {}
    for part in parts:
        combined.unmatched.extend(part.unmatched)
        combined.conflicts.extend(part.conflicts)
        for key, n in part.stats.items():
            combined.bump(key, n)
        for ev in part.events:
            pos = ev.extra.get("record_index")
            if ev.source is not Source.RECORD:
                ev.extra["trace_path"] = str(part.trace_path)
            if pos is None:
                combined.events.append(ev)
            elif pos not in by_record or by_record[pos].source is Source.RECORD:
                by_record[pos] = ev
    combined.events.extend(by_record.values())
    if "records" in combined.stats:
        combined.stats["records"] = parts[0].stats["records"]
    combined.stats["records_outside_trace"] = sum(ev.source is Source.RECORD
                                                  for ev in by_record.values())
    return combined.finish()
