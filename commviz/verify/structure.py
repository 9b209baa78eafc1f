"""``commviz verify``: read a .pftrace back with Perfetto's own protos and check what the UI shows.

A trace that parses can still lose data silently in Perfetto: an END that closes the wrong
slice, a packet skipped because its sequence never cleared its incremental state, an event on a
track nobody declared, a flow that links nothing. This module re-derives what trace processor
would build, packet by packet in file order (the order Perfetto resolves interning and
descriptors in), then per track in timestamp order (the order it nests slices in), and reports
every place where that differs from a well-formed trace. Given the run the trace was merged
from, it also checks that every slice of every input trace is there exactly once, with its
duration, its args and its launch flow.

The file is streamed: packets are framed from the wire format and parsed in batches, and only a
few integers per event are kept (numpy arrays), so a trace of millions of events verifies in
bounded memory. Args are decoded on demand, one rank at a time, by seeking back to the packets.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from commviz.errors import SourceError, TraceError
from commviz.merge.flows import GPU_CATS, LAUNCH_CAT, LAUNCH_CATS
from commviz.write.read import iter_packet_batches, open_trace, varint

BEGIN, END, INSTANT, COUNTER = (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END,
                                pb.TrackEvent.TYPE_INSTANT, pb.TrackEvent.TYPE_COUNTER)
CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
BOOTTIME = pb.BUILTIN_CLOCK_BOOTTIME     # trace time, unless a snapshot says otherwise
_SEQ_CLOCKS = range(64, 128)             # clock ids scoped to one packet sequence
_TS_MIN, _TS_MAX = -(1 << 63), (1 << 63) - 1    # trace processor's int64 timestamps
_DETAILS_PER_KIND = 20            # problems kept in full per kind; all are counted
_RANK_RE = re.compile(r"^\s*rank\s+(\d+)\b", re.IGNORECASE)
# Tracks commviz derives from the inputs (comm lanes, per-PG summaries) may repeat an input
# slice's name and time; "exactly once" counts the other tracks only.
_DERIVED_RE = re.compile(r"^(PG |summary\b)", re.IGNORECASE)
# Slices of the profiler's own bookkeeping, not of the job.
_SKIPPED_CATS = frozenset({"Trace"})
# interned tables read back: InternedData field -> the field of its entries holding the value
_TABLES = {"event_names": "name", "event_categories": "name", "debug_annotation_names": "name",
           "debug_annotation_string_values": "str", "correlation_id_str": "str",
           "debug_annotation_value_type_names": "name"}


@dataclass(frozen=True)
class Problem:
    """One thing wrong in the trace, with what a person needs to find it."""

    kind: str                      # "unclosed-slice", "misplaced-end", "undeclared-track", ...
    message: str
    track: str | None = None       # "rank 0 · host · cuda:0 / stream 7"
    ts: int | None = None          # trace time (BOOTTIME ns, clocks resolved)
    name: str | None = None        # the event's name
    offset: int | None = None      # byte offset of the packet in the file

    def __str__(self) -> str:
        where = [f"track {self.track!r}" if self.track else "",
                 f"ts {self.ts}" if self.ts is not None else "",
                 f"event {self.name!r}" if self.name else "",
                 f"byte {self.offset}" if self.offset is not None else ""]
        ctx = ", ".join(w for w in where if w)
        return f"[{self.kind}] {self.message}" + (f" ({ctx})" if ctx else "")


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


@dataclass(frozen=True)
class Slice:
    """One slice as Perfetto shows it (instants have ``dur == 0`` and ``instant``)."""

    process: str
    track: str
    name: str | None
    ts: int
    dur: int
    args: dict[str, Any]
    flow_ids: tuple[int, ...]
    categories: tuple[str, ...]
    instant: bool = False


# --- reading packets --------------------------------------------------------------------------

def _packet_at(f: BinaryIO, offset: int) -> Any:
    f.seek(offset)
    head = f.read(11)
    length, pos = varint(head, 1) or (0, 0)
    payload = head[pos:] + f.read(length - (len(head) - pos))
    return pb.TracePacket.FromString(payload[:length])


# --- per-sequence interning state ---------------------------------------------------------------

class _State:
    """One generation of a sequence's incremental state (interned tables and defaults)."""

    __slots__ = ("seq", "tables", "default_track", "default_clock", "name_ids")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tables: dict[str, dict[int, Any]] = {k: {} for k in _TABLES}
        self.default_track: int | None = None
        self.default_clock: int | None = None
        self.name_ids: dict[int, int] = {}   # name iid -> global name id (cache)


class _Clock:
    """A clock a ClockSnapshot related to BOOTTIME: ``boot = boot0 + (value - value0) * mult``.
    An incremental clock's packet timestamps are deltas from the previous one on the sequence."""

    __slots__ = ("value0", "boot0", "mult", "incremental", "last")

    def __init__(self, value0: int, boot0: int, mult: int, incremental: bool) -> None:
        self.value0, self.boot0, self.mult, self.incremental = value0, boot0, mult, incremental
        self.last = value0

    def to_boot(self, raw: int) -> int:
        if self.incremental:
            self.last += raw
            raw = self.last
        return self.boot0 + (raw - self.value0) * self.mult


def _json_equal(out: str, inp: Any) -> bool:
    try:
        return _same(orjson.loads(out), inp)
    except orjson.JSONDecodeError:
        return False


def _same(out: Any, inp: Any) -> bool:
    """Whether an arg read back from the trace carries the input's value.

    Debug annotations are typed: lists and dicts may come back as nested values or as
    legacy JSON strings, ints may come back as doubles where the writer chose to.
    """
    if type(out) is type(inp) and out == inp:
        return True
    if isinstance(inp, bool) or isinstance(out, bool):
        return out is inp or (isinstance(out, (int, float)) and isinstance(inp, (int, float))
                              and not isinstance(out, bool) and out == inp)
    if isinstance(inp, (int, float)) and isinstance(out, (int, float)):
        if isinstance(inp, float) and math.isnan(inp):
            return isinstance(out, float) and math.isnan(out)
        return out == inp or abs(out - inp) <= 1e-9 * max(1.0, abs(inp))
    if isinstance(inp, str):
        return out == inp
    if inp is None:
        return out is None or out in ("null", "None")
    if isinstance(out, str):
        return _json_equal(out, inp)
    if isinstance(inp, (list, tuple)) and isinstance(out, list):
        return len(out) == len(inp) and all(_same(o, i) for o, i in zip(out, inp))
    if isinstance(inp, dict) and isinstance(out, dict):
        return out.keys() == inp.keys() and all(_same(out[k], inp[k]) for k in inp)
    return False


# --- the checker ------------------------------------------------------------------------------

class _Verifier:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.report = VerifyReport(path)
        self.seqs: dict[int, _State | None] = {}        # seq -> current state (None: never cleared)
        self.states: list[_State] = []                  # every generation, by state id
        self.names: list[str] = []                      # global name id -> name
        self.name_ids: dict[str, int] = {}
        self.desc: dict[int, Any] = {}                  # uuid -> TrackDescriptor
        self.desc_off: dict[int, int] = {}
        self.track_idx: dict[int, int] = {}             # uuid -> dense index
        self.track_uuid: list[int] = []
        self.used_first: dict[int, tuple[int, int, int]] = {}   # uuid -> (ts, name id, offset)
        self.counter_use: dict[int, int] = {}           # track index -> samples
        self.counts: Counter = Counter()
        # per event (BEGIN / END / INSTANT), in file order
        self.ev_ts, self.ev_track, self.ev_type = array("q"), array("i"), array("b")
        self.ev_name, self.ev_off, self.ev_state = array("i"), array("q"), array("i")
        self.ev_args = array("b")                       # 1: the event carries debug annotations
        self.fl_id, self.fl_ev = array("Q"), array("q")
        self.clocks: dict[tuple[int, int], _Clock] = {}  # (seq or 0 for global, clock id)
        self._flow_map: dict[int, list[int]] | None = None
        self._flow_slices: dict[int, list[int]] | None = None
        self.pid_track: dict[int, int] = {}             # process pid -> its track uuid

    # problems
    def problem(self, kind: str, message: str, *, warn: bool = False, **ctx: Any) -> None:
        if warn:
            if sum(1 for w in self.report.warnings if w.kind == kind) < _DETAILS_PER_KIND:
                self.report.warnings.append(Problem(kind, message, **ctx))
            return
        n = self.report.error_counts[kind]
        self.report.error_counts[kind] = n + 1
        if n < _DETAILS_PER_KIND:
            self.report.errors.append(Problem(kind, message, **ctx))

    def name_id(self, name: str) -> int:
        i = self.name_ids.get(name)
        if i is None:
            i = self.name_ids[name] = len(self.names)
            self.names.append(name)
        return i

    def tidx(self, uuid: int) -> int:
        i = self.track_idx.get(uuid)
        if i is None:
            i = self.track_idx[uuid] = len(self.track_uuid)
            self.track_uuid.append(uuid)
        return i

    # pass 1: every packet in file order
    def scan(self) -> None:
        n = 0
        for offs, packets in iter_packet_batches(self.path):
            for off, p in zip(offs, packets):
                self.packet(p, off)
            n += len(offs)
        self.counts["packets"] = n
        if n == 0:
            self.problem("empty", "the trace holds no packets")

    def packet(self, p: Any, off: int) -> None:
        seq = p.trusted_packet_sequence_id
        flags = p.sequence_flags
        st = self.seqs.get(seq)
        if flags & CLEARED or p.incremental_state_cleared:
            st = self.seqs[seq] = _State(seq)
            self.states.append(st)
        elif seq not in self.seqs:
            self.seqs[seq] = None
        # the order trace processor reads a packet in: defaults, interning, clock snapshot
        if p.HasField("trace_packet_defaults"):
            self.defaults(p.trace_packet_defaults, st, seq, off)
        if p.HasField("interned_data"):
            self.interned(p.interned_data, st, seq, off)
        kind = p.WhichOneof("data")
        if kind == "clock_snapshot":
            self.snapshot(p.clock_snapshot, seq, off)
            return
        if flags & NEEDS and st is None:
            self.problem("skipped-packet", f"sequence {seq} uses incremental state before any "
                         "packet with SEQ_INCREMENTAL_STATE_CLEARED: Perfetto drops this packet",
                         offset=off, ts=p.timestamp or None)
            return
        # every timestamped packet moves its sequence's incremental clock, events or not
        ts = self.timestamp(p, st, seq, off) if p.HasField("timestamp") else None
        if ts is not None and not _TS_MIN <= ts <= _TS_MAX:
            self.problem("bad-timestamp", f"timestamp {ts} ns is outside what trace processor "
                         "holds (signed 64-bit): Perfetto drops or misplaces this packet",
                         offset=off)
            return
        if kind == "track_event":
            if ts is not None:
                self.event(ts, p.track_event, st, seq, flags, off)
            elif not p.HasField("timestamp"):
                self.problem("no-timestamp", "track event without a packet timestamp",
                             offset=off)
        elif kind == "track_descriptor":
            self.descriptor(p.track_descriptor, off)

    def snapshot(self, snap: Any, seq: int, off: int) -> None:
        """Relate each clock of a ClockSnapshot to BOOTTIME (nothing else in its packet counts)."""
        boot = next((c.timestamp for c in snap.clocks if c.clock_id == BOOTTIME), None)
        for c in snap.clocks:
            if c.clock_id == BOOTTIME:
                continue
            scoped = c.clock_id in _SEQ_CLOCKS
            if scoped and seq == 0:
                self.problem("bad-clock", f"ClockSnapshot of sequence-scoped clock {c.clock_id} "
                             "on sequence 0", offset=off)
            elif boot is None:
                self.problem("bad-clock", f"ClockSnapshot relates clock {c.clock_id} to no "
                             "BOOTTIME reading", offset=off)
            else:
                self.clocks[(seq if scoped else 0, c.clock_id)] = _Clock(
                    c.timestamp, boot, c.unit_multiplier_ns or 1, c.is_incremental)

    def timestamp(self, p: Any, st: _State | None, seq: int, off: int) -> int | None:
        """The packet's time in trace time (BOOTTIME ns), resolving its clock."""
        clock = p.timestamp_clock_id or (st.default_clock if st is not None else None) or BOOTTIME
        if clock == BOOTTIME:
            return p.timestamp
        conv = self.clocks.get((seq if clock in _SEQ_CLOCKS else 0, clock))
        if conv is None:
            self.problem("bad-clock", f"timestamp on clock {clock}, which no ClockSnapshot on "
                         f"sequence {seq} relates to BOOTTIME: Perfetto drops it", offset=off)
            return None
        return conv.to_boot(p.timestamp)

    def interned(self, data: Any, st: _State | None, seq: int, off: int) -> None:
        if seq == 0 or st is None:
            self.problem("bad-interning", f"interned data on sequence {seq}, which "
                         + ("is not a valid sequence id" if seq == 0 else
                            "never set SEQ_INCREMENTAL_STATE_CLEARED"), offset=off)
            return
        for table, value_field in _TABLES.items():
            entries = getattr(data, table)
            if not entries:
                continue
            known = st.tables[table]
            for e in entries:
                value = getattr(e, value_field)
                old = known.get(e.iid)
                if old is not None and old != value:
                    self.problem("bad-interning", f"{table} iid {e.iid} redefined on sequence "
                                 f"{seq}: {old!r} then {value!r}", offset=off)
                known[e.iid] = value
        self.counts["interned"] += 1

    def defaults(self, d: Any, st: _State | None, seq: int, off: int) -> None:
        if st is None:
            self.problem("bad-interning", f"TracePacketDefaults on sequence {seq}, which never "
                         "set SEQ_INCREMENTAL_STATE_CLEARED", offset=off)
            return
        if d.HasField("track_event_defaults") and d.track_event_defaults.HasField("track_uuid"):
            st.default_track = d.track_event_defaults.track_uuid
        if d.HasField("timestamp_clock_id"):
            st.default_clock = d.timestamp_clock_id

    def descriptor(self, d: Any, off: int) -> None:
        self.counts["descriptors"] += 1
        if not d.HasField("uuid"):
            self.problem("bad-track", "TrackDescriptor without a uuid", offset=off,
                         name=d.name or None)
            return
        prev = self.desc.get(d.uuid)
        if prev is None:
            keep = pb.TrackDescriptor()
            keep.CopyFrom(d)
            self.desc[d.uuid] = keep
            self.desc_off[d.uuid] = off
        elif prev != d:
            had = {f.name for f, _ in prev.ListFields()}
            has = {f.name for f, _ in d.ListFields()}
            diff = sorted(had ^ has | {f.name for f, v in d.ListFields()
                                       if getattr(prev, f.name) != v})
            self.problem("conflicting-track", f"track uuid {d.uuid} declared again differently "
                         f"(first at byte {self.desc_off[d.uuid]}; fields {', '.join(diff)})",
                         offset=off, track=prev.name or d.name or str(d.uuid))

    def resolve(self, st: _State | None, table: str, iid: int, seq: int, off: int, ts: int,
                what: str) -> Any:
        value = st.tables[table].get(iid) if st is not None else None
        if value is None:
            self.problem("bad-interning", f"{what} iid {iid} is not defined on sequence {seq}",
                         offset=off, ts=ts)
        return value

    def check_annotations(self, anns: Any, st: _State | None, seq: int, off: int, ts: int) -> None:
        names = st.tables["debug_annotation_names"] if st is not None else {}
        strings = st.tables["debug_annotation_string_values"] if st is not None else {}
        for a in anns:
            iid = a.name_iid                    # 0: not set (0 is no valid iid)
            if iid and iid not in names:
                self.resolve(st, "debug_annotation_names", iid, seq, off, ts,
                             "debug annotation name")
            iid = a.string_value_iid
            if iid and iid not in strings:
                self.resolve(st, "debug_annotation_string_values", iid, seq, off, ts,
                             "debug annotation string value")
            if a.dict_entries:
                self.check_annotations(a.dict_entries, st, seq, off, ts)
            if a.array_values:
                self.check_annotations(a.array_values, st, seq, off, ts)

    def event(self, ts: int, te: Any, st: _State | None, seq: int, flags: int, off: int) -> None:
        typ = te.type
        if te.HasField("track_uuid"):
            uuid = te.track_uuid
        elif st is not None and st.default_track is not None:
            uuid = st.default_track
            if not flags & NEEDS:
                self.problem("bad-interning", "event takes its track from TracePacketDefaults "
                             "but lacks SEQ_NEEDS_INCREMENTAL_STATE", warn=True, offset=off, ts=ts)
        else:
            self.problem("no-track", "event without track_uuid and no default track on its "
                         f"sequence {seq}", offset=off, ts=ts)
            return
        name = -1
        if te.HasField("name_iid"):
            if st is not None and te.name_iid in st.name_ids:
                name = st.name_ids[te.name_iid]
            else:
                s = self.resolve(st, "event_names", te.name_iid, seq, off, ts, "event name")
                if s is not None:
                    name = st.name_ids[te.name_iid] = self.name_id(s)  # type: ignore[union-attr]
        elif te.HasField("name"):
            name = self.name_id(te.name)
        for iid in te.category_iids:
            self.resolve(st, "event_categories", iid, seq, off, ts, "category")
        if te.HasField("correlation_id_str_iid"):
            self.resolve(st, "correlation_id_str", te.correlation_id_str_iid, seq, off, ts,
                         "correlation id")
        if te.debug_annotations:
            self.check_annotations(te.debug_annotations, st, seq, off, ts)
        track = self.tidx(uuid)
        if uuid not in self.used_first:
            self.used_first[uuid] = (ts, name, off)
        for extra in te.extra_counter_track_uuids:
            self.used_first.setdefault(extra, (ts, name, off))
            self.counter_use[self.tidx(extra)] = self.counter_use.get(self.tidx(extra), 0) + 1
        if typ == COUNTER:
            self.counter_use[track] = self.counter_use.get(track, 0) + 1
            return
        if typ not in (BEGIN, END, INSTANT):
            self.problem("bad-event", f"track event of type {typ} (not a slice, instant or "
                         "counter)", offset=off, ts=ts)
            return
        i = len(self.ev_ts)
        self.ev_ts.append(ts)
        self.ev_track.append(track)
        self.ev_type.append(typ)
        self.ev_name.append(name)
        self.ev_off.append(off)
        self.ev_state.append(len(self.states) - 1 if st is not None else -1)
        self.ev_args.append(1 if te.debug_annotations else 0)
        for ids in (te.flow_ids, te.terminating_flow_ids, te.flow_ids_old,
                    te.terminating_flow_ids_old):
            for fid in ids:
                self.fl_id.append(fid)
                self.fl_ev.append(i)

    # labels
    def process_of(self, uuid: int) -> int | None:
        """uuid of the process track a track belongs to (None: global)."""
        seen = set()
        while uuid in self.desc and uuid not in seen:
            seen.add(uuid)
            d = self.desc[uuid]
            if d.HasField("process"):
                return uuid
            if d.HasField("thread"):
                return self.pid_track.get(d.thread.pid)
            if not d.HasField("parent_uuid"):
                return None
            uuid = d.parent_uuid
        return None

    def track_name(self, uuid: int) -> str:
        d = self.desc.get(uuid)
        if d is None:
            return f"undeclared track {uuid}"
        if d.name or d.static_name:
            return d.name or d.static_name
        if d.HasField("thread"):
            return d.thread.thread_name or f"thread {d.thread.tid}"
        if d.HasField("process"):
            return d.process.process_name or f"process {d.process.pid}"
        return f"track {uuid}"

    def label(self, uuid: int) -> str:
        proc = self.process_of(uuid)
        name = self.track_name(uuid)
        if proc is None or proc == uuid:
            return name
        return f"{self.track_name(proc)} / {name}"

    # pass 2: tracks, nesting, flows
    def check_tracks(self) -> None:
        threads: dict[tuple[int, int], int] = {}
        for uuid, d in self.desc.items():
            if d.HasField("process"):
                other = self.pid_track.setdefault(d.process.pid, uuid)
                if other != uuid:
                    self.problem("pid-reuse", f"tracks {other} and {uuid} both describe process "
                                 f"pid {d.process.pid}", track=self.track_name(uuid))
            if d.HasField("thread"):
                key = (d.thread.pid, d.thread.tid)
                other = threads.setdefault(key, uuid)
                if other != uuid:
                    self.problem("pid-reuse", f"tracks {other} and {uuid} both describe thread "
                                 f"{key}", track=self.track_name(uuid))
            if d.HasField("parent_uuid"):
                if d.parent_uuid not in self.desc and d.parent_uuid != 0:
                    self.problem("undeclared-parent", f"parent_uuid {d.parent_uuid} of track "
                                 f"{uuid} is not declared", track=self.track_name(uuid),
                                 offset=self.desc_off[uuid])
                seen, up = {uuid}, d.parent_uuid
                while up in self.desc and self.desc[up].HasField("parent_uuid"):
                    if up in seen:
                        self.problem("track-cycle", f"track {uuid}'s parents form a cycle",
                                     track=self.track_name(uuid))
                        break
                    seen.add(up)
                    up = self.desc[up].parent_uuid
        for uuid, (ts, name, off) in self.used_first.items():
            if uuid != 0 and uuid not in self.desc:
                self.problem("undeclared-track", f"events use track uuid {uuid}, which no "
                             "TrackDescriptor declares", ts=ts, offset=off,
                             name=self.names[name] if name >= 0 else None)
        for tr, n in self.counter_use.items():
            d = self.desc.get(self.track_uuid[tr])
            if d is not None and not d.HasField("counter"):
                self.problem("counter-on-slice-track", f"{n} counter value(s) on a track without "
                             "a CounterDescriptor", track=self.label(self.track_uuid[tr]))
        self.counts["counter_values"] = sum(self.counter_use.values())
        self.counts["tracks"] = len(self.desc)
        self.counts["processes"] = len(self.pid_track)
        self.counts["sequences"] = len([s for s in self.seqs if s])

    def nest(self) -> None:
        """Replay every track's BEGIN/END/INSTANT in Perfetto's order and pair them up."""
        n = len(self.ev_ts)
        ts = np.frombuffer(self.ev_ts, dtype=np.int64) if n else np.zeros(0, np.int64)
        track = np.frombuffer(self.ev_track, dtype=np.int32) if n else np.zeros(0, np.int32)
        typ = np.frombuffer(self.ev_type, dtype=np.int8) if n else np.zeros(0, np.int8)
        name = np.frombuffer(self.ev_name, dtype=np.int32) if n else np.zeros(0, np.int32)
        order = np.lexsort((ts, track))          # stable: equal timestamps keep file order
        partner = np.full(n, -1, dtype=np.int64)  # BEGIN <-> END
        counter_tracks = {i for i, u in enumerate(self.track_uuid)
                          if u in self.desc and self.desc[u].HasField("counter")}
        track_l, typ_l, name_l = track.tolist(), typ.tolist(), name.tolist()
        stack: list[int] = []
        cur = -1
        for i in order.tolist():
            tr = track_l[i]
            if tr != cur:
                self.unclosed(stack)
                stack = []
                cur = tr
                if tr in counter_tracks:
                    self.problem("slice-on-counter-track", "slices on a counter track",
                                 track=self.label(self.track_uuid[tr]), ts=int(ts[i]))
            t = typ_l[i]
            if t == BEGIN:
                stack.append(i)
            elif t == END:
                if not stack:
                    self.problem("misplaced-end", "SLICE_END with no open slice on its track "
                                 "(Perfetto drops it)", track=self.label(self.track_uuid[tr]),
                                 ts=int(ts[i]), offset=self.ev_off[i],
                                 name=self.names[name_l[i]] if name_l[i] >= 0 else None)
                    continue
                b = stack.pop()
                partner[b], partner[i] = i, b
                if name_l[i] >= 0 and name_l[i] != name_l[b]:
                    self.problem("crossing-slices", f"SLICE_END named {self.names[name_l[i]]!r} "
                                 f"closes the innermost open slice {self.names[name_l[b]]!r} "
                                 f"(begun at {int(ts[b])}): the slices cross",
                                 track=self.label(self.track_uuid[tr]), ts=int(ts[i]),
                                 offset=self.ev_off[i], name=self.names[name_l[i]])
        self.unclosed(stack)
        self.ts, self.track, self.typ, self.name, self.partner = ts, track, typ, name, partner
        closed = (typ == BEGIN) & (partner >= 0)
        self.slice_idx = np.flatnonzero(closed | (typ == INSTANT))
        self.slice_end = np.where(typ[self.slice_idx] == INSTANT, self.slice_idx,
                                  partner[self.slice_idx])
        self.counts["slices"] = int(closed.sum())
        self.counts["instants"] = int((typ == INSTANT).sum())

    def unclosed(self, stack: list[int]) -> None:
        for b in stack:
            self.problem("unclosed-slice", "SLICE_BEGIN never ended on its track",
                         track=self.label(self.track_uuid[self.ev_track[b]]), ts=self.ev_ts[b],
                         offset=self.ev_off[b],
                         name=self.names[self.ev_name[b]] if self.ev_name[b] >= 0 else None)

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
                         "slice", track=self.label(self.track_uuid[self.track[s]]),
                         ts=int(self.ts[s]), offset=self.ev_off[s],
                         name=self.names[self.name[s]] if self.name[s] >= 0 else None)
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
    def args_of(self, f: BinaryIO, event: int) -> tuple[dict[str, Any], tuple[str, ...]]:
        p = _packet_at(f, self.ev_off[event])
        st = self.states[self.ev_state[event]] if self.ev_state[event] >= 0 else None
        te = p.track_event
        cats = tuple(te.categories) + tuple(
            st.tables["event_categories"].get(i, "?") for i in te.category_iids) if st else \
            tuple(te.categories)
        return {self.ann_name(a, st): self.ann_value(a, st) for a in te.debug_annotations}, cats

    def ann_name(self, a: Any, st: _State | None) -> str:
        if a.HasField("name_iid"):
            return st.tables["debug_annotation_names"].get(a.name_iid, "?") if st else "?"
        return a.name

    def ann_value(self, a: Any, st: _State | None) -> Any:
        which = a.WhichOneof("value")
        if which is None:
            if a.dict_entries:
                return {self.ann_name(e, st): self.ann_value(e, st) for e in a.dict_entries}
            if a.array_values:
                return [self.ann_value(e, st) for e in a.array_values]
            return None
        if which == "string_value_iid":
            strings = st.tables["debug_annotation_string_values"] if st else {}
            raw = strings.get(a.string_value_iid)
            return raw.decode("utf-8", "replace") if raw is not None else None
        if which == "legacy_json_value":
            try:
                return json.loads(a.legacy_json_value)
            except ValueError:
                return a.legacy_json_value
        if which == "nested_value":
            return str(a.nested_value)
        return getattr(a, which)

    def slice_args(self, f: BinaryIO, k: int) -> tuple[dict[str, Any], tuple[str, ...]]:
        """Args of slice ``k`` (index into slice_idx): BEGIN's merged with END's, as Perfetto
        does."""
        b, e = int(self.slice_idx[k]), int(self.slice_end[k])
        args, cats = self.args_of(f, b)
        if e != b and self.ev_args[e]:
            end_args, _ = self.args_of(f, e)
            args.update(end_args)
        return args, cats

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


# --- comparing with the inputs --------------------------------------------------------------

def _input_slices(events: list[dict]) -> list[int]:
    """Indices of the input events that must reach the output: slices of real processes."""
    return [i for i, e in enumerate(events)
            if e.get("ph") == "X" and isinstance(e.get("pid"), int)
            and e.get("cat") not in _SKIPPED_CATS]


class _InputCheck:
    """Every slice of every input trace appears exactly once, with its duration, args, flow."""

    def __init__(self, v: _Verifier, run: Any) -> None:
        self.v = v
        self.run = run
        rank_of_proc = {label: rank for rank, label in v.report.ranks.items()}
        n_tracks = len(v.track_uuid)
        track_rank = np.full(n_tracks, -1, dtype=np.int64)
        derived = np.zeros(n_tracks, dtype=bool)
        for tr, uuid in enumerate(v.track_uuid):
            proc = v.process_of(uuid)
            if proc is not None:
                track_rank[tr] = rank_of_proc.get(v.track_name(proc), -1)
            derived[tr] = bool(_DERIVED_RE.match(v.track_name(uuid)))
        s_track = v.track[v.slice_idx]
        self.s_rank = track_rank[s_track]
        self.s_kept = ~derived[s_track]
        self.threads: dict[str, int] = {}      # "pid:tid" of an input thread -> id
        track_thread = np.array([self.thread_id(v.desc.get(u)) for u in v.track_uuid] or [-1],
                                dtype=np.int64)
        self.s_thread = track_thread[s_track] if len(s_track) else np.zeros(0, np.int64)

    def thread_id(self, d: Any) -> int:
        """The input thread a track shows: commviz names it in the track's merge key
        ("track PID:TID"); a thread track names it in its descriptor. -1: not known."""
        if d is None:
            return -1
        if d.sibling_merge_key.startswith("track "):
            key = d.sibling_merge_key[6:]
        elif d.HasField("thread"):
            key = f"{d.thread.pid}:{d.thread.tid}"
        else:
            return -1
        return self.threads.setdefault(key, len(self.threads))

    def check(self) -> None:
        from commviz.trace.load import load_trace   # MERGE's loader: the contract's reading

        v = self.v
        for problem in getattr(self.run, "problems", None) or ():
            v.problem("input", str(problem), warn=True)
        with open_trace(v.path) as f:
            for rank in sorted(self.run.ranks):
                paths = self.run.ranks[rank].trace_paths
                if not paths:
                    continue
                sel = np.flatnonzero((self.s_rank == rank) & self.s_kept)
                if not len(sel):
                    v.problem("missing-rank", f"rank {rank} has input traces but the output has "
                              f"no process named 'rank {rank} ...'")
                    continue
                for path in paths:
                    try:
                        trace = load_trace(path, rank=rank)
                    except TraceError as exc:
                        v.problem("input-unreadable", f"cannot compare with it: {exc}")
                        continue
                    self.check_trace(f, rank, trace, sel)

    def check_trace(self, f: BinaryIO, rank: int, trace: Any, sel: np.ndarray) -> None:
        v = self.v
        stats = v.report.inputs.setdefault(rank, Counter())
        events = trace.events
        wanted = _input_slices(events)
        out_ts = v.ts[v.slice_idx[sel]]
        out_name = v.name[v.slice_idx[sel]]
        out_dur = v.ts[v.slice_end[sel]] - out_ts
        out_thread = self.s_thread[sel]
        # events pair up per thread when the output says which thread each track shows
        threaded = bool((out_thread >= 0).any())
        if not threaded:
            out_thread = np.full(len(sel), -1, dtype=np.int64)
        by_key: dict[tuple[int, int, int], list[int]] = defaultdict(list)  # (thread, name, ts)
        for j, key in enumerate(zip(out_thread.tolist(), out_name.tolist(), out_ts.tolist())):
            by_key[key].append(j)
        offset = self.clock_offset(trace, wanted, out_name, out_ts)
        if offset:
            v.report.clock_offsets[rank] = offset
        want_key: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i in wanted:
            e = events[i]
            thread = self.threads.get(f"{e.get('pid')}:{e.get('tid')}", -2) if threaded else -1
            want_key[(thread, v.name_ids.get(e.get("name", ""), -2),
                      trace.ns(e["ts"]) + offset)].append(i)
        pairs: list[tuple[int, int]] = []          # (input event index, slice k)
        for key, ins in want_key.items():
            thread, name, ts = key
            outs = (by_key.get(key) or by_key.get((thread, name, ts - 1))
                    or by_key.get((thread, name, ts + 1)))
            e = events[ins[0]]
            where = dict(track=f"rank {rank}", ts=ts, name=e.get("name"))
            if not outs:
                stats["missing"] += len(ins)
                v.problem("missing-event", f"{e.get('cat')} event #{ins[0]} of "
                          f"{trace.path.name} (tid {e.get('tid')}) is not in the output", **where)
                continue
            if len(outs) != len(ins):
                diff = len(outs) - len(ins)
                stats["duplicated" if diff > 0 else "missing"] += abs(diff)
                v.problem("count-mismatch", f"{len(ins)} input event(s) of {trace.path.name} "
                          f"but {len(outs)} output slice(s) with this name and time", **where)
            for i, j in zip(sorted(ins, key=lambda i: events[i].get("dur", 0)),
                            sorted(outs, key=lambda j: int(out_dur[j]))):
                pairs.append((i, int(sel[j])))
                want = round(float(events[i].get("dur", 0)) * 1000)
                got = int(out_dur[j])
                if abs(got - want) > 2:
                    stats["bad_duration"] += 1
                    v.problem("duration", f"lasts {got} ns in the output, {want} ns in "
                              f"{trace.path.name} (crossing slices on one track?)", **where)
        stats["matched"] += len(pairs)
        self.check_args(f, trace, pairs, stats)
        self.check_launch_flows(trace, pairs, stats)
        self.check_other_flows(trace, pairs, stats)

    def clock_offset(self, trace: Any, wanted: list[int], out_name: np.ndarray,
                     out_ts: np.ndarray) -> int:
        """ns the merge moved this rank by (cross-host alignment), from the names that occur
        once in the input and once in the output; 0 without a clear majority."""
        v = self.v
        events = trace.events
        in_count = Counter(events[i].get("name") for i in wanted)
        out_count = Counter(out_name.tolist())
        once = {nid: t for nid, t in zip(out_name.tolist(), out_ts.tolist()) if out_count[nid] == 1}
        diffs: Counter = Counter()
        for i in wanted:
            nm = events[i].get("name")
            got = once.get(v.name_ids.get(nm, -2))
            if got is not None and in_count[nm] == 1:
                diffs[got - trace.ns(events[i]["ts"])] += 1
        if not diffs:
            return 0
        best, n = diffs.most_common(1)[0]
        return best if n * 2 > sum(diffs.values()) else 0

    def check_args(self, f: BinaryIO, trace: Any, pairs: list[tuple[int, int]],
                   stats: Counter) -> None:
        v = self.v
        for i, k in sorted(pairs, key=lambda p: v.ev_off[int(v.slice_idx[p[1]])]):
            e = trace.events[i]
            want = e.get("args") or {}
            got, cats = v.slice_args(f, k)
            bad = [key for key, val in want.items() if key not in got or not _same(got[key], val)]
            detail = [f"{key}: {want[key]!r} -> " + (repr(got[key]) if key in got else "missing")
                      for key in bad[:4]]
            if e.get("cat") and e["cat"] not in cats:
                detail.append(f"category {e['cat']!r} -> {list(cats)!r}")
            if detail:
                stats["bad_args"] += 1
                b = int(v.slice_idx[k])
                v.problem("args", f"differs from {trace.path.name}: " + "; ".join(detail)
                          + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""),
                          track=v.label(v.track_uuid[v.track[b]]), ts=int(v.ts[b]),
                          name=e.get("name"))

    def linked(self, b: int) -> set[int]:
        """Slice begin indices that share a flow id with slice begin ``b``."""
        flows, by_id = self.v.flow_map(), self.v.flow_slices()
        return {o for fid in flows.get(b, ()) for o in by_id.get(fid, ()) if o != b}

    def check_launch_flows(self, trace: Any, pairs: list[tuple[int, int]],
                           stats: Counter) -> None:
        """Every GPU event is linked to the CPU call with its correlation id, and to no other
        call of the input (with the input's own ``ac2g`` flows, or without: the merge draws
        them from correlation ids)."""
        v = self.v
        events = trace.events
        launch_of: dict[Any, int] = {}           # correlation -> launch slice begin
        corr_of: dict[int, Any] = {}             # CPU slice begin -> its correlation
        gpu: list[tuple[Any, int, int]] = []
        for i, k in pairs:
            e = events[i]
            corr = (e.get("args") or {}).get("correlation")
            if corr is None:
                continue
            b = int(v.slice_idx[k])
            if e.get("cat") in GPU_CATS:
                gpu.append((corr, i, b))
            elif e.get("cat") in LAUNCH_CATS:
                launch_of[corr] = b
                corr_of[b] = corr
        for corr, i, b in gpu:
            lb = launch_of.get(corr)
            if lb is None:
                continue
            linked = self.linked(b)
            wrong = sorted(o for o in linked if o in corr_of and corr_of[o] != corr)
            where = dict(track=v.label(v.track_uuid[v.track[b]]), ts=int(v.ts[b]),
                         name=events[i].get("name"))
            if lb in linked and not wrong:
                stats["launch_flows"] += 1
                continue
            stats["missing_flows" if lb not in linked else "wrong_flows"] += 1
            if wrong:
                v.problem("launch-flow", f"linked to {v.names[v.name[wrong[0]]]!r} (correlation "
                          f"{corr_of[wrong[0]]}), not only to its launch "
                          f"{v.names[v.name[lb]]!r} (correlation {corr})", **where)
            else:
                v.problem("launch-flow", f"no flow links it to its launch "
                          f"{v.names[v.name[lb]]!r} (correlation {corr})", **where)

    def check_other_flows(self, trace: Any, pairs: list[tuple[int, int]],
                          stats: Counter) -> None:
        """Every other input flow (``fwdbwd``, ...) links the slices starting at its points'
        times on their threads (any of them, where several start at one time)."""
        v = self.v
        events = trace.events
        out_of = {i: int(v.slice_idx[k]) for i, k in pairs}
        starting: dict[tuple, list[int]] = defaultdict(list)   # (pid, tid, ns) -> input events
        for i in out_of:
            e = events[i]
            starting[(e.get("pid"), e.get("tid"), trace.ns(e["ts"]))].append(i)
        points: dict[tuple, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for e in events:
            if e.get("ph") in ("s", "t", "f") and e.get("cat") != LAUNCH_CAT:
                at = starting.get((e.get("pid"), e.get("tid"), trace.ns(e["ts"])), [])
                points[(e.get("cat"), e.get("id"))]["s" if e["ph"] == "s" else "f"] += at
        for (cat, fid), ends in points.items():
            if not ends["s"] or not ends["f"]:
                continue                         # a point on no slice: nothing to link
            starts = {out_of[i] for i in ends["s"]}
            if any(self.linked(out_of[i]) & starts for i in ends["f"]):
                stats["other_flows"] += 1
                continue
            stats["missing_flows"] += 1
            b = out_of[ends["s"][0]]
            v.problem("flow", f"input flow {cat!r} id {fid} links nothing in the output",
                      track=v.label(v.track_uuid[v.track[b]]), ts=int(v.ts[b]),
                      name=v.names[v.name[b]] if v.name[b] >= 0 else None)


# --- public API ---------------------------------------------------------------------------------

def _check_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise SourceError(str(path), "no such file")
    return path


def verify_pftrace(path: str | Path, *, inputs: Any = None) -> VerifyReport:
    """Check a .pftrace as Perfetto will read it; with ``inputs`` (a ``commviz.trace.run.Run``)
    also check that every slice of its traces is there once, with its args and launch flow.

    Raises ``SourceError`` only when the file cannot be read as a trace at all; everything else
    is reported in the returned ``VerifyReport``.
    """
    v = _Verifier(_check_path(path))
    report = v.run()
    if inputs is not None:
        try:
            _InputCheck(v, inputs).check()
        except (ArithmeticError, ValueError, TypeError, KeyError) as exc:
            # an input no profiler writes (a ts of 1e30, a string duration): say so, don't crash
            v.problem("input-unreadable", f"comparing with the inputs stopped: "
                      f"{type(exc).__name__}: {exc}")
        report.inputs = {r: dict(c) for r, c in report.inputs.items()}
    return report


def read_slices(path: str | Path) -> tuple[list[Slice], VerifyReport]:
    """Every slice and instant of a (small) trace with its args, flows and categories, as
    Perfetto shows them, and the verify report. For tests and inspection: args are decoded for
    every slice, so memory grows with the trace."""
    v = _Verifier(_check_path(path))
    report = v.run()
    flows = v.flow_map()
    out = []
    with open_trace(v.path) as f:
        for k in range(len(v.slice_idx)):
            b = int(v.slice_idx[k])
            uuid = v.track_uuid[v.track[b]]
            proc = v.process_of(uuid)
            args, cats = v.slice_args(f, k)
            out.append(Slice(process=v.track_name(proc) if proc is not None else "",
                             track=v.track_name(uuid),
                             name=v.names[v.name[b]] if v.name[b] >= 0 else None,
                             ts=int(v.ts[b]), dur=int(v.ts[v.slice_end[k]] - v.ts[b]),
                             args=args, flow_ids=tuple(sorted(flows.get(b, ()))),
                             categories=cats, instant=bool(v.typ[b] == INSTANT)))
    return out, report


# --- command line -----------------------------------------------------------------------------

def _print(report: VerifyReport, *, max_errors: int, lanes: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    totals = ", ".join(f"{k} {v:,}" for k, v in report.counts.items())
    con.print(f"[bold]{report.path}[/bold]: {totals}")
    rank_of = {label: rank for rank, label in report.ranks.items()}
    table = Table(title="slices per process", show_lines=False)
    for col in ("process", "rank", "tracks", "slices"):
        table.add_column(col, justify="right" if col != "process" else "left")
    if report.inputs:
        for col in ("input matched", "missing", "bad args", "launch flows"):
            table.add_column(col, justify="right")
    for proc, n in sorted(report.per_process.items(),
                          key=lambda kv: (rank_of.get(kv[0], 1 << 30), kv[0])):
        rank = rank_of.get(proc)
        row = [proc, "" if rank is None else str(rank), str(len(report.per_lane.get(proc, {}))),
               f"{n:,}"]
        if report.inputs:
            st = report.inputs.get(rank, {}) if rank is not None else {}
            row += [f"{st.get('matched', 0):,}", f"{st.get('missing', 0):,}",
                    f"{st.get('bad_args', 0):,}", f"{st.get('launch_flows', 0):,}"]
        table.add_row(*row)
    con.print(table)
    if lanes:
        lt = Table(title="slices per track")
        for col in ("process", "track", "slices"):
            lt.add_column(col, justify="right" if col == "slices" else "left")
        for proc in sorted(report.per_lane, key=lambda p: (rank_of.get(p, 1 << 30), p)):
            for lane, n in sorted(report.per_lane[proc].items()):
                lt.add_row(proc, lane, f"{n:,}")
        con.print(lt)
    for rank, off in sorted(report.clock_offsets.items()):
        con.print(f"rank {rank}: output is {off:+,} ns from its input trace (clock alignment)")
    for w in report.warnings[:max_errors]:
        con.print(f"[yellow]warning[/yellow] {escape(str(w))}", highlight=False)
    if report.ok:
        con.print("[green]OK[/green]: no problems found")
        return
    shown = 0
    for p in report.errors:
        if shown >= max_errors:
            break
        con.print(f"[red]error[/red] {escape(str(p))}", highlight=False)
        shown += 1
    kinds = ", ".join(f"{k} {n:,}" for k, n in report.error_counts.most_common())
    con.print(f"[red]FAILED[/red]: {sum(report.error_counts.values()):,} problem(s): {kinds}")


def _handler(args: argparse.Namespace) -> int:
    run = None
    if args.run is not None:
        from commviz.trace.run import load_run

        run = load_run(args.run)
    report = verify_pftrace(args.trace, inputs=run)
    _print(report, max_errors=args.max_errors,
           lanes=args.lanes or len(report.per_process) <= 8)
    return 0 if report.ok else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify", help="check a .pftrace as Perfetto will read it (and against its inputs)",
        description="Parse a Perfetto trace back and check it: every slice ends on its own "
                    "track, nesting is valid, tracks are declared, interning resolves, flows "
                    "link two or more slices; with --run, every input slice is there exactly "
                    "once with its args and launch flow. Exits 1 when it finds problems.")
    p.add_argument("trace", type=Path, help="the .pftrace to check")
    p.add_argument("--run", type=Path, metavar="RUN_DIR",
                   help="the run dir it was merged from: also compare with its traces")
    p.add_argument("--max-errors", type=int, default=30, help="problems to print in full")
    p.add_argument("--lanes", action="store_true", help="print slices per track for every "
                   "process (the default for up to 8 processes)")
    p.set_defaults(func=_handler)
