"""The trace on its own: what Perfetto would build from it, and where that differs from a
well-formed trace.

A trace that parses can still lose data silently in Perfetto: an END that closes the wrong
slice, a packet skipped because its sequence never cleared its incremental state, an event on a
track nobody declared, a flow that links nothing. The reader (``commviz.write.read``) resolves
packets in file order and names what it cannot resolve; this check nests slices per track in
timestamp order (``read.pair``), checks tracks and flows, and counts what each process shows.

Only a few integers per event are kept (arrays), so a trace of millions of events verifies in
bounded memory; args are read back on demand by seeking to their packets.
"""

from __future__ import annotations

import re
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from commviz.write.read import (BEGIN, COUNTER, END, INSTANT, Decoder, Event, Problem, Track,
                                iter_packet_batches, pair)

_DETAILS_PER_KIND = 20            # problems kept in full per kind; all are counted
_RANK_RE = re.compile(r"^\s*rank\s+(\d+)\b", re.IGNORECASE)


@dataclass
class VerifyReport:
    """What verify found. ``errors`` keeps the first problems of each kind in full;
    ``error_counts`` counts all of them."""

    path: Path
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    error_counts: Counter = field(default_factory=Counter)
    counts: dict[str, int] = field(default_factory=dict)     # totals: packets, slices, flows...
    per_process: dict[str, int] = field(default_factory=dict)          # process -> slices
    per_lane: dict[str, dict[str, int]] = field(default_factory=dict)  # process -> track -> slices
    ranks: dict[int, str] = field(default_factory=dict)      # rank -> process label
    clock_offsets: dict[int, int] = field(default_factory=dict)  # rank -> ns output - input
    inputs: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> matched, missing..

    @property
    def ok(self) -> bool:
        return not self.error_counts

    def add(self, problem: Problem, warn: bool = False) -> None:
        """Count a problem; keep the first ``_DETAILS_PER_KIND`` of each kind in full."""
        if warn:
            if sum(1 for w in self.warnings if w.kind == problem.kind) < _DETAILS_PER_KIND:
                self.warnings.append(problem)
            return
        n = self.error_counts[problem.kind]
        self.error_counts[problem.kind] = n + 1
        if n < _DETAILS_PER_KIND:
            self.errors.append(problem)


class TraceCheck:
    """One pass over the packets (through the reader), then tracks, nesting, flows, tallies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.report = VerifyReport(path)
        self.decoder = Decoder(self.report.add)
        self.names: list[str] = []                      # global name id -> name
        self.name_ids: dict[str, int] = {}
        self.cat_sets: list[tuple[str, ...]] = []       # category-tuple id -> categories
        self.cat_ids: dict[tuple[str, ...], int] = {}
        self.track_idx: dict[int, int] = {}             # uuid -> dense index
        self.track_uuid: list[int] = []
        self.used_first: dict[int, tuple[int, int, int]] = {}   # uuid -> (ts, name id, offset)
        self.counter_use: dict[int, int] = {}           # track index -> samples
        self.counts: Counter = Counter()
        # per event (BEGIN / END / INSTANT), in file order
        self.ev_ts, self.ev_track, self.ev_type = array("q"), array("i"), array("b")
        self.ev_name, self.ev_off, self.ev_state = array("i"), array("q"), array("i")
        self.ev_cats = array("i")
        self.ev_args = array("b")                       # 1: the event carries debug annotations
        self.fl_id, self.fl_ev = array("Q"), array("q")
        self._flow_map: dict[int, list[int]] | None = None
        self._flow_slices: dict[int, list[int]] | None = None
        self.pid_track: dict[int, int] = {}             # process pid -> its track uuid

    @property
    def tracks(self) -> dict[int, Track]:
        return self.decoder.tracks

    def problem(self, kind: str, message: str, *, warn: bool = False, **ctx: Any) -> None:
        self.report.add(Problem(kind, message, **ctx), warn)

    def _id(self, table: dict, items: list, value: Any) -> int:
        i = table.get(value)
        if i is None:
            i = table[value] = len(items)
            items.append(value)
        return i

    def name_id(self, name: str) -> int:
        return self._id(self.name_ids, self.names, name)

    def tidx(self, uuid: int) -> int:
        return self._id(self.track_idx, self.track_uuid, uuid)

    def name_of(self, i: int) -> str | None:
        """The name of event ``i`` (None: unnamed)."""
        n = self.ev_name[i]
        return self.names[n] if n >= 0 else None

    # pass 1: every packet in file order
    def scan(self) -> None:
        for offs, packets in iter_packet_batches(self.path):
            for off, p in zip(offs, packets):
                record = self.decoder.packet(p, off)
                if isinstance(record, Event):
                    self.event(record)
        d = self.decoder
        self.counts.update(packets=d.packets, descriptors=d.descriptors, interned=d.interned)
        if d.packets == 0:
            self.problem("empty", "the trace holds no packets")

    def event(self, ev: Event) -> None:
        ts, off = ev.ts, ev.offset
        name = self.name_id(ev.name) if ev.name is not None else -1
        track = self.tidx(ev.track)
        if ev.track not in self.used_first:
            self.used_first[ev.track] = (ts, name, off)
        for extra in ev.extra_counters:
            self.used_first.setdefault(extra, (ts, name, off))
            self.counter_use[self.tidx(extra)] = self.counter_use.get(self.tidx(extra), 0) + 1
        if ev.type == COUNTER:
            self.counter_use[track] = self.counter_use.get(track, 0) + 1
            return
        if ev.type not in (BEGIN, END, INSTANT):
            self.problem("bad-event", f"track event of type {ev.type} (not a slice, instant or "
                         "counter)", offset=off, ts=ts)
            return
        i = len(self.ev_ts)
        self.ev_ts.append(ts)
        self.ev_track.append(track)
        self.ev_type.append(ev.type)
        self.ev_name.append(name)
        self.ev_off.append(off)
        self.ev_state.append(ev.state)
        self.ev_cats.append(self._id(self.cat_ids, self.cat_sets, ev.categories))
        self.ev_args.append(1 if ev.has_args else 0)
        for fid in ev.flow_ids:
            self.fl_id.append(fid)
            self.fl_ev.append(i)

    # labels
    def process_of(self, uuid: int) -> int | None:
        """uuid of the process track a track belongs to (None: global)."""
        seen = set()
        while uuid in self.tracks and uuid not in seen:
            seen.add(uuid)
            t = self.tracks[uuid]
            if t.pid is not None:
                return uuid
            if t.thread is not None:
                return self.pid_track.get(t.thread[0])
            if t.parent is None:
                return None
            uuid = t.parent
        return None

    def track_name(self, uuid: int) -> str:
        t = self.tracks.get(uuid)
        return t.title if t is not None else f"undeclared track {uuid}"

    def label(self, uuid: int) -> str:
        proc = self.process_of(uuid)
        name = self.track_name(uuid)
        if proc is None or proc == uuid:
            return name
        return f"{self.track_name(proc)} / {name}"

    def where(self, i: int) -> dict[str, Any]:
        """Where event ``i`` is, for a Problem."""
        return dict(track=self.label(self.track_uuid[self.ev_track[i]]), ts=int(self.ev_ts[i]),
                    offset=int(self.ev_off[i]), name=self.name_of(i))

    # pass 2: tracks, nesting, flows
    def check_tracks(self) -> None:
        threads: dict[tuple[int, int], int] = {}
        for uuid, t in self.tracks.items():
            if t.pid is not None:
                other = self.pid_track.setdefault(t.pid, uuid)
                if other != uuid:
                    self.problem("pid-reuse", f"tracks {other} and {uuid} both describe process "
                                 f"pid {t.pid}", track=t.title)
            if t.thread is not None:
                other = threads.setdefault(t.thread, uuid)
                if other != uuid:
                    self.problem("pid-reuse", f"tracks {other} and {uuid} both describe thread "
                                 f"{t.thread}", track=t.title)
            if t.parent is not None:
                if t.parent not in self.tracks and t.parent != 0:
                    self.problem("undeclared-parent", f"parent_uuid {t.parent} of track "
                                 f"{uuid} is not declared", track=t.title,
                                 offset=self.decoder.track_offsets[uuid])
                seen, up = {uuid}, t.parent
                while up in self.tracks and self.tracks[up].parent is not None:
                    if up in seen:
                        self.problem("track-cycle", f"track {uuid}'s parents form a cycle",
                                     track=t.title)
                        break
                    seen.add(up)
                    up = self.tracks[up].parent
        for uuid, (ts, name, off) in self.used_first.items():
            if uuid != 0 and uuid not in self.tracks:
                self.problem("undeclared-track", f"events use track uuid {uuid}, which no "
                             "TrackDescriptor declares", ts=ts, offset=off,
                             name=self.names[name] if name >= 0 else None)
        for tr, n in self.counter_use.items():
            t = self.tracks.get(self.track_uuid[tr])
            if t is not None and not t.counter:
                self.problem("counter-on-slice-track", f"{n} counter value(s) on a track without "
                             "a CounterDescriptor", track=self.label(self.track_uuid[tr]))
        self.counts["counter_values"] = sum(self.counter_use.values())
        self.counts["tracks"] = len(self.tracks)
        self.counts["processes"] = len(self.pid_track)
        self.counts["sequences"] = len([s for s in self.decoder.seqs if s])

    def nest(self) -> None:
        """Pair every track's BEGIN/END/INSTANT in Perfetto's order and name what fails."""
        n = len(self.ev_ts)
        ts = np.frombuffer(self.ev_ts, dtype=np.int64) if n else np.zeros(0, np.int64)
        track = np.frombuffer(self.ev_track, dtype=np.int32) if n else np.zeros(0, np.int32)
        typ = np.frombuffer(self.ev_type, dtype=np.int8) if n else np.zeros(0, np.int8)
        name = np.frombuffer(self.ev_name, dtype=np.int32) if n else np.zeros(0, np.int32)
        paired = pair(track, ts, typ, name)
        for tr in sorted({int(t) for t in np.unique(track)}):
            t = self.tracks.get(self.track_uuid[tr])
            if t is not None and t.counter:
                first = int(np.flatnonzero(track == tr)[np.argmin(ts[track == tr])])
                self.problem("slice-on-counter-track", "slices on a counter track",
                             track=self.label(t.uuid), ts=int(ts[first]))
        for i in paired.misplaced:
            self.problem("misplaced-end", "SLICE_END with no open slice on its track "
                         "(Perfetto drops it)", **self.where(i))
        for e, b in paired.crossing:
            self.problem("crossing-slices", f"SLICE_END named {self.name_of(e)!r} closes the "
                         f"innermost open slice {self.name_of(b)!r} (begun at {int(ts[b])}): "
                         "the slices cross", **self.where(e))
        for b in paired.unclosed:
            self.problem("unclosed-slice", "SLICE_BEGIN never ended on its track",
                         **self.where(b))
        partner = paired.partner
        self.ts, self.track, self.typ, self.name, self.partner = ts, track, typ, name, partner
        closed = (typ == BEGIN) & (partner >= 0)
        self.slice_idx = np.flatnonzero(closed | (typ == INSTANT))
        self.slice_end = np.where(typ[self.slice_idx] == INSTANT, self.slice_idx,
                                  partner[self.slice_idx])
        self.counts["slices"] = int(closed.sum())
        self.counts["instants"] = int((typ == INSTANT).sum())

    def flows(self) -> None:
        if not len(self.fl_id):
            self.flow_pairs = np.zeros((0, 2), dtype=np.int64)
            return
        fid = np.frombuffer(self.fl_id, dtype=np.uint64)
        ev = np.frombuffer(self.fl_ev, dtype=np.int64)
        # a flow id on an END belongs to the slice that END closes
        slice_of = np.where(self.typ[ev] == END, self.partner[ev], ev)
        ok = slice_of >= 0
        pairs = np.unique(np.stack([fid[ok].view(np.int64), slice_of[ok]], axis=1), axis=0)
        self.flow_pairs = pairs                     # (flow id, slice begin index), sorted
        ids, counts = np.unique(pairs[:, 0], return_counts=True)
        self.counts["flows"] = len(ids)
        self.counts["flow_links"] = len(pairs)
        for bad in ids[counts < 2].tolist():
            s = int(pairs[np.searchsorted(pairs[:, 0], bad), 1])
            self.problem("dangling-flow", f"flow id {bad & 0xFFFFFFFFFFFFFFFF} is on only one "
                         "slice", **self.where(s))
        zero = int((pairs[:, 0] == 0).sum())
        if zero:
            self.problem("bad-flow", f"{zero} slice(s) carry flow id 0")

    def tally(self) -> None:
        per_track = np.bincount(self.track[self.slice_idx], minlength=len(self.track_uuid))
        rep = self.report
        for tr, n in enumerate(per_track.tolist()):
            uuid = self.track_uuid[tr]
            proc = self.process_of(uuid)
            pname = self.track_name(proc) if proc is not None else "(no process)"
            lane = self.track_name(uuid) if proc != uuid else "(process track)"
            rep.per_process[pname] = rep.per_process.get(pname, 0) + n
            lanes = rep.per_lane.setdefault(pname, {})
            lanes[lane] = lanes.get(lane, 0) + n
        for uuid in self.pid_track.values():
            m = _RANK_RE.match(self.track_name(uuid))
            if m:
                rank = int(m.group(1))
                if rank in rep.ranks and rep.ranks[rank] != self.track_name(uuid):
                    self.problem("duplicate-rank", f"processes {rep.ranks[rank]!r} and "
                                 f"{self.track_name(uuid)!r} both claim rank {rank}")
                rep.ranks.setdefault(rank, self.track_name(uuid))

    # args, read back on demand
    def slice_args(self, f: BinaryIO, k: int) -> tuple[dict[str, Any], tuple[str, ...]]:
        """Args and categories of slice ``k`` (index into slice_idx): BEGIN's args merged with
        END's, as Perfetto does."""
        b, e = int(self.slice_idx[k]), int(self.slice_end[k])
        args = self.decoder.args_at(f, self.ev_off[b], self.ev_state[b]) if self.ev_args[b] else {}
        if e != b and self.ev_args[e]:
            args.update(self.decoder.args_at(f, self.ev_off[e], self.ev_state[e]))
        return args, self.cat_sets[self.ev_cats[b]]

    def flow_map(self) -> dict[int, list[int]]:
        """slice begin index -> its flow ids (built on demand: only the input check needs it)."""
        if self._flow_map is None:
            self._flow_map = defaultdict(list)
            for fid, b in self.flow_pairs.tolist():
                self._flow_map[b].append(fid & 0xFFFFFFFFFFFFFFFF)
        return self._flow_map

    def flow_slices(self) -> dict[int, list[int]]:
        """flow id -> slice begin indices it is on (built on demand)."""
        if self._flow_slices is None:
            self._flow_slices = defaultdict(list)
            for fid, b in self.flow_pairs.tolist():
                self._flow_slices[fid & 0xFFFFFFFFFFFFFFFF].append(b)
        return self._flow_slices

    def run(self) -> VerifyReport:
        self.scan()
        self.check_tracks()
        self.nest()
        self.flows()
        self.tally()
        self.report.counts = dict(self.counts)
        return self.report
