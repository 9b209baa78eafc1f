"""One pass over a trace: the events the matchers join on, with their times in wall ns.

Kineto links the two sides of a GPU launch by ``args.correlation`` (the CPU runtime/driver call
and the kernel it launched) and an eager NCCL kernel to its ``record_param_comms`` CPU op by
``External id``. A kernel whose correlation is that of a ``cudaGraphLaunch`` (runtime cbid 311)
or that carries ``"graph node id"`` ran inside a CUDA graph replay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from commviz.trace.kernels import NcclKernel, parse_nccl

RANGE_PREFIX = "commviz::"
PARAM_COMMS = "record_param_comms"
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
GRAPH_LAUNCH_CBID = 311
GRAPH_NODE_ID = "graph node id"


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


@dataclass
class _Thread:
    """commviz ranges of one CPU thread sorted by start, with a running max of their ends."""

    starts: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    max_end: list[int] = field(default_factory=list)


class TraceIndex:
    """The joinable parts of one trace, built in one pass over its events."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.events: list[dict] = trace.events
        self.ranges: list[Span] = []                  # commviz::<op> CPU ranges
        self.param_comms: dict[Any, Span] = {}        # External id -> record_param_comms op
        self.launches: dict[Any, Span] = {}           # correlation -> CPU launch call
        self.graph_launches: set[Any] = set()         # correlations of cudaGraphLaunch calls
        self.nccl: list[NcclSpan] = []
        self.kernels = 0
        self.start = self.end = None
        ns = trace.ns
        kernels: list[tuple[Span, dict, NcclKernel]] = []
        for i, ev in enumerate(self.events):
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            try:
                t0 = ns(float(ev["ts"]))
                t1 = t0 + round(float(ev.get("dur") or 0) * 1000)
            except (KeyError, TypeError, ValueError):
                continue
            self.start = t0 if self.start is None else min(self.start, t0)
            self.end = t1 if self.end is None else max(self.end, t1)
            cat, name = ev.get("cat"), ev.get("name", "")
            args = ev.get("args") or {}
            if cat == "kernel":
                self.kernels += 1
                nccl = parse_nccl(name)
                if nccl is not None:
                    kernels.append((Span(i, t0, t1, (ev.get("pid"), ev.get("tid"))), ev, nccl))
                continue
            span = Span(i, t0, t1, (ev.get("pid"), ev.get("tid")))
            if cat in LAUNCH_CATS:
                corr = args.get("correlation")
                if corr is not None:
                    self.launches[corr] = span
                    if args.get("cbid") == GRAPH_LAUNCH_CBID or name.startswith("cudaGraphLaunch"):
                        self.graph_launches.add(corr)
            elif name.startswith(RANGE_PREFIX):
                self.ranges.append(span)
            elif name == PARAM_COMMS and args.get("External id") is not None:
                self.param_comms[args["External id"]] = span
        for span, ev, nccl in kernels:
            args = ev.get("args") or {}
            graphed = GRAPH_NODE_ID in args or args.get("correlation") in self.graph_launches
            self.nccl.append(NcclSpan(span, nccl, graphed))
        self._threads: dict[tuple[Any, Any], _Thread] = {}
        for span in sorted(self.ranges, key=lambda s: (s.start, -s.end)):
            th = self._threads.setdefault(span.thread, _Thread())
            th.starts.append(span.start)
            th.spans.append(span)
            th.max_end.append(max(span.end, th.max_end[-1]) if th.max_end else span.end)

    def args(self, index: int) -> dict:
        return self.events[index].get("args") or {}

    def name(self, index: int) -> str:
        return str(self.events[index].get("name", ""))

    def enclosing_range(self, thread: tuple[Any, Any], t: int) -> Span | None:
        """The innermost commviz range on ``thread`` that is open at time ``t``."""
        th = self._threads.get(thread)
        if th is None:
            return None
        j = bisect.bisect_right(th.starts, t) - 1
        while j >= 0 and th.max_end[j] >= t:
            if th.spans[j].end >= t:
                return th.spans[j]
            j -= 1
        return None

    def launch_of(self, kernel_index: int) -> Span | None:
        """The CPU runtime/driver call that launched a kernel (same ``correlation``)."""
        corr = self.args(kernel_index).get("correlation")
        return self.launches.get(corr) if corr is not None else None
