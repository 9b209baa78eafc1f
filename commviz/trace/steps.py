"""A rank's training steps as its profiler saw them: the ``ProfilerStep#N`` ranges.

``torch.profiler.profile.step()`` opens one ``ProfilerStep#N`` range per step on the thread
that calls it; a trace holds those of the steps it recorded (a schedule's active steps). They
are what makes two runs comparable per step (``commviz diff``): a run of 20 steps against one
of 10. The matched run and the comm table carry them, so nothing after the match reads a trace
for them.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from commviz.trace.load import Trace

STEP_PREFIX = "ProfilerStep#"


class Step(NamedTuple):
    """One profiler step on one rank: its number and span (ns, on the rank's clock)."""

    n: int
    start_ns: int
    end_ns: int


def step_number(name: object) -> int | None:
    """N of a ``ProfilerStep#N`` event name; None for any other name."""
    if name.__class__ is str and name.startswith(STEP_PREFIX):
        tail = name[len(STEP_PREFIX):]
        return int(tail) if tail.isdigit() else None
    return None


def step_ranges(traces: Iterable[Trace]) -> list[Step]:
    """The steps of a rank's traces, by number (a step two traces both hold counted once:
    its longest range)."""
    found: dict[int, Step] = {}
    for trace in traces:
        for ev in trace.events:         # the prefix tested inline: one pass over every event
            name = ev.get("name")
            if name.__class__ is not str or not name.startswith(STEP_PREFIX) \
                    or ev.get("ph") != "X" or (n := step_number(name)) is None:
                continue
            start = trace.ns(ev["ts"])
            step = Step(n, start, start + round((ev.get("dur") or 0) * 1000))
            if n not in found or step.end_ns - step.start_ns > found[n].end_ns - found[n].start_ns:
                found[n] = step
    return sorted(found.values())
