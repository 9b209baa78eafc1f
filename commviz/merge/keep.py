"""Which part of each rank a detail merge keeps: ``--steps 3-4`` or ``--window T0:T1``.

A selected rank's full trace can be minutes of events; the person came from the overview for a
few steps or a few milliseconds. ``Keep`` says which, and ``Keep.spans`` turns it into one
rank's time spans on the merged clock:

- ``--steps``: the rank's own ``ProfilerStep#N`` ranges (the profiler's step annotations, from
  each step's start to its end on that rank), so every rank keeps the same steps even when
  their clocks or pace differ;
- ``--window T0:T1``: milliseconds from the run's start, the earliest collective of any rank on
  the merged clock (the overview's time 0 in the Perfetto UI), the same span on every rank.

An event is kept when it starts inside a span (a slice that started before stays out whole,
never cut); a flow is kept when both its ends are.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from commviz.errors import CommvizError, SourceError
from commviz.merge.select import format_ranks, parse_ranges
from commviz.merge.table import iter_tables, table_ranks
from commviz.trace.steps import STEP_PREFIX

_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*$")


class Spans:
    """Sorted, disjoint [start, end) spans in ns; ``inside(ns)`` by bisection."""

    def __init__(self, spans: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [lo for lo, _ in merged]
        self.ends = [hi for _, hi in merged]

    def inside(self, ns: int) -> bool:
        i = bisect.bisect_right(self.starts, ns) - 1
        return i >= 0 and ns < self.ends[i]

    def __bool__(self) -> bool:
        return bool(self.starts)


@dataclass(frozen=True)
class Keep:
    """``steps``: profiler step numbers; ``window_ms``: (T0, T1) after the run's start;
    ``start_ns``: the run's start on the merged clock (set once the window is resolved)."""

    steps: frozenset[int] | None = None
    window_ms: tuple[float, float] | None = None
    start_ns: int | None = None

    @property
    def label(self) -> str:
        """For file names and messages: ``steps3-4`` or ``window120-180ms``."""
        if self.steps is not None:
            return f"steps{format_ranks(self.steps)}"
        lo, hi = self.window_ms or (0, 0)
        return f"window{lo:g}-{hi:g}ms"

    def spans(self, events: Sequence[dict], segments: Sequence[tuple[int, int, int]]) -> Spans:
        """This rank's spans on the merged clock (``segments``: each trace's (lo, hi, base ns
        with the clock offset) in ``events``, as the piece writer lays them out)."""
        if self.window_ms is not None:
            if self.start_ns is None:
                raise CommvizError("--window: the run's start is not known")
            lo, hi = self.window_ms
            return Spans([(self.start_ns + round(lo * 1e6), self.start_ns + round(hi * 1e6))])
        found = []
        for first, last, base in segments:
            for i in range(first, last):
                ev = events[i]
                name = ev.get("name")
                if (ev.get("ph") == "X" and isinstance(name, str) and name.startswith(STEP_PREFIX)
                        and name[len(STEP_PREFIX):].isdigit()
                        and int(name[len(STEP_PREFIX):]) in (self.steps or ())):
                    start = base + round(ev["ts"] * 1000)
                    found.append((start, start + round((ev.get("dur") or 0) * 1000)))
        return Spans(found)


def parse_steps(text: str) -> Keep:
    """``"3-4"``, ``"2,5"``: profiler step numbers (``ProfilerStep#N``)."""
    return Keep(steps=frozenset(parse_ranges(text, "--steps", "step")))


def parse_window(text: str) -> Keep:
    """``"120:180.5"``: milliseconds after the run's start, T0 < T1."""
    lo, sep, hi = text.partition(":")
    if not sep or not _NUMBER.match(lo) or not _NUMBER.match(hi):
        raise CommvizError(f"--window {text!r}: give T0:T1, milliseconds after the run's start "
                           "(e.g. 120:180.5)")
    t0, t1 = float(lo), float(hi)
    if t1 <= t0:
        raise CommvizError(f"--window {text!r}: T1 must be after T0")
    return Keep(window_ms=(t0, t1))


def keep_of(steps: str | None, window: str | None) -> Keep | None:
    """The command line's choice: at most one of ``--steps`` and ``--window``."""
    if steps is not None and window is not None:
        raise CommvizError("--steps and --window: choose one")
    if steps is not None:
        return parse_steps(steps)
    return parse_window(window) if window is not None else None


def events_inside(events: list[Any], spans: Spans) -> list[Any]:
    """The collectives (anything with ``start_ns``) that start inside the spans."""
    return [ev for ev in events if spans.inside(ev.start_ns)]


def run_start_ns(run_dir: Path) -> int:
    """The run's start: its earliest collective on the merged clock, from the ranks' comm
    tables (the overview's time 0)."""
    problems: list[str] = []
    starts = [t.rows[0].start_ns for t in iter_tables(run_dir, table_ranks(run_dir), problems)
              if t.rows]
    if not starts:
        raise SourceError(str(run_dir), "--window counts from the run's first collective, read "
                          "from the comm tables (comm_rank*.json) or matched runs: there are "
                          "none" + (f" ({'; '.join(problems)})" if problems else ""))
    return min(starts)
