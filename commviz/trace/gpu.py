"""A rank's GPU activity from its profiler trace: kernels, memcpys and memsets with their stream,
and the CPU calls that launched them, found in one pass when a trace is first asked for them.

Times are this rank's own wall ns (``Trace.ns``); the matched run (``commviz.match.artifact``)
moves them onto the merged clock with the rank's collectives. A kernel counts as graphed when its
``correlation`` is that of a ``cudaGraphLaunch`` runtime call or it carries a non-zero graph node
id (``commviz.kernels.is_graphed``): the one rule for the GPU table and every matcher, since they
all read it here (``Trace.gpu``). Where commviz's C extension is built, its port of the pass
(``_scan.gpu_index``) does it; ``python_gpu_index`` is the reference and the fallback.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, NamedTuple

from commviz.trace.joinable import native
from commviz.kernels import (GPU_WORK_CATS, GRAPH_LAUNCH_CBIDS, GRAPH_LAUNCH_NAMES,
                                   LAUNCH_CATS, graph_node_id, is_graph_launch, is_graphed)


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


class GpuIndex(NamedTuple):
    """The launches and GPU work of one trace, from one pass over its joinable events."""

    launches: dict[Any, int]    # correlation -> index of the CPU call that launched it (the last)
    graph: set[Any]             # correlations of graph launches (``is_graph_launch``)
    work: list[int]             # indices of the complete GPU events, in event order
    ops: list[GpuOp | None]     # one per ``work`` index; None where its times are unusable
    graphed: set[int]           # the ``work`` indices that ran in a graph replay
    other: list[int]            # the other joinable complete events: CPU ops named for c10d/commviz


def gpu_ops(trace: Any) -> list[GpuOp]:
    """Every complete GPU event of ``trace`` (a ``commviz.trace.load.Trace``) with usable times,
    by start time."""
    out = [op for op in trace.gpu.ops if op is not None]
    out.sort(key=attrgetter("start_ns", "end_ns"))
    return out


def gpu_index(events: list, joinable: list[int], rank: int, base_ns: int) -> GpuIndex:
    """``python_gpu_index``, by the C pass where it is built."""
    if native is not None and events.__class__ is list:
        def op_of(i: int) -> GpuOp | None:     # an event the C pass leaves to Python
            return python_op(events[i], rank, base_ns, i in graphed)
        launches, graph, work, ops, graphed, other = {}, set(), [], [], set(), []
        native.gpu_index(events, joinable, _CONSTS, rank, base_ns, GpuOp, op_of,
                         (launches, graph, work, ops, graphed, other))
        return GpuIndex(launches, graph, work, ops, graphed, other)
    return python_gpu_index(events, joinable, rank, base_ns)


_CONSTS = (LAUNCH_CATS, GPU_WORK_CATS, GRAPH_LAUNCH_NAMES, GRAPH_LAUNCH_CBIDS, graph_node_id)


def python_gpu_index(events: list, joinable: list[int], rank: int, base_ns: int) -> GpuIndex:
    """The reference for ``_scan.gpu_index`` and its fallback: the complete events of
    ``joinable`` sorted into launches (those with a ``correlation``), GPU work and the rest, and
    each piece of GPU work's ``GpuOp``. Args that are not a dict count as none."""
    launches: dict[Any, int] = {}
    graph: set[Any] = set()
    work: list[int] = []
    other: list[int] = []
    for i in joinable:
        ev = events[i]
        if ev.__class__ is not dict or ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        if cat.__class__ is str and cat in LAUNCH_CATS:
            args = _args(ev)
            corr = args.get("correlation")
            if corr is not None:
                launches[corr] = i
                if is_graph_launch(str(ev.get("name", "")), cat, args):
                    graph.add(corr)
        elif cat.__class__ is str and cat in GPU_WORK_CATS:
            work.append(i)
        else:
            other.append(i)
    graphed = {i for i in work if is_graphed(_args(events[i]), graph)}
    ops = [python_op(events[i], rank, base_ns, i in graphed) for i in work]
    return GpuIndex(launches, graph, work, ops, graphed, other)


def python_op(ev: dict, rank: int, base_ns: int, graphed: bool) -> GpuOp | None:
    """A GPU event's ``GpuOp``; None where its time, duration or stream is not a number."""
    args = _args(ev)
    try:
        stream = int(args.get("stream", -1))
        start = base_ns + round(float(ev["ts"]) * 1000)
        end = start + round(float(ev.get("dur") or 0) * 1000)
    except (TypeError, ValueError, KeyError, OverflowError):
        return None
    return GpuOp(rank, stream, str(ev.get("name", "")), ev["cat"], start, end, graphed)


def _args(ev: dict) -> dict:
    args = ev.get("args")
    return args if args.__class__ is dict else {}
