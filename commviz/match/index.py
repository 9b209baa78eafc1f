"""The events the eager matchers join on, with their times in wall ns, indexed once a trace.

A recorded call is in the trace as the profiler's own event of its c10d op (``c10d::allreduce_``
..., on the calling thread, around the whole call) or, for an annotation (and in traces of
commviz before 2026-11-26, for every call), as commviz's ``commviz::<op>`` range. Kineto links
the two sides of a GPU launch by ``args.correlation`` (the CPU runtime/driver call and the
kernel it launched) and an eager NCCL kernel to its ``record_param_comms`` CPU op by
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
from commviz.kernels import GPU_CATS, NcclKernel, parse_nccl

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
    """The joinable parts of one trace: its named CPU ops, from one pass over the joinable
    events that are neither launches nor GPU work, and its NCCL kernels and launches, from the
    trace's ``GpuIndex`` (``Trace.gpu``)."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.events: list[dict] = trace.events
        self.ranges: list[Span] = []                  # commviz::<op> CPU ranges
        self.op_events: list[tuple[Span, str]] = []   # c10d::<op> CPU ops, with commviz.op
        self.param_comms: dict[Any, Span] = {}        # External id -> record_param_comms op
        self.group_ends: dict[tuple[Any, Any], list[int]] = {}   # thread -> nccl:coalesced ends
        self.nccl: list[NcclSpan] = []
        gpu = trace.gpu
        self._launches = gpu.launches                 # correlation -> launch call's index
        ns = trace.ns
        events = self.events
        for i in gpu.other:
            ev = events[i]
            cat, name = ev.get("cat"), ev.get("name", "")
            if name.__class__ is not str:
                continue
            args = ev.get("args")
            if args.__class__ is not dict:
                args = {}
            if not ((name.startswith(RANGE_PREFIX) and not is_other_range(name))
                    or (name in OP_NAMES and cat not in GPU_CATS)
                    or (name == PARAM_COMMS and args.get("External id") is not None)
                    or (name == COALESCED_RANGE and cat not in GPU_CATS)):
                continue                    # most events: nothing here joins on them
            span = _span(ev, i, ns)
            if span is None:
                continue
            if name.startswith(RANGE_PREFIX) and not is_other_range(name):
                self.ranges.append(span)
            elif name in OP_NAMES and cat not in GPU_CATS:
                self.op_events.append((span, OP_NAMES[name]))
            elif name == PARAM_COMMS:
                self.param_comms[args["External id"]] = span
            else:
                self.group_ends.setdefault(span.thread, []).append(span.end)
        for ends in self.group_ends.values():
            ends.sort()
        kernels = [(i, op) for i, op in zip(gpu.work, gpu.ops)
                   if op is not None and op.cat == "kernel"]
        self.kernels = len(kernels)
        for i, op in kernels:
            nccl = parse_nccl(op.name)
            if nccl is not None:
                ev = events[i]
                span = Span(i, op.start_ns, op.end_ns, (ev.get("pid"), ev.get("tid")))
                self.nccl.append(NcclSpan(span, nccl, op.graphed))
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
        i = self._launches.get(corr) if corr is not None else None
        return _span(self.events[i], i, self.trace.ns) if i is not None else None


def _span(ev: dict, i: int, ns: Any) -> Span | None:
    """A complete event's Span; None where its time or duration is not a number."""
    try:
        t0 = ns(float(ev["ts"]))
        t1 = t0 + round(float(ev.get("dur") or 0) * 1000)
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    return Span(i, t0, t1, (ev.get("pid"), ev.get("tid")))
