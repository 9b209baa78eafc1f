"""Pair each record entry with its call's event in the trace.

A c10d call is the profiler's own ``c10d::<op>`` event: it opens before the boundary kernel
reads the call's begin time and closes after it reads its end time, on the thread the record
names (``commviz.tid``), so the innermost such event of the record's op on that thread that
encloses ``[t_begin, t_end]`` is the call's. An ``annotate_collective`` block (and, in traces of
commviz before 2026-11-26, every call) is a ``commviz::<op>`` range. Traces of commviz before
2026-11-28 taken with ``record_shapes=True`` carry the entry's metadata as its args, so the pair
is found by identity (op, group, sequence numbers); a range now carries no args (each cost the
job about a µs), so only the op name and time are left: the entry of that op whose
``[t_begin, t_end]`` the range encloses most tightly, and two candidates that fit equally well
leave the range unpaired rather than guessed.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from commviz import metadata as md
from commviz.match.index import RANGE_PREFIX, Intervals, Span, TraceIndex

# How far a range's bounds may sit inside its entry's [t_begin, t_end]: the profiler and
# time.time_ns read the same wall clock through different conversions (measured: tens of ns).
# Far below the time one wrapped call takes, so a neighbouring call never fits a range.
TOLERANCE_NS = 5_000
_IDENTITY_KEYS = (md.OP, md.PG_NAME, md.KIND, md.SEQ, md.P2P_SEQ, md.SRC, md.DST, md.PEERS)


def identity(meta: dict[str, Any]) -> tuple[str, ...]:
    """What names one call on one rank, as both the record and the range's args spell it."""
    return tuple(str(meta.get(k)) for k in _IDENTITY_KEYS)


def _times(meta: dict[str, Any]) -> tuple[int, int] | None:
    t0 = meta.get(md.T_BEGIN)
    if t0 is None:
        return None
    t1 = meta.get(md.T_END)
    return int(t0), int(t1 if t1 is not None else t0)


@dataclass
class Pairing:
    """Record positions <-> range spans, and what could not be paired."""

    range_of: dict[int, Span] = field(default_factory=dict)     # record position -> range
    entry_of: dict[int, int] = field(default_factory=dict)      # range event index -> position
    unpaired: list[tuple[Span, str]] = field(default_factory=list)   # (range, reason)
    by_identity: int = 0
    by_time: int = 0
    by_op: int = 0              # paired with their c10d op event
    time_mismatch: int = 0      # identity pairs whose times disagree beyond the tolerance

    def add(self, pos: int, span: Span) -> None:
        self.range_of[pos] = span
        self.entry_of[span.index] = pos


class Nearest:
    """Record positions of one identity by begin time, each taken once: the free one whose
    begin is nearest a time (of equals, the first position). Many calls can share an identity
    (receives from any source carry no peer and no sequence number), so the taken ones are
    skipped by pointers, never rescanned."""

    def __init__(self, entries: list[tuple[int, int]]) -> None:
        self.entries = sorted(entries)                     # (begin, position)
        self.begins = [begin for begin, _ in self.entries]
        n = len(self.entries)
        self._right = list(range(n + 1))     # -> the first free entry at or after (n: none)
        self._left = list(range(n + 1))      # i -> 1 + the last free entry before i (0: none)

    @staticmethod
    def _find(parent: list[int], i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    def take(self, t: int) -> int | None:
        """The position of the free entry nearest ``t``, now taken (None: all are taken)."""
        begins, n = self.begins, len(self.entries)
        at = bisect.bisect_left(begins, t)
        right = self._find(self._right, at)                 # nearest at or after t
        left = self._find(self._left, at) - 1               # nearest before t
        after = begins[right] - t if right < n else math.inf
        before = t - begins[left] if left >= 0 else math.inf
        if after == before == math.inf:
            return None
        if before < after:
            chosen = self._find(self._right, bisect.bisect_left(begins, begins[left]))
        elif after < before:
            chosen = right
        else:                                               # as far before as after
            chosen = min(right, self._find(self._right, bisect.bisect_left(begins, begins[left])),
                         key=lambda j: self.entries[j][1])
        self._right[chosen] = chosen + 1
        self._left[chosen + 1] = chosen
        return self.entries[chosen][1]


def _encloses(span: Span, times: tuple[int, int], tol: int) -> bool:
    return span.start - tol <= times[0] and times[1] <= span.end + tol


def pair_ranges(index: TraceIndex, collectives: list[dict[str, Any]],
                tol: int = TOLERANCE_NS) -> Pairing:
    """Pair ``collectives`` (the record's list, by position) with the trace's commviz ranges."""
    result = Pairing()
    entries: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for pos, meta in enumerate(collectives):
        begin = (_times(meta) or (0, 0))[0]
        entries.setdefault(identity(meta), []).append((begin, pos))
    by_identity = {ident: Nearest(found) for ident, found in entries.items()}
    timed: list[Span] = []
    for span in index.ranges:
        args = index.args(span.index)
        if md.OP not in args:
            timed.append(span)
            continue
        found = by_identity.get(identity(args))
        pos = found.take(span.start) if found is not None else None
        if pos is None:
            result.unpaired.append((span, "no record entry with this range's op, group and "
                                          "sequence number (recorder off or entry dropped?)"))
            continue
        times = _times(collectives[pos])
        if times is None or not _encloses(span, times, tol):
            result.time_mismatch += 1
        result.add(pos, span)
        result.by_identity += 1
    if timed:
        _pair_by_time(index, collectives, timed, result, tol)
    if index.op_events:
        _pair_by_op(index, collectives, result, tol)
    return result


def _pair_by_op(index: TraceIndex, collectives: list[dict[str, Any]], result: Pairing,
                tol: int) -> None:
    """Entries not paired yet, with their call's ``c10d::<op>`` event: on the entry's thread,
    the innermost event of its op that encloses its ``[t_begin, t_end]``. (An event no entry
    pairs with is a call commviz did not record: its own traffic, or recording off.)"""
    by_thread: dict[str, list[tuple[int, int, tuple[Span, str]]]] = {}
    for span, op in index.op_events:
        by_thread.setdefault(str(span.thread[1]), []).append((span.start, span.end, (span, op)))
    open_on = {tid: Intervals(items) for tid, items in by_thread.items()}
    for pos, meta in enumerate(collectives):
        times = _times(meta)
        events = open_on.get(str(meta.get(md.TID)))
        if pos in result.range_of or times is None or events is None or meta.get(md.CAPTURED):
            continue
        for span, op in events.holding(times[0], tol):        # innermost first
            if op == meta.get(md.OP) and span.index not in result.entry_of and \
                    _encloses(span, times, tol):
                result.add(pos, span)
                result.by_op += 1
                break


def _pair_by_time(index: TraceIndex, collectives: list[dict[str, Any]], spans: list[Span],
                  result: Pairing, tol: int) -> None:
    """Ranges without args: the one entry of the same op whose call the range encloses."""
    by_op: dict[str, list[tuple[int, int, int]]] = {}      # op -> sorted (t_begin, t_end, pos)
    for pos, meta in enumerate(collectives):
        times = _times(meta)
        if times is not None and pos not in result.range_of:
            by_op.setdefault(str(meta.get(md.OP)), []).append((times[0], times[1], pos))
    for items in by_op.values():
        items.sort()
    for span in sorted(spans, key=lambda s: s.start):
        op = index.name(span.index)[len(RANGE_PREFIX):]
        items = by_op.get(op, [])
        lo = bisect.bisect_left(items, (span.start - tol,))
        hi = bisect.bisect_right(items, (span.end + tol + 1,))
        fits = sorted((abs(t0 - span.start) + abs(span.end - t1), pos)
                      for t0, t1, pos in items[lo:hi]
                      if pos not in result.range_of and _encloses(span, (t0, t1), tol))
        if not fits:
            result.unpaired.append((span, f"no record entry of {op} inside this range's time"))
        elif len(fits) > 1 and fits[1][0] - fits[0][0] <= tol:
            result.unpaired.append((span, f"{len(fits)} record entries of {op} fit this range's "
                                          "time equally well (no args to tell them apart)"))
        else:
            result.add(fits[0][1], span)
            result.by_time += 1
