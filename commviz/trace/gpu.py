"""A rank's GPU activity from its profiler trace: kernels, memcpys and memsets with their stream.

Times are this rank's own wall ns (``Trace.ns``); the matched run (``commviz.match.artifact``)
moves them onto the merged clock with the rank's collectives. A kernel counts as graphed when its
``correlation`` is that of a ``cudaGraphLaunch`` runtime call or it carries a non-zero graph node
id (``trace.kernels.is_graphed``, the matchers' rule too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from commviz.trace.kernels import GPU_WORK_CATS, LAUNCH_CATS, is_graph_launch, is_graphed


@dataclass(frozen=True, slots=True)
class GpuOp:
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


def _graph_launches(events: Iterable[dict]) -> set[Any]:
    out = set()
    for ev in events:
        cat = ev.get("cat")
        if cat.__class__ is str and cat in LAUNCH_CATS and ev.get("ph") == "X":
            args = ev.get("args") or {}
            if is_graph_launch(str(ev.get("name", "")), cat, args):
                out.add(args.get("correlation"))
    out.discard(None)
    return out


def gpu_ops(trace: Any) -> list[GpuOp]:
    """Every complete GPU event of ``trace`` (a ``commviz.trace.load.Trace``), by start time."""
    events = [trace.events[i] for i in trace.joinable]
    launches = _graph_launches(events)
    out = []
    rank, ns = trace.rank, trace.ns
    work_cats = GPU_WORK_CATS
    for ev in events:
        cat = ev.get("cat")
        if cat.__class__ is not str or cat not in work_cats or ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        try:
            stream = int(args.get("stream", -1))
            start = ns(float(ev["ts"]))
            end = start + round(float(ev.get("dur", 0)) * 1000)
        except (TypeError, ValueError, KeyError):
            continue
        graphed = is_graphed(args, launches)
        out.append(GpuOp(rank, stream, str(ev.get("name", "")), cat, start, end, graphed))
    out.sort(key=lambda o: (o.start_ns, o.end_ns))
    return out
