"""The one ``.pftrace`` reader: packets parsed once into typed records, as trace processor would.

Resolves what a writer leaves implicit, in the order Perfetto does (file order): per-sequence
incremental state and its generations (interned names, categories, annotation names and string
values), TracePacketDefaults (track, clock), ClockSnapshots (clocks related to BOOTTIME, and
sequence-scoped incremental clocks). Packets are framed from the wire format and parsed a few MB
at a time (gzip too), so big files stream. Everything it cannot resolve is a ``Problem``.

``Decoder`` turns packets into ``Track`` and ``Event`` records; ``read_pftrace`` keeps them all
(the merge reads shards with it); ``commviz verify`` keeps a few integers per event and checks
them. ``pair`` nests BEGIN/END per track in timestamp order (file order on ties), as trace
processor does, for both.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import numpy as np
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from commviz.errors import SourceError
from commviz.write.proto import read_varint

_CHUNK = 8 << 20                    # bytes read and parsed at a time: memory stays flat

BEGIN, END, INSTANT, COUNTER = (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END,
                                pb.TrackEvent.TYPE_INSTANT, pb.TrackEvent.TYPE_COUNTER)
CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
BOOTTIME = pb.BUILTIN_CLOCK_BOOTTIME     # trace time, unless a snapshot says otherwise
_SEQ_CLOCKS = range(64, 128)             # clock ids scoped to one packet sequence
TS_MIN, TS_MAX = -(1 << 63), (1 << 63) - 1    # trace processor's int64 timestamps
# interned tables read back: InternedData field -> the field of its entries holding the value
_TABLES = {"event_names": "name", "event_categories": "name", "debug_annotation_names": "name",
           "debug_annotation_string_values": "str", "correlation_id_str": "str",
           "debug_annotation_value_type_names": "name"}


@dataclass(frozen=True)
class Problem:
    """One thing a reader of the trace would lose or misplace, with what a person needs to find
    it."""

    kind: str                      # "unclosed-slice", "bad-interning", "undeclared-track", ...
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


Sink = Callable[[Problem, bool], None]      # (problem, is a warning)


@dataclass(frozen=True)
class Track:
    """A TrackDescriptor, as the first declaration of its uuid says."""

    uuid: int
    name: str | None
    parent: int | None
    pid: int | None = None                  # a process track's pid
    process_name: str | None = None
    labels: tuple[str, ...] = ()
    thread: tuple[int, int] | None = None   # a thread track's (pid, tid)
    thread_name: str | None = None
    order_rank: int | None = None
    merge_key: str | None = None
    explicit_children: bool = False
    explicit_processes: bool = False
    description: str | None = None
    counter: bool = False

    @property
    def title(self) -> str:
        """What the UI shows as the track's name."""
        if self.name:
            return self.name
        if self.thread is not None:
            return self.thread_name or f"thread {self.thread[1]}"
        if self.pid is not None:
            return self.process_name or f"process {self.pid}"
        return f"track {self.uuid}"


@dataclass(slots=True)
class Event:
    """One TrackEvent with its time, track, name and categories resolved. ``args`` is filled
    only when the decoder was asked to (``Decoder(args=True)``); ``offset`` and ``state`` find
    them again later (``Decoder.args_at``)."""

    track: int
    ts: int
    type: int
    name: str | None
    categories: tuple[str, ...]
    flow_ids: tuple[int, ...]               # flow ids of every kind (terminating ones too)
    seq: int
    offset: int
    state: int                              # generation of the sequence's state, -1: none
    has_args: bool
    value: float | None = None              # a counter's value
    extra_counters: tuple[int, ...] = ()
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def category(self) -> str | None:
        return self.categories[0] if self.categories else None


@dataclass
class Slice:
    track: int                  # backing track uuid
    start: int
    end: int
    name: str | None
    categories: tuple[str, ...]
    args: dict[str, Any]
    flow_ids: tuple[int, ...]
    depth: int
    instant: bool = False

    @property
    def category(self) -> str | None:
        return self.categories[0] if self.categories else None


@dataclass
class Contents:
    tracks: dict[int, Track] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    packets: int = 0
    sequences: set[int] = field(default_factory=set)
    problems: list[Problem] = field(default_factory=list)


# --- framing --------------------------------------------------------------------------------

def open_trace(path: Path) -> BinaryIO:
    """The file, decompressed on the fly when it is gzipped."""
    f = open(path, "rb")
    magic = f.read(2)
    f.seek(0)
    if magic == b"\x1f\x8b":
        f.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return f


def _parse(data: bytes, path: Path, at: int) -> Any:
    try:
        return pb.Trace.FromString(data).packet
    except Exception as exc:       # protobuf's DecodeError has no stable import path
        raise SourceError(str(path), f"packets from byte {at} do not parse as TracePackets "
                          f"({exc}): corrupt or not a Perfetto trace") from None


def iter_packet_batches(path: Path) -> Iterator[tuple[list[int], Any]]:
    """Yield (byte offsets, packets) in file order, a few MB of packets at a time.

    A .pftrace is ``repeated TracePacket packet = 1`` on the wire; framing it here instead of
    one ``Trace.ParseFromString`` keeps memory flat for any file size. A file that is not a
    trace, is cut short or is corrupt raises one ``SourceError`` naming it and the byte.
    """
    try:
        with open_trace(path) as f:
            buf, base = b"", 0
            while True:
                chunk = f.read(_CHUNK)
                buf += chunk
                pos, offs, n = 0, [], len(buf)
                while pos < n:
                    if buf[pos] != 0x0A:
                        raise SourceError(str(path), f"byte {base + pos}: not a Perfetto trace "
                                          f"(expected a TracePacket field, found "
                                          f"0x{buf[pos]:02x})")
                    try:
                        head = read_varint(buf, pos + 1)
                    except ValueError:
                        raise SourceError(str(path), f"byte {base + pos}: corrupt packet length "
                                          "(not a Perfetto trace?)") from None
                    if head is None or head[1] + head[0] > n:
                        break
                    offs.append(base + pos)
                    pos = head[1] + head[0]
                if offs:
                    yield offs, _parse(buf[:pos], path, base)
                buf, base = buf[pos:], base + pos
                if not chunk:
                    if buf:
                        raise SourceError(str(path), f"truncated: {len(buf)} bytes of an "
                                          f"incomplete packet at byte {base}")
                    return
    except (EOFError, gzip.BadGzipFile) as exc:
        raise SourceError(str(path), f"truncated or corrupt gzip ({exc})") from None
    except OSError as exc:
        if exc.errno is None:       # zlib's errors reach here as plain OSError
            raise SourceError(str(path), f"cannot read: {exc}") from None
        raise


def packet_at(f: BinaryIO, offset: int) -> Any:
    """The packet framed at ``offset`` of an open trace (args read back on demand)."""
    f.seek(offset)
    head = f.read(11)
    length, pos = read_varint(head, 1) or (0, 0)
    payload = head[pos:] + f.read(length - (len(head) - pos))
    return pb.TracePacket.FromString(payload[:length])


# --- per-sequence state and clocks ------------------------------------------------------------

class _State:
    """One generation of a sequence's incremental state (interned tables and defaults)."""

    __slots__ = ("seq", "tables", "default_track", "default_clock")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tables: dict[str, dict[int, Any]] = {k: {} for k in _TABLES}
        self.default_track: int | None = None
        self.default_clock: int | None = None


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


def _text(raw: str | bytes) -> str:
    """A string field as text. Bytes come from an interned string value, or from a string field
    that is not valid UTF-8 (protobuf hands those over undecoded); the writer encodes lone
    surrogates (``surrogatepass``)."""
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace")


def _opt(raw: str | bytes) -> str | None:
    return _text(raw) or None


def _track(d: Any) -> Track:
    return Track(
        uuid=d.uuid, name=_opt(d.name) or _opt(d.static_name),
        parent=d.parent_uuid if d.HasField("parent_uuid") else None,
        pid=d.process.pid if d.HasField("process") else None,
        process_name=_opt(d.process.process_name) if d.HasField("process") else None,
        labels=tuple(_text(x) for x in d.process.process_labels),
        thread=(d.thread.pid, d.thread.tid) if d.HasField("thread") else None,
        thread_name=_opt(d.thread.thread_name) if d.HasField("thread") else None,
        order_rank=d.sibling_order_rank if d.HasField("sibling_order_rank") else None,
        merge_key=_text(d.sibling_merge_key) if d.HasField("sibling_merge_key") else None,
        explicit_children=d.child_ordering == pb.TrackDescriptor.EXPLICIT,
        explicit_processes=d.process_ordering == pb.TrackDescriptor.PROCESS_ORDERING_EXPLICIT,
        description=_text(d.description) if d.HasField("description") else None,
        counter=d.HasField("counter"))


class Decoder:
    """Turns packets, fed in file order, into ``Track`` and ``Event`` records; everything it
    cannot resolve goes to ``sink`` as a ``Problem``."""

    def __init__(self, sink: Sink, *, args: bool = False) -> None:
        self.sink = sink
        self.with_args = args
        self.seqs: dict[int, _State | None] = {}     # seq -> current state (None: never cleared)
        self.states: list[_State] = []               # every generation, by state id
        self.tracks: dict[int, Track] = {}           # uuid -> its first declaration
        self.track_offsets: dict[int, int] = {}
        self.clocks: dict[tuple[int, int], _Clock] = {}  # (seq or 0 for global, clock id)
        self.packets = 0
        self.interned = 0                            # packets with interned data
        self.descriptors = 0

    def problem(self, kind: str, message: str, *, warn: bool = False, **ctx: Any) -> None:
        self.sink(Problem(kind, message, **ctx), warn)

    def packet(self, p: Any, off: int = 0) -> Track | Event | None:
        """Read one packet; its track descriptor or track event as a record, else None."""
        self.packets += 1
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
            self._defaults(p.trace_packet_defaults, st, seq, off)
        if p.HasField("interned_data"):
            self._interned(p.interned_data, st, seq, off)
        kind = p.WhichOneof("data")
        if kind == "clock_snapshot":
            self._snapshot(p.clock_snapshot, seq, off)
            return None
        if flags & NEEDS and st is None:
            self.problem("skipped-packet", f"sequence {seq} uses incremental state before any "
                         "packet with SEQ_INCREMENTAL_STATE_CLEARED: Perfetto drops this packet",
                         offset=off, ts=p.timestamp or None)
            return None
        # every timestamped packet moves its sequence's incremental clock, events or not
        ts = self._timestamp(p, st, seq, off) if p.HasField("timestamp") else None
        if ts is not None and not TS_MIN <= ts <= TS_MAX:
            self.problem("bad-timestamp", f"timestamp {ts} ns is outside what trace processor "
                         "holds (signed 64-bit): Perfetto drops or misplaces this packet",
                         offset=off)
            return None
        if kind == "track_event":
            if ts is not None:
                return self._event(ts, p.track_event, st, seq, flags, off)
            if not p.HasField("timestamp"):
                self.problem("no-timestamp", "track event without a packet timestamp",
                             offset=off)
        elif kind == "track_descriptor":
            return self._descriptor(p.track_descriptor, off)
        return None

    def args_at(self, f: BinaryIO, offset: int, state: int) -> dict[str, Any]:
        """The args of the event at ``offset`` (``Event.offset``, ``Event.state``), read back
        from the open file."""
        te = packet_at(f, offset).track_event
        st = self.states[state] if state >= 0 else None
        return {_ann_name(a, st): _ann_value(a, st) for a in te.debug_annotations}

    # --- parts of a packet
    def _snapshot(self, snap: Any, seq: int, off: int) -> None:
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

    def _timestamp(self, p: Any, st: _State | None, seq: int, off: int) -> int | None:
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

    def _interned(self, data: Any, st: _State | None, seq: int, off: int) -> None:
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
                value = _text(getattr(e, value_field))
                old = known.get(e.iid)
                if old is not None and old != value:
                    self.problem("bad-interning", f"{table} iid {e.iid} redefined on sequence "
                                 f"{seq}: {old!r} then {value!r}", offset=off)
                known[e.iid] = value
        self.interned += 1

    def _defaults(self, d: Any, st: _State | None, seq: int, off: int) -> None:
        if st is None:
            self.problem("bad-interning", f"TracePacketDefaults on sequence {seq}, which never "
                         "set SEQ_INCREMENTAL_STATE_CLEARED", offset=off)
            return
        if d.HasField("track_event_defaults") and d.track_event_defaults.HasField("track_uuid"):
            st.default_track = d.track_event_defaults.track_uuid
        if d.HasField("timestamp_clock_id"):
            st.default_clock = d.timestamp_clock_id

    def _descriptor(self, d: Any, off: int) -> Track | None:
        self.descriptors += 1
        if not d.HasField("uuid"):
            self.problem("bad-track", "TrackDescriptor without a uuid", offset=off,
                         name=_opt(d.name))
            return None
        track = _track(d)
        prev = self.tracks.get(d.uuid)
        if prev is None:
            self.tracks[d.uuid] = track
            self.track_offsets[d.uuid] = off
        elif prev != track:
            diff = [f.name for f in fields(Track) if getattr(prev, f.name) != getattr(track, f.name)]
            self.problem("conflicting-track", f"track uuid {d.uuid} declared again differently "
                         f"(first at byte {self.track_offsets[d.uuid]}; fields {', '.join(diff)})",
                         offset=off, track=prev.title)
        return track

    def _resolve(self, st: _State | None, table: str, iid: int, seq: int, off: int, ts: int,
                 what: str) -> Any:
        value = st.tables[table].get(iid) if st is not None else None
        if value is None:
            self.problem("bad-interning", f"{what} iid {iid} is not defined on sequence {seq}",
                         offset=off, ts=ts)
        return value

    def _check_annotations(self, anns: Any, st: _State | None, seq: int, off: int,
                           ts: int) -> None:
        names = st.tables["debug_annotation_names"] if st is not None else {}
        strings = st.tables["debug_annotation_string_values"] if st is not None else {}
        for a in anns:
            iid = a.name_iid                    # 0: not set (0 is no valid iid)
            if iid and iid not in names:
                self._resolve(st, "debug_annotation_names", iid, seq, off, ts,
                              "debug annotation name")
            iid = a.string_value_iid
            if iid and iid not in strings:
                self._resolve(st, "debug_annotation_string_values", iid, seq, off, ts,
                              "debug annotation string value")
            if a.dict_entries:
                self._check_annotations(a.dict_entries, st, seq, off, ts)
            if a.array_values:
                self._check_annotations(a.array_values, st, seq, off, ts)

    def _event(self, ts: int, te: Any, st: _State | None, seq: int, flags: int,
               off: int) -> Event | None:
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
            return None
        name = None
        if te.HasField("name_iid"):
            name = self._resolve(st, "event_names", te.name_iid, seq, off, ts, "event name")
        elif te.HasField("name"):
            name = _text(te.name)
        cats = tuple(_text(c) for c in te.categories)
        for iid in te.category_iids:
            cat = self._resolve(st, "event_categories", iid, seq, off, ts, "category")
            if cat is not None:
                cats += (cat,)
        if te.HasField("correlation_id_str_iid"):
            self._resolve(st, "correlation_id_str", te.correlation_id_str_iid, seq, off, ts,
                          "correlation id")
        if te.debug_annotations:
            self._check_annotations(te.debug_annotations, st, seq, off, ts)
        value = None
        if te.HasField("double_counter_value"):
            value = te.double_counter_value
        elif te.HasField("counter_value"):
            value = float(te.counter_value)
        flows = (tuple(te.flow_ids) + tuple(te.terminating_flow_ids) + tuple(te.flow_ids_old)
                 + tuple(te.terminating_flow_ids_old))
        ev = Event(track=uuid, ts=ts, type=te.type, name=name, categories=cats, flow_ids=flows,
                   seq=seq, offset=off, state=len(self.states) - 1 if st is not None else -1,
                   has_args=bool(te.debug_annotations), value=value,
                   extra_counters=tuple(te.extra_counter_track_uuids))
        if self.with_args and te.debug_annotations:
            ev.args = {_ann_name(a, st): _ann_value(a, st) for a in te.debug_annotations}
        return ev


def _ann_name(a: Any, st: _State | None) -> str:
    if a.HasField("name_iid"):
        return st.tables["debug_annotation_names"].get(a.name_iid, "?") if st else "?"
    return _text(a.name)


def _ann_value(a: Any, st: _State | None) -> Any:
    """A debug annotation's value: typed, nested dicts and arrays as dicts and lists."""
    which = a.WhichOneof("value")
    if which is None:
        if a.dict_entries:
            return {_ann_name(e, st): _ann_value(e, st) for e in a.dict_entries}
        if a.array_values:
            return [_ann_value(e, st) for e in a.array_values]
        return None
    if which == "string_value_iid":
        strings = st.tables["debug_annotation_string_values"] if st else {}
        raw = strings.get(a.string_value_iid)
        return _text(raw) if raw is not None else None
    if which == "legacy_json_value":
        text = _text(a.legacy_json_value)
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text
    if which == "nested_value":
        return str(a.nested_value)
    value = getattr(a, which)
    return _text(value) if which == "string_value" else value


# --- the whole file ---------------------------------------------------------------------------

class Reader:
    """Keeps every record of the packets fed to it (in file order) in ``contents``."""

    def __init__(self) -> None:
        self.contents = Contents()
        self.decoder = Decoder(self._sink, args=True)

    def _sink(self, problem: Problem, warn: bool) -> None:
        if not warn:
            self.contents.problems.append(problem)

    def feed(self, p: pb.TracePacket, offset: int = 0) -> Track | Event | None:
        self.contents.packets += 1
        self.contents.sequences.add(p.trusted_packet_sequence_id)
        record = self.decoder.packet(p, offset)
        if isinstance(record, Event):
            self.contents.events.append(record)
        elif isinstance(record, Track):
            self.contents.tracks.setdefault(record.uuid, record)
        return record


def read_pftrace(path: str | os.PathLike[str]) -> Contents:
    """Every track descriptor and every track event of a trace, resolved."""
    reader = Reader()
    for offs, packets in iter_packet_batches(Path(path)):
        for off, packet in zip(offs, packets):
            reader.feed(packet, off)
    return reader.contents


# --- nesting ----------------------------------------------------------------------------------

@dataclass
class Pairing:
    """BEGIN/END/INSTANT events nested per track, as trace processor nests them."""

    partner: np.ndarray                # BEGIN <-> END index, -1: unpaired (or not a slice end)
    depth: np.ndarray                  # open slices around each BEGIN / INSTANT
    misplaced: list[int]               # ENDs with no open slice on their track (dropped)
    unclosed: list[int]                # BEGINs never ended
    crossing: list[tuple[int, int]]    # (END, BEGIN): a named END closing another slice


def pair(track: Sequence[int], ts: Sequence[int], typ: Sequence[int],
         name: Sequence[int]) -> Pairing:
    """Nest events per track in timestamp order, file order on ties (a stable sort), as trace
    processor does. ``name`` is an id per event, -1 for none: a named END closing a slice of
    another name means the slices cross."""
    track_a, ts_a = np.asarray(track, dtype=np.int64), np.asarray(ts, dtype=np.int64)
    n = len(ts_a)
    partner = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int32)
    out = Pairing(partner, depth, [], [], [])
    track_l, typ_l = track_a.tolist(), np.asarray(typ, dtype=np.int64).tolist()
    name_l = np.asarray(name, dtype=np.int64).tolist()
    stack: list[int] = []
    cur = None
    for i in np.lexsort((ts_a, track_a)).tolist():   # stable: ties keep file order
        tr = track_l[i]
        if tr != cur:
            out.unclosed += stack
            stack = []
            cur = tr
        t = typ_l[i]
        if t == BEGIN:
            depth[i] = len(stack)
            stack.append(i)
        elif t == INSTANT:
            depth[i] = len(stack)
        elif t == END:
            if not stack:
                out.misplaced.append(i)
                continue
            b = stack.pop()
            partner[b], partner[i] = i, b
            if name_l[i] >= 0 and name_l[i] != name_l[b]:
                out.crossing.append((i, b))
    out.unclosed += stack
    return out


def slices(contents: Contents) -> tuple[list[Slice], list[str]]:
    """The slices (instants: zero duration) of what ``read_pftrace`` read, paired as trace
    processor pairs them, and every pairing problem found."""
    evs = [e for e in contents.events if e.type in (BEGIN, END, INSTANT)]
    ids: dict[str | None, int] = {None: -1}
    tracks: dict[int, int] = {}                  # uuid (up to 2**64) -> dense index
    p = pair([tracks.setdefault(e.track, len(tracks)) for e in evs], [e.ts for e in evs],
             [e.type for e in evs], [ids.setdefault(e.name, len(ids) - 1) for e in evs])
    done: list[Slice] = []
    for i, ev in enumerate(evs):
        if ev.type == INSTANT:
            done.append(Slice(ev.track, ev.ts, ev.ts, ev.name, ev.categories, ev.args,
                              ev.flow_ids, int(p.depth[i]), instant=True))
        elif ev.type == BEGIN and p.partner[i] >= 0:
            e = evs[int(p.partner[i])]
            done.append(Slice(ev.track, ev.ts, e.ts, ev.name, ev.categories, {**ev.args, **e.args},
                              ev.flow_ids + e.flow_ids, int(p.depth[i])))
    problems = [f"track {evs[i].track}: END at {evs[i].ts} with no open slice"
                for i in p.misplaced]
    problems += [f"track {evs[i].track}: {evs[i].name!r} at {evs[i].ts} never ends"
                 for i in p.unclosed]
    problems += [f"track {evs[e].track}: END {evs[e].name!r} at {evs[e].ts} closes "
                 f"{evs[b].name!r}: the slices cross" for e, b in p.crossing]
    return done, problems
