"""Reading a TrackEvent trace back, the way trace processor resolves it, with the pb2 parser.

Resolves what the writer leaves implicit: interned names, categories, annotation names and
string values (per sequence), TracePacketDefaults (track uuid, clock), and sequence-scoped
incremental clocks. Packets are framed and parsed a few MB at a time (gzip too), so big files
stream. The merger reads shards with it and ``commviz verify`` frames packets with it.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from commviz.errors import SourceError

_CHUNK = 8 << 20                    # bytes read and parsed at a time: memory stays flat

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


def varint(buf: bytes, pos: int) -> tuple[int, int] | None:
    """(value, next position), or None if ``buf`` ends inside the varint."""
    result = shift = 0
    n = len(buf)
    while pos < n:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
    return None


def open_trace(path: Path) -> BinaryIO:
    """The file, decompressed on the fly when it is gzipped."""
    f = open(path, "rb")
    magic = f.read(2)
    f.seek(0)
    if magic == b"\x1f\x8b":
        f.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return f


def iter_packet_batches(path: Path) -> Iterator[tuple[list[int], Any]]:
    """Yield (byte offsets, packets) in file order, a few MB of packets at a time.

    A .pftrace is ``repeated TracePacket packet = 1`` on the wire; framing it here instead of
    one ``Trace.ParseFromString`` keeps memory flat for any file size.
    """
    with open_trace(path) as f:
        buf, base = b"", 0
        while True:
            chunk = f.read(_CHUNK)
            buf += chunk
            pos, offs, n = 0, [], len(buf)
            while pos < n:
                if buf[pos] != 0x0A:
                    raise SourceError(str(path), f"byte {base + pos}: not a Perfetto trace "
                                      f"(expected a TracePacket field, found 0x{buf[pos]:02x})")
                try:
                    head = varint(buf, pos + 1)
                except ValueError:
                    raise SourceError(str(path), f"byte {base + pos}: corrupt packet length "
                                      "(not a Perfetto trace?)") from None
                if head is None or head[1] + head[0] > n:
                    break
                offs.append(base + pos)
                pos = head[1] + head[0]
            if offs:
                yield offs, pb.Trace.FromString(buf[:pos]).packet
            buf, base = buf[pos:], base + pos
            if not chunk:
                if buf:
                    raise SourceError(str(path), f"truncated: {len(buf)} bytes of an incomplete "
                                      f"packet at byte {base}")
                return


def iter_packets(path: str | os.PathLike[str]) -> Iterator[pb.TracePacket]:
    """Each TracePacket of a trace file, parsed, streamed in file order."""
    for _, packets in iter_packet_batches(Path(path)):
        yield from packets


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

    def feed(self, p: pb.TracePacket) -> pb.TracePacket:
        out = self.contents
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
    for packet in iter_packets(path):
        reader.feed(packet)
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
