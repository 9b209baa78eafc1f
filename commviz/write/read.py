"""Reading a TrackEvent trace back, the way trace processor resolves it, with the pb2 parser.

Resolves what the writer leaves implicit: interned names, categories, annotation names and
string values (per sequence), TracePacketDefaults (track uuid, clock), and sequence-scoped
incremental clocks. Packets are parsed one at a time, so big files stream. Used by the tests
and by anyone who wants to check a merged trace without trace processor.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

BEGIN, END, INSTANT, COUNTER = 1, 2, 3, 4


@dataclass
class Track:
    uuid: int
    name: str | None
    parent: int | None
    pid: int | None = None
    process_name: str | None = None
    labels: tuple[str, ...] = ()
    order_rank: int | None = None
    merge_key: str | None = None
    explicit_children: bool = False
    explicit_processes: bool = False
    description: str | None = None
    counter: bool = False


@dataclass
class Event:
    track: int
    ts: int
    type: int
    name: str | None
    category: str | None
    args: dict[str, Any]
    flow_ids: tuple[int, ...]
    seq: int
    value: float | None = None


@dataclass
class Slice:
    track: int                  # backing track uuid
    start: int
    end: int
    name: str | None
    category: str | None
    args: dict[str, Any]
    flow_ids: tuple[int, ...]
    depth: int


@dataclass
class Contents:
    tracks: dict[int, Track] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    packets: int = 0
    sequences: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


@dataclass
class _SeqState:
    names: dict[int, str] = field(default_factory=dict)
    cats: dict[int, str] = field(default_factory=dict)
    keys: dict[int, str] = field(default_factory=dict)
    strings: dict[int, str] = field(default_factory=dict)
    track: int | None = None
    clock: int | None = None
    incremental: dict[int, int] = field(default_factory=dict)   # clock id -> last ns
    cleared: bool = False


def iter_packets(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """Each serialized TracePacket of a trace file (``Trace.packet`` entries), streamed."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            pos = 0
            while pos < size:
                tag = data[pos]
                pos += 1
                length = shift = 0
                while True:
                    b = data[pos]
                    pos += 1
                    length |= (b & 0x7F) << shift
                    shift += 7
                    if b < 0x80:
                        break
                if tag != 0x0A:
                    raise ValueError(f"{path}: unexpected field tag {tag:#x} at byte {pos}")
                yield data[pos:pos + length]
                pos += length


def _annotation(ann: Any, st: _SeqState) -> tuple[str, Any]:
    name = ann.name if ann.HasField("name") else st.keys.get(ann.name_iid, f"<iid {ann.name_iid}>")
    kind = ann.WhichOneof("value")
    if kind == "string_value_iid":
        return name, st.strings.get(ann.string_value_iid, f"<iid {ann.string_value_iid}>")
    if kind is None:
        return name, None
    return name, getattr(ann, kind)


class Reader:
    """Resolves packets fed in file order into ``contents``."""

    def __init__(self) -> None:
        self.contents = Contents()
        self._states: dict[int, _SeqState] = {}

    def feed(self, raw: bytes) -> pb.TracePacket:
        out = self.contents
        p = pb.TracePacket.FromString(raw)
        out.packets += 1
        seq = p.trusted_packet_sequence_id
        out.sequences.add(seq)
        st = self._states.get(seq)
        if st is None or p.sequence_flags & 1:
            st = self._states[seq] = _SeqState(cleared=bool(p.sequence_flags & 1))
        if p.HasField("trace_packet_defaults"):
            d = p.trace_packet_defaults
            if d.HasField("timestamp_clock_id"):
                st.clock = d.timestamp_clock_id
            if d.track_event_defaults.HasField("track_uuid"):
                st.track = d.track_event_defaults.track_uuid
        if p.HasField("clock_snapshot"):
            for c in p.clock_snapshot.clocks:
                if c.is_incremental:
                    st.incremental[c.clock_id] = c.timestamp
        if p.HasField("interned_data"):
            i = p.interned_data
            for e in i.event_names:
                st.names[e.iid] = e.name
            for e in i.event_categories:
                st.cats[e.iid] = e.name
            for e in i.debug_annotation_names:
                st.keys[e.iid] = e.name
            for e in i.debug_annotation_string_values:
                st.strings[e.iid] = e.str.decode("utf-8", "surrogatepass")
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            out.tracks.setdefault(d.uuid, Track(
                uuid=d.uuid, name=d.name if d.HasField("name") else None,
                parent=d.parent_uuid if d.HasField("parent_uuid") else None,
                pid=d.process.pid if d.HasField("process") else None,
                process_name=d.process.process_name if d.HasField("process") else None,
                labels=tuple(d.process.process_labels),
                order_rank=d.sibling_order_rank if d.HasField("sibling_order_rank") else None,
                merge_key=d.sibling_merge_key if d.HasField("sibling_merge_key") else None,
                explicit_children=d.child_ordering == 3, explicit_processes=d.process_ordering == 1,
                description=d.description if d.HasField("description") else None,
                counter=d.HasField("counter")))
        if not p.HasField("track_event"):
            return p
        if p.sequence_flags & 2 and not st.cleared:
            out.problems.append(f"packet {out.packets}: needs incremental state on sequence {seq}, "
                                "which was never cleared (trace processor would skip it)")
            return p
        clock = p.timestamp_clock_id if p.HasField("timestamp_clock_id") else st.clock
        ts = p.timestamp
        if clock in st.incremental:
            ts = st.incremental[clock] = st.incremental[clock] + ts
        te = p.track_event
        track = te.track_uuid if te.HasField("track_uuid") else st.track
        name = te.name if te.HasField("name") else st.names.get(te.name_iid) if te.name_iid else None
        cats = [st.cats.get(i) for i in te.category_iids] or list(te.categories)
        args = dict(_annotation(a, st) for a in te.debug_annotations)
        value = None
        if te.HasField("double_counter_value"):
            value = te.double_counter_value
        elif te.HasField("counter_value"):
            value = te.counter_value
        out.events.append(Event(track=track or 0, ts=ts, type=te.type, name=name,
                                category=cats[0] if cats else None, args=args,
                                flow_ids=tuple(te.flow_ids), seq=seq, value=value))
        return p


def read_pftrace(path: str | os.PathLike[str]) -> Contents:
    """Every track descriptor and every track event of a trace, resolved."""
    reader = Reader()
    for raw in iter_packets(path):
        reader.feed(raw)
    return reader.contents


def slices(contents: Contents) -> tuple[list[Slice], list[str]]:
    """Pair BEGIN/END per track in file order (as trace processor does); instants are slices
    of zero duration. Returns the slices and every pairing problem found."""
    stacks: dict[int, list[Event]] = {}
    last: dict[int, int] = {}
    done: list[Slice] = []
    problems: list[str] = []
    for ev in contents.events:
        if ev.type in (BEGIN, END, INSTANT):
            if ev.ts < last.get(ev.track, ev.ts):
                problems.append(f"track {ev.track}: event at {ev.ts} after one at "
                                f"{last[ev.track]} in file order")
            last[ev.track] = ev.ts
        if ev.type == BEGIN:
            stack = stacks.setdefault(ev.track, [])
            if stack and ev.ts < stack[-1].ts:
                problems.append(f"track {ev.track}: BEGIN {ev.name!r} at {ev.ts} before its parent")
            stack.append(ev)
        elif ev.type == INSTANT:
            depth = len(stacks.get(ev.track, ()))
            done.append(Slice(ev.track, ev.ts, ev.ts, ev.name, ev.category, ev.args, ev.flow_ids,
                              depth))
        elif ev.type == END:
            stack = stacks.get(ev.track)
            if not stack:
                problems.append(f"track {ev.track}: END at {ev.ts} with no open slice")
                continue
            b = stack.pop()
            if ev.ts < b.ts:
                problems.append(f"track {ev.track}: {b.name!r} ends at {ev.ts} before it begins")
            done.append(Slice(ev.track, b.ts, ev.ts, b.name, b.category, {**b.args, **ev.args},
                              b.flow_ids + ev.flow_ids, len(stack)))
    for track, stack in stacks.items():
        for b in stack:
            problems.append(f"track {track}: {b.name!r} at {b.ts} never ends")
    return done, problems
