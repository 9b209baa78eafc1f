"""One pass over a trace: the events the matchers join on, with their times in wall ns.

A recorded call is in the trace as the profiler's own event of its c10d op (``c10d::allreduce_``
..., on the calling thread, around the whole call) or, for an annotation (and in traces of
commviz before 2026-11-26, for every call), as commviz's ``commviz::<op>`` range. Kineto links the two sides of a GPU launch by ``args.correlation`` (the CPU runtime/driver call
and the kernel it launched) and an eager NCCL kernel to its ``record_param_comms`` CPU op by
``External id``. A kernel whose correlation is that of a ``cudaGraphLaunch`` (runtime cbid 311)
or that carries a non-zero ``"graph node id"`` (torch >= 2.12) ran inside a CUDA graph replay.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from commviz.metadata import MARK_RANGE_PREFIX as MARK_PREFIX
from commviz.metadata import REPLAY_RANGE
from commviz.record.ops import OPS
from commviz.trace.joinable import COALESCED_RANGE, OP_PREFIX, PARAM_COMMS, RANGE_PREFIX
from commviz.trace.kernels import (GPU_CATS, LAUNCH_CATS, NcclKernel, is_graph_launch, is_graphed,
                                   parse_nccl)

OP_NAMES = {OP_PREFIX + name: spec.op for name, spec in OPS.items()}   # -> commviz.op


def is_other_range(name: str) -> bool:
    """commviz ranges that are not a call: graph replay tags and ``commviz.mark`` regions."""
    return name == REPLAY_RANGE or name.startswith(MARK_PREFIX)


@dataclass(slots=True)
class Span:
    """A complete ("X") event: its index in ``trace.events`` and wall-clock bounds."""

    index: int
    start: int
    end: int
    thread: tuple[Any, Any]       # (pid, tid)


@dataclass(slots=True)
class NcclSpan:
    """An NCCL kernel: where it is, what its name says, and how it was launched."""

    span: Span
    kernel: NcclKernel
    graphed: bool


class Intervals:
    """Intervals sorted by start, with a tree of their latest ends: which ones hold a time.

    A query costs a bisect plus a descent of the tree per interval found, never a walk over
    the intervals that ended before the time (behind one long open interval, that walk would
    be as long as the list).
    """

    def __init__(self, items: list[tuple[int, int, Any]]) -> None:
        items = sorted(items, key=lambda it: (it[0], -it[1]))
        self._starts = [it[0] for it in items]
        self._items = items
        size = 1
        while size < len(items):
            size *= 2
        self._size = size
        # node n covers its children 2n and 2n+1; leaf size+j holds item j's end
        tree: list[float] = [-math.inf] * (2 * size)
        tree[size:size + len(items)] = [it[1] for it in items]
        for n in range(size - 1, 0, -1):
            tree[n] = max(tree[2 * n], tree[2 * n + 1])
        self._tree = tree

    def _last_ending_at_or_after(self, j: int, t: float) -> int:
        """The last position <= ``j`` whose interval ends at or after ``t`` (-1: none)."""
        tree, size = self._tree, self._size
        n = size + j
        if tree[n] >= t:
            return j
        while n > 1:                # everything from n's first leaf to j ends before t
            if n & 1 and tree[n - 1] >= t:
                n -= 1
                while n < size:
                    n = 2 * n + 1 if tree[2 * n + 1] >= t else 2 * n
                return n - size
            n >>= 1
        return -1

    def holding(self, t: int, tol: int = 0) -> list[Any]:
        """Payloads of the intervals with ``start - tol <= t <= end + tol``, latest start first."""
        out = []
        j = bisect.bisect_right(self._starts, t + tol) - 1
        while j >= 0:
            j = self._last_ending_at_or_after(j, t - tol)
            if j < 0:
                break
            out.append(self._items[j][2])
            j -= 1
        return out


class TraceIndex:
    """The joinable parts of one trace, built in one pass over its joinable events
    (``Trace.joinable``)."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.events: list[dict] = trace.events
        self.ranges: list[Span] = []                  # commviz::<op> CPU ranges
        self.op_events: list[tuple[Span, str]] = []   # c10d::<op> CPU ops, with commviz.op
        self.param_comms: dict[Any, Span] = {}        # External id -> record_param_comms op
        self.launches: dict[Any, Span] = {}           # correlation -> CPU launch call
        self.graph_launches: set[Any] = set()         # correlations of cudaGraphLaunch calls
        self.group_ends: dict[tuple[Any, Any], list[int]] = {}   # thread -> nccl:coalesced ends
        self.nccl: list[NcclSpan] = []
        self.kernels = 0
        ns = trace.ns
        kernels: list[tuple[Span, dict, NcclKernel]] = []
        events = self.events
        for i in trace.joinable:
            ev = events[i]
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            cat, name = ev.get("cat"), ev.get("name", "")
            args = ev.get("args") or {}
            if cat in LAUNCH_CATS:
                corr = args.get("correlation")
                if corr is None:
                    continue
            elif cat != "kernel" and not (
                    (name.startswith(RANGE_PREFIX) and not is_other_range(name))
                    or (name in OP_NAMES and cat not in GPU_CATS)
                    or (name == PARAM_COMMS and args.get("External id") is not None)
                    or (name == COALESCED_RANGE and cat not in GPU_CATS)):
                continue                    # most events: nothing here joins on them
            try:
                t0 = ns(float(ev["ts"]))
                t1 = t0 + round(float(ev.get("dur") or 0) * 1000)
            except (KeyError, TypeError, ValueError):
                continue
            if cat == "kernel":
                self.kernels += 1
                nccl = parse_nccl(name)
                if nccl is not None:
                    kernels.append((Span(i, t0, t1, (ev.get("pid"), ev.get("tid"))), ev, nccl))
                continue
            span = Span(i, t0, t1, (ev.get("pid"), ev.get("tid")))
            if cat in LAUNCH_CATS:
                self.launches[corr] = span
                if is_graph_launch(name, cat, args):
                    self.graph_launches.add(corr)
            elif name.startswith(RANGE_PREFIX) and not is_other_range(name):
                self.ranges.append(span)
            elif name in OP_NAMES and cat not in GPU_CATS:
                self.op_events.append((span, OP_NAMES[name]))
            elif name == PARAM_COMMS and args.get("External id") is not None:
                self.param_comms[args["External id"]] = span
            elif name == COALESCED_RANGE and cat not in GPU_CATS:
                self.group_ends.setdefault(span.thread, []).append(t1)
        for ends in self.group_ends.values():
            ends.sort()
        for span, ev, nccl in kernels:
            args = ev.get("args") or {}
            self.nccl.append(NcclSpan(span, nccl, is_graphed(args, self.graph_launches)))
        by_thread: dict[tuple[Any, Any], list[tuple[int, int, Span]]] = {}
        for span in self.ranges + [span for span, _ in self.op_events]:
            by_thread.setdefault(span.thread, []).append((span.start, span.end, span))
        self._open = {thread: Intervals(items) for thread, items in by_thread.items()}

    def args(self, index: int) -> dict:
        return self.events[index].get("args") or {}

    def name(self, index: int) -> str:
        return str(self.events[index].get("name", ""))

    def enclosing_ranges(self, thread: tuple[Any, Any], t: int) -> list[Span]:
        """The calls (commviz ranges, c10d op events) on ``thread`` open at ``t``, innermost
        first."""
        ranges = self._open.get(thread)
        return ranges.holding(t) if ranges is not None else []

    def launch_of(self, kernel_index: int) -> Span | None:
        """The CPU runtime/driver call that launched a kernel (same ``correlation``)."""
        corr = self.args(kernel_index).get("correlation")
        return self.launches.get(corr) if corr is not None else None
