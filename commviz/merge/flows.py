"""Flows of one rank's piece: which slice each profiler flow starts and ends at.

A profiler flow event names a time on a thread, not a slice; several slices can start at that
time (a 0-µs ``cudaPeekAtLastError`` or ``cudaFuncSetAttribute`` at the same microsecond as the
``cudaLaunchKernel`` it precedes). Kineto's launch flows carry the launch's correlation id as
their id, and both the runtime call and its GPU work carry it as ``args.correlation``: those
flows are bound by that id, so each reaches the call that launched the work (of several slices
with the id on the point's track, as every kernel of a CUDA graph replay on one stream carries
its ``cudaGraphLaunch``'s, the one starting at the point). Their category changed over
Kineto's life (``ac2g`` now; ``async_cpu_to_gpu`` / ``async_gpu`` in 2021-22; ``async`` /
``launch`` in its first releases), so a flow of any category is a launch flow when its id is
the correlation of a launch call at its start point and of GPU work at each end point. Other
flows bind by time: the innermost slice of the track starting at the point's time, else the
innermost holding it.
A trace without launch flows (some exporters drop them) gets them from the correlation ids.
"""

from __future__ import annotations

import bisect
from array import array
from collections import defaultdict
from typing import Any, NamedTuple

from commviz.trace.joinable import native
from commviz.kernels import GPU_CATS, LAUNCH_CAT, LAUNCH_CATS

MAX_FLOW_REACH_NS = 10_000_000_000    # a flow point binds to a slice that began at most 10 s before


class FlowPoint(NamedTuple):
    """One profiler flow event (phase s, t or f), on the merged clock."""

    seg: int              # which of the rank's traces
    cat: Any
    fid: Any
    ph: str
    key: tuple            # (pid, tid) of its track
    ns: int


class Edge(NamedTuple):
    """A flow from one event (index into the rank's events) to another."""

    source: int
    target: int


class Track:
    """One track's slices, sorted ``(start, -end, index)`` items, with what lets a flow point
    find its slice without a scan: each item's nearest earlier item that ends later."""

    def __init__(self, items: list[tuple[int, int, int]]) -> None:
        self.items = items
        self.back = array("q", bytes(8 * len(items)))       # -1: no earlier item ends later
        if (native is None or items.__class__ is not list
                or native.back_links(items, self.back) is None):
            python_back_links(items, self.back)

    def at(self, ns: int) -> list[int]:
        """The slices starting at ``ns``."""
        items = self.items
        lo, hi = bisect.bisect_left(items, (ns,)), bisect.bisect_right(items, (ns, 1, 0))
        return [items[j][2] for j in range(lo, hi)]

    def holding(self, ns: int) -> int | None:
        """The innermost slice holding ``ns``: the latest start (of several at one time, the
        shortest), at most 10 s back. The walk jumps over items that end before the one it
        leaves, so it is as long as the nesting is deep, not as the track."""
        items, back = self.items, self.back
        j = bisect.bisect_right(items, (ns, 1, 0)) - 1
        while j >= 0:
            start, neg_end, index = items[j]
            if -neg_end >= ns:
                return index
            if ns - start > MAX_FLOW_REACH_NS:
                return None
            k = back[j]
            if k + 1 < j and ns - items[k + 1][0] > MAX_FLOW_REACH_NS:
                return None                 # the reach ends among the items jumped over
            j = k
        return None


def python_back_links(items: list[tuple[int, int, int]], back: array) -> None:
    """Into ``back``: each item's nearest earlier item that ends later, -1 where none (the
    reference for ``_scan.back_links``, and its fallback)."""
    later: list[int] = []               # earlier items, each ending later than the next
    for j, (_, neg_end, _) in enumerate(items):
        while later and items[later[-1]][1] >= neg_end:
            later.pop()
        back[j] = later[-1] if later else -1
        later.append(j)


Correlated = dict[tuple, list[tuple[int, tuple]]]   # (seg, correlation) -> (index, track) pairs


class Binder:
    """Binds flow points to slices of one rank (``items``: per track the sorted
    (start, -end, index) tuples; ``correlated``: (seg, correlation id) -> (event index, track)
    pairs, in event order). Each track is indexed once, each correlation id once per flow: a
    point costs a bisection, never a scan of its track or of the slices sharing its id."""

    def __init__(self, events: list[dict], items: dict[tuple, list],
                 correlated: Correlated) -> None:
        self.events, self.items, self.correlated = events, items, correlated
        self._tracks: dict[tuple, Track] = {}
        self._carriers: tuple[tuple, dict[tuple, list[int]]] = ((), {})
        self._members: dict[tuple, set[int]] = {}   # of the carriers: per track, as a set
        self.unbound = 0
        self.launch_segments: set[int] = set()      # traces whose launch flows were bound

    def track(self, key: tuple) -> Track:
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = Track(self.items.get(key, []))
        return track

    def carriers(self, seg: int, fid: Any) -> dict[tuple, list[int]]:
        """Per track, the slices of trace ``seg`` whose correlation id is ``fid``, in event
        order; kept for the next call, since a flow's points are bound one after another."""
        ident, by_track = self._carriers
        if ident != (seg, fid):
            by_track = {}
            for i, key in self.correlated.get((seg, fid), ()):
                found = by_track.get(key)
                if found is None:
                    by_track[key] = [i]
                else:
                    found.append(i)
            self._carriers = ((seg, fid), by_track)
            self._members = {}
        return by_track

    def by_correlation(self, p: FlowPoint) -> int | None:
        """The slice of the point's track whose correlation id is the flow's id; of several
        (a graph replay: every kernel of one ``cudaGraphLaunch`` on a stream has its id) the
        first starting at the point, else the first."""
        found = self.carriers(p.seg, p.fid).get(p.key)
        if found is None:
            return None
        if len(found) == 1:
            return found[0]
        members = self._members.get(p.key)
        if members is None:
            members = self._members[p.key] = set(found)
        here = [i for i in self.track(p.key).at(p.ns) if i in members]
        return min(here) if here else found[0]

    def by_time(self, p: FlowPoint) -> int | None:
        """The innermost slice of the point's track starting at its time, else holding it."""
        return self.track(p.key).holding(p.ns)

    def is_launch(self, points: list[FlowPoint], found: list[int | None]) -> bool:
        """Whether one flow's points (and the slices their correlation found) are a launch
        flow: named so (``ac2g``), or a launch call at its start and GPU work at every end."""
        if points[0].cat == LAUNCH_CAT:
            return True
        if None in found or not any(p.ph == "s" for p in points):
            return False
        return all(self.events[i].get("cat") in (LAUNCH_CATS if p.ph == "s" else GPU_CATS)
                   for p, i in zip(points, found))

    def bind(self, points: list[FlowPoint]) -> list[Edge]:
        """The profiler's own flows. One edge per (source, target), so a launch with many
        kernels (a graph replay) fans out instead of chaining the kernels."""
        sources: dict[tuple, int] = {}
        targets: dict[tuple, list[int]] = {}
        if native is not None and points.__class__ is list:
            native.bind_flows(points, self.correlated, LAUNCH_CAT, self.bind_flow,
                              self.launch_segments, sources, targets)
        else:
            self.python_bind(points, sources, targets)
        return [Edge(sources[ident], t) for ident, ends in targets.items() if ident in sources
                for t in ends if t != sources[ident]]

    def python_bind(self, points: list[FlowPoint], sources: dict[tuple, int],
                    targets: dict[tuple, list[int]]) -> None:
        """The points as flows, by (trace, category, id) in order, each bound by
        ``bind_flow``: the reference for ``_scan.bind_flows`` (which binds the usual launch
        flow itself: one slice with its id on each point's track) and its fallback."""
        flows: dict[tuple, list[FlowPoint]] = defaultdict(list)
        for p in points:
            flows[(p.seg, p.cat, p.fid)].append(p)
        for ident, pts in flows.items():
            self.bind_flow(ident, pts, sources, targets)

    def bind_flow(self, ident: tuple, pts: list[FlowPoint], sources: dict[tuple, int],
                  targets: dict[tuple, list[int]]) -> None:
        """One flow's source and targets."""
        found = [self.by_correlation(p) for p in pts]
        if self.is_launch(pts, found):
            self.launch_segments.add(ident[0])
        else:
            found = [None] * len(pts)
        for p, index in zip(pts, found):
            if index is None:
                index = self.by_time(p)
            if index is None:
                self.unbound += 1
            elif p.ph == "s":
                sources.setdefault(ident, index)
            else:
                targets.setdefault(ident, []).append(index)

    def from_correlation(self, segments: set[int]) -> list[Edge]:
        """Launch -> GPU work edges of the given traces, from correlation ids alone: the one
        CPU call with an id launched every GPU event with it."""
        edges = []
        for (seg, _), pairs in self.correlated.items():
            if seg not in segments:
                continue
            gpu = [i for i, _ in pairs if self.events[i].get("cat") in GPU_CATS]
            launch = [i for i, _ in pairs if self.events[i].get("cat") in LAUNCH_CATS]
            if gpu and len(launch) == 1:
                edges.extend(Edge(launch[0], g) for g in gpu)
        return edges


def launch_edges(events: list[dict], items: dict[tuple, list], correlated: Correlated,
                 points: list[FlowPoint], segments: int) -> tuple[list[Edge], list[Edge], int]:
    """(edges of the profiler's flows, edges drawn from correlation ids for the traces that
    have no launch flows, flow points bound to no slice)."""
    binder = Binder(events, items, correlated)
    bound = binder.bind(points)
    derived = binder.from_correlation(set(range(segments)) - binder.launch_segments)
    return bound, derived, binder.unbound
