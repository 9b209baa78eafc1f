"""Recorded calls without a GPU kernel: their ``commviz::<op>`` CPU range is the collective.

That is every gloo (CPU) collective, and on GPUs a call whose kernels are not in the trace.
Each paired range gets the call's full metadata (it lacks the call's times, and everything
when ``record_shapes`` was off). A call the trace has no range for keeps its recorded CPU span;
calls captured into a CUDA graph are left to the graph matcher (their capture is not a run).
"""

from __future__ import annotations

from typing import Any

from commviz import metadata as md
from commviz.match.index import TraceIndex
from commviz.match.model import CommEvent, Source, events_from_record, instance_key
from commviz.match.ranges import Pairing
from commviz.match.result import RankMatch, Unmatched


def match_cpu(index: TraceIndex, record: dict[str, Any], pairing: Pairing, with_kernels: set[int],
              result: RankMatch, *, rank: int) -> None:
    """CommEvents for recorded calls that got no kernel; labels for every paired range."""
    collectives = record["collectives"]
    for span, reason in pairing.unpaired:
        result.unmatched.append(Unmatched(f"range {index.name(span.index)}", span.index, reason))
    outside: set[int] = set()
    for pos, meta in enumerate(collectives):
        span = pairing.range_of.get(pos)
        if span is not None:
            result.label(span.index, index.events[span.index], meta)
        if meta.get(md.CAPTURED):
            result.bump("captured_records")
            continue
        if pos in with_kernels:
            continue
        if span is None:
            outside.add(pos)
            continue
        result.events.append(CommEvent(
            rank=rank, pg=str(meta.get(md.PG_NAME)), op=str(meta.get(md.OP)),
            start_ns=span.start, end_ns=span.end, args=meta,
            key=instance_key(meta), source=Source.CPU,
            extra={"trace_index": span.index, "record_index": pos}))
        result.bump("cpu_matched")
        if index.kernels:
            result.bump("records_without_kernel")
    if outside:
        events = recorded_spans(collectives, outside, rank=rank)
        result.events.extend(events)
        result.bump("records_outside_trace", len(events))


def recorded_spans(collectives: list[dict[str, Any]], positions: set[int], *,
                   rank: int) -> list[CommEvent]:
    """The recorded CPU spans of the calls at ``positions`` (``events_from_record``)."""
    chosen = {id(collectives[p]): p for p in positions}
    events = events_from_record({"rank": rank, "collectives": [collectives[p] for p in sorted(positions)]})
    for ev in events:
        ev.extra["record_index"] = chosen[id(ev.args)]
    return events
