"""A rank's GPU activity from its profiler trace: kernels, memcpys and memsets with their stream.

Times are this rank's own wall ns (``Trace.ns``); the matched run (``commviz.match.artifact``)
moves them onto the merged clock with the rank's collectives. A kernel counts as graphed when its
``correlation`` is that of a ``cudaGraphLaunch`` runtime call or it carries a non-zero graph node
id (``trace.kernels.is_graphed``, the matchers' rule too).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, NamedTuple

from commviz.trace.kernels import GPU_WORK_CATS, LAUNCH_CATS, is_graph_launch, is_graphed


class GpuOp(NamedTuple):
    """One GPU kernel, memcpy or memset (a tuple: a trace holds tens of thousands)."""

    rank: int
    stream: int
    name: str
    cat: str
    start_ns: int
    end_ns: int
    graphed: bool

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def gpu_ops(trace: Any) -> list[GpuOp]:
    """Every complete GPU event of ``trace`` (a ``commviz.trace.load.Trace``), by start time,
    from one pass over its joinable events (the GPU work, and the launches that say which
    correlations are CUDA graph replays)."""
    events = trace.events
    launches: set[Any] = set()
    work = []
    for i in trace.joinable:
        ev = events[i]
        cat = ev.get("cat")
        if cat.__class__ is not str or ev.get("ph") != "X":
            continue
        if cat in GPU_WORK_CATS:
            work.append(ev)
        elif cat in LAUNCH_CATS:
            args = ev.get("args") or {}
            if is_graph_launch(str(ev.get("name", "")), cat, args):
                launches.add(args.get("correlation"))
    launches.discard(None)
    out = []
    rank, ns = trace.rank, trace.ns
    for ev in work:
        args = ev.get("args") or {}
        try:
            stream = int(args.get("stream", -1))
            start = ns(float(ev["ts"]))
            end = start + round(float(ev.get("dur", 0)) * 1000)
        except (TypeError, ValueError, KeyError):
            continue
        out.append(GpuOp(rank, stream, str(ev.get("name", "")), ev["cat"], start, end,
                         is_graphed(args, launches)))
    out.sort(key=attrgetter("start_ns", "end_ns"))
    return out
