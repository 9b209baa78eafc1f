"""What matching one rank's trace with its record gives back, and how partial results combine.

``RankMatch`` is what the writer needs: the rank's collectives as ``CommEvent``s (merged clock),
the args to add to trace events (by index into ``trace.events``), and, for everything that could
not be matched with certainty, an ``Unmatched`` entry saying why. Nothing uncertain is labelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commviz.match.model import CommEvent


@dataclass
class Unmatched:
    """A trace event (usually an NCCL kernel) left unlabelled, and why."""

    what: str                 # e.g. "graphed kernel ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    index: int | None         # index into trace.events, or None
    reason: str


@dataclass
class Conflict:
    """An eager key on which the profiler and commviz's record disagree; the profiler's is kept."""

    index: int                # trace.events index of the kernel
    key: str
    profiler: Any
    record: Any


@dataclass
class RankMatch:
    """One rank's collectives and the labels for its trace.

    ``kernel_args`` and ``marks`` index the events of the trace at ``trace_path``. A rank with
    several traces (profiler steps) has ``trace_path`` None, one RankMatch per trace in
    ``per_trace``, and its ``events`` hold every collective once.
    """

    rank: int
    events: list[CommEvent] = field(default_factory=list)
    kernel_args: dict[int, dict] = field(default_factory=dict)
    marks: dict[int, dict] = field(default_factory=dict)
    unmatched: list[Unmatched] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    conflicts: list[Conflict] = field(default_factory=list)
    trace_path: Path | None = None
    per_trace: list[RankMatch] = field(default_factory=list)

    def bump(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def label(self, index: int, event: dict, meta: dict[str, Any]) -> None:
        """Add to trace event ``index`` the keys of ``meta`` it does not carry yet (and has a
        value for)."""
        own = event.get("args") or {}
        add = {k: v for k, v in meta.items() if k not in own and v is not None}
        if add:
            self.kernel_args.setdefault(index, {}).update(add)

    def absorb(self, part: Any) -> None:
        """Fold in a partial result with the same fields (the graph matcher's ``GraphMatch``)."""
        self.events.extend(part.events)
        self.kernel_args.update(part.kernel_args)
        self.marks.update(part.marks)
        self.unmatched.extend(part.unmatched)
        for key, n in part.stats.items():
            self.bump(key, n)

    def finish(self) -> RankMatch:
        """Sort the events by time and fill the summary counters."""
        self.events.sort(key=lambda e: (e.start_ns, e.end_ns))
        self.stats["events"] = len(self.events)
        self.stats["unmatched"] = len(self.unmatched)
        self.stats["conflicts"] = len(self.conflicts)
        return self
