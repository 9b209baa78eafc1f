"""The cross-rank piece: the root descriptor, and per process group a summary of its instances.

The root track (uuid 0) asks for explicit process order (ranks in order). Above the ranks, a
"collectives · all ranks" group holds, per process group, one slice per collective instance
(first start to last end over its ranks, with skew and bandwidth as args, from
``commviz.review.summary``) and its bus bandwidth counter. The rank pieces carry everything
else, so this piece is small and written last, from the ranks' CommEvents only.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from commviz.match.model import CommEvent
from commviz.merge.piece import lane_name, lane_order
from commviz.write.pftrace import Piece, counter_event, emit_slices, split, track_descriptor
from commviz.write.proto import UNIT_COUNT

SUMMARY_MODULE = "commviz.review.summary"


def _summary(events: list[CommEvent], problems: list[str]) -> Any:
    try:
        module = importlib.import_module(SUMMARY_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != SUMMARY_MODULE:
            raise
        return None
    try:
        return module.summary_tracks(events)
    except Exception as exc:  # another module's failure must not cost the merged trace
        problems.append(f"summary tracks left out: {SUMMARY_MODULE}.summary_tracks failed "
                        f"({type(exc).__name__}: {exc})")
        return None


def write_cross(path: Path, events: list[CommEvent], pgs: dict[str, dict],
                problems: list[str]) -> dict[str, int]:
    """Write the cross-rank piece to ``path``; return its counts."""
    summary = _summary(events, problems) if events else None
    stats = {"summary_slices": 0, "bandwidth_samples": 0}
    with open(path, "wb") as f:
        piece = Piece(f, 0)
        piece.descriptor(track_descriptor(0, explicit_children=True, explicit_processes=True))
        if summary is not None and (summary.slices or summary.counters):
            group = piece.new_uuid()
            piece.descriptor(track_descriptor(group, name="collectives · all ranks",
                                              explicit_children=True, order_rank=-1))
            _write_summary(piece, group, summary, pgs, stats)
        piece.flush()
    return stats


def _write_summary(piece: Piece, group: int, summary: Any, pgs: dict[str, dict],
                   stats: dict[str, int]) -> None:
    rows: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    events: list[dict] = []
    for s in summary.slices:
        rows[s.pg][s.row].append((s.start_ns, -max(s.end_ns, s.start_ns), len(events)))
        events.append({"name": s.name, "cat": "commviz.summary", "args": s.args})
    counters: dict[str, list] = defaultdict(list)
    for c in summary.counters:
        counters[c.pg].append((c.ts_ns, c.value))
    plan = []
    for pg in sorted(set(rows) | set(counters), key=lambda g: (lane_order(g), g)):
        base = 2 * lane_order(pg)
        name = lane_name(pg, pgs.get(pg))
        for row in sorted(rows.get(pg, {})):
            for back in split(sorted(rows[pg][row])):
                uuid = piece.new_uuid()
                piece.descriptor(track_descriptor(uuid, name=f"{name} · instances", parent=group,
                                                  order_rank=base, merge_key=f"summary {pg}"))
                plan.append((uuid, back))
        if counters.get(pg):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=f"{name} · busbw GB/s", parent=group,
                                              order_rank=base + 1, counter=True,
                                              counter_unit=UNIT_COUNT, counter_unit_name="GB/s"))
            plan.append((uuid, sorted(counters[pg])))
    for uuid, items in plan:
        seq = piece.sequence(uuid)
        piece.buf += seq.start(items[0][0])
        if len(items[0]) == 3:
            stats["summary_slices"] += emit_slices(seq, piece.buf, items, events)
        else:
            for ts, value in items:
                piece.buf += seq.event(ts, counter_event(value))
            stats["bandwidth_samples"] += len(items)
