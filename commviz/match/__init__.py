"""Step 3 of the flow: put each rank's recorded collectives onto its profiler trace.

``match_rank`` joins one trace with one record: eager NCCL kernels keep the profiler's metadata
and gain commviz's keys (``eager``), calls without kernels are their CPU range (``cpu``),
graphed kernels go to the CUDA graph matcher (``graphed``), and without a record the profiler's
own metadata is all there is (``derive``). Whatever is not certain is reported, not labelled.
"""

from __future__ import annotations

import importlib
from typing import Any

from commviz.errors import RecordError, TraceError
from commviz.match.model import CommEvent, InstanceKey, events_from_record, instance_key
from commviz.match.result import Conflict, RankMatch, Unmatched

__all__ = ["CommEvent", "Conflict", "InstanceKey", "RankMatch", "Unmatched",
           "events_from_record", "instance_key", "match_rank", "match_run"]

GRAPH_MATCHER = "commviz.match.graphed"


def _graph_matcher() -> Any:
    """``match_graphed`` when the CUDA graph matcher is installed, else None."""
    try:
        return importlib.import_module(GRAPH_MATCHER).match_graphed
    except ModuleNotFoundError as exc:
        if exc.name != GRAPH_MATCHER:
            raise
        return None


def _check_rank(trace: Any, record: dict | None, rank: int) -> None:
    if trace is not None and trace.rank != rank:
        raise TraceError(str(trace.path), f"is rank {trace.rank}'s trace, matched as rank {rank}")
    if record is not None and int(record.get("rank", rank)) != rank:
        raise RecordError(f"record of rank {record.get('rank')}",
                          f"matched as rank {rank}'s record")


def match_rank(trace: Any, record: dict | None, *, rank: int) -> RankMatch:
    """Match one rank's trace (a ``commviz.trace.load.Trace``, or None) with its record (or None)."""
    from commviz.match import cpu, derive, eager
    from commviz.match.index import TraceIndex
    from commviz.match.ranges import pair_ranges

    _check_rank(trace, record, rank)
    result = RankMatch(rank=rank, trace_path=getattr(trace, "path", None))
    if trace is None:
        if record is not None:
            result.events.extend(events_from_record(record))
            result.bump("records_outside_trace", len(result.events))
        return result.finish()
    index = TraceIndex(trace)
    offset = int(((record or {}).get("clock") or {}).get("offset_ns") or 0)
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
                            ranges_by_identity=pairing.by_identity,
                            ranges_by_time=pairing.by_time,
                            range_time_mismatch=pairing.time_mismatch)
        with_kernels, strays = eager.match_eager(index, collectives, pairing, eager_kernels,
                                                 result, rank=rank, offset_ns=offset)
        derive.derive(index, strays, result, rank=rank, offset_ns=offset)
        cpu.match_cpu(index, record, pairing, with_kernels, result, rank=rank, offset_ns=offset)
    _match_graphed(trace, record, index, graphed, result)
    return result.finish()


def _match_graphed(trace: Any, record: dict | None, index: Any, graphed: list,
                   result: RankMatch) -> None:
    """Hand graph replays to the graph matcher; without it, or a record, graphed kernels stay bare."""
    matcher = _graph_matcher() if record is not None else None
    if matcher is not None and (graphed or index.graph_launches or record.get("graphs")):
        result.absorb(matcher(trace, record))
        return
    reason = ("graph matcher unavailable" if record is not None else
              "no commviz record: a graphed kernel carries no collective metadata")
    for k in graphed:
        result.unmatched.append(Unmatched(f"graphed kernel {index.name(k.span.index)}",
                                          k.span.index, reason))


def match_run(run: Any) -> dict[int, RankMatch]:
    """Match every rank of a ``commviz.trace.run.Run``; a rank with several traces gets one
    RankMatch per trace in ``per_trace``, and its recorded calls once in ``events``."""
    from commviz.trace.load import load_trace

    out: dict[int, RankMatch] = {}
    for rank, item in sorted(run.ranks.items()):
        paths = list(item.trace_paths)
        if len(paths) <= 1:
            trace = load_trace(paths[0], rank=rank) if paths else None
            out[rank] = match_rank(trace, item.record, rank=rank)
            continue
        parts = [match_rank(load_trace(p, rank=rank), item.record, rank=rank) for p in paths]
        out[rank] = _combine(rank, parts)
    return out


def _combine(rank: int, parts: list[RankMatch]) -> RankMatch:
    """One rank's matches over several traces: each recorded call once, from a trace if one had it."""
    combined = RankMatch(rank=rank, per_trace=parts)
    seen: set[int] = set()
    for part in parts:
        combined.unmatched.extend(part.unmatched)
        combined.conflicts.extend(part.conflicts)
        for key, n in part.stats.items():
            combined.bump(key, n)
    for part in sorted(parts, key=lambda p: p.stats.get("records_outside_trace", 0)):
        for ev in part.events:
            ident = id(ev.args)
            if ev.source == "record":
                continue
            seen.add(ident)
            combined.events.append(ev)
    record_events = {id(ev.args): ev for part in parts for ev in part.events
                     if ev.source == "record"}
    combined.events.extend(ev for ident, ev in record_events.items() if ident not in seen)
    return combined.finish()
