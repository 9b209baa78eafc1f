"""The hand-written Perfetto encoder, checked against perfetto's own protobuf parser.

Every packet kind commviz writes is parsed with ``perfetto_trace_pb2`` and compared with the
same message built through the pb2 classes; then whole tracks are written and read back to
check what trace processor would rebuild: times, nesting, interning, flows, backing tracks.
"""

from __future__ import annotations

import io
import math
import random

import orjson
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from commviz.write import proto
from commviz.write.pftrace import (Piece, Sequence, counter_event, emit_slices, flow_field,
                                   split, track_descriptor)
from commviz.write.read import iter_packet_batches, read_pftrace, slices


def _packets(data: bytes) -> list[pb.TracePacket]:
    trace = pb.Trace.FromString(data)
    return list(trace.packet)


def test_varints_match_protobuf() -> None:
    values = list(range(0, 40000, 7)) + [(1 << 28) - 1, 1 << 28, (1 << 63) - 1, -1, -(1 << 63)]
    values += [random.Random(1).randrange(1 << 63) for _ in range(2000)]
    for v in values:
        expected = pb.DebugAnnotation(int_value=v).SerializeToString()
        assert b"\x20" + proto.varint(v) == expected, v


def test_enum_values_match_protobuf() -> None:
    assert proto.ORDER_EXPLICIT == pb.TrackDescriptor.EXPLICIT
    assert proto.MERGE_BY_KEY == pb.TrackDescriptor.SIBLING_MERGE_BEHAVIOR_BY_SIBLING_MERGE_KEY
    assert proto.PROCESS_ORDERING_EXPLICIT == pb.TrackDescriptor.PROCESS_ORDERING_EXPLICIT
    assert proto.UNIT_COUNT == pb.CounterDescriptor.UNIT_COUNT
    assert (proto.SLICE_BEGIN, proto.SLICE_END, proto.INSTANT, proto.COUNTER) == (
        pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END,
        pb.TrackEvent.TYPE_INSTANT, pb.TrackEvent.TYPE_COUNTER)
    assert proto.CLOCK_BOOTTIME == pb.BUILTIN_CLOCK_BOOTTIME


def test_track_descriptors_parse_as_built_by_pb2() -> None:
    ours = track_descriptor(7 << 32 | 1, name="rank 6 · host · cuda:6", pid=1_000_006,
                            process_name="rank 6 · host · cuda:6", labels=["os pid 12", "x"],
                            explicit_children=True, order_rank=6, description="from a.json")
    want = pb.TrackDescriptor(uuid=7 << 32 | 1, name="rank 6 · host · cuda:6",
                              process=pb.ProcessDescriptor(pid=1_000_006,
                                                           process_name="rank 6 · host · cuda:6",
                                                           process_labels=["os pid 12", "x"]),
                              child_ordering=pb.TrackDescriptor.EXPLICIT, sibling_order_rank=6,
                              description="from a.json")
    assert pb.TrackDescriptor.FromString(ours) == want
    lane = track_descriptor(9, name="PG tp · ranks [0, 1]", parent=8, order_rank=-1,
                            merge_key="lane 1")
    assert pb.TrackDescriptor.FromString(lane) == pb.TrackDescriptor(
        uuid=9, name="PG tp · ranks [0, 1]", parent_uuid=8, sibling_order_rank=-1,
        sibling_merge_behavior=pb.TrackDescriptor.SIBLING_MERGE_BEHAVIOR_BY_SIBLING_MERGE_KEY,
        sibling_merge_key="lane 1")
    counter = track_descriptor(10, name="busbw", parent=1, counter=True,
                               counter_unit=proto.UNIT_COUNT, counter_unit_name="GB/s")
    assert pb.TrackDescriptor.FromString(counter) == pb.TrackDescriptor(
        uuid=10, name="busbw", parent_uuid=1, counter=pb.CounterDescriptor(
            unit=pb.CounterDescriptor.UNIT_COUNT, unit_name="GB/s"))
    root = track_descriptor(0, explicit_children=True, explicit_processes=True)
    parsed = pb.TrackDescriptor.FromString(root)
    assert parsed.HasField("uuid") and parsed.uuid == 0
    assert parsed.process_ordering == pb.TrackDescriptor.PROCESS_ORDERING_EXPLICIT


def test_every_packet_kind_parses_as_built_by_pb2() -> None:
    buf = io.BytesIO()
    piece = Piece(buf, 3)
    piece.descriptor(track_descriptor(piece.new_uuid(), name="t"))
    seq = piece.sequence(piece.new_uuid())
    piece.buf += seq.start(1_000_000_000)
    events = [{"name": "op", "cat": "cpu_op",
               "args": {"s": "text", "i": 5, "big": 1 << 40, "neg": -2, "f": 0.5, "b": False,
                        "l": [[4, 8], []], "d": {"k": 1}, "none": None}},
              {"name": "mark", "cat": "cpu_op"}]
    emit_slices(seq, piece.buf, [(1_000_000_100, -1_000_000_900, 0), (1_000_000_950,
                                                                      -1_000_000_950, 1)],
                events, flows={0: flow_field(77) + flow_field(1 << 63 | 5)})
    piece.buf += seq.event(1_000_001_000, counter_event(2.5))
    piece.flush()
    descriptor, start, begin, end, instant, counter = _packets(buf.getvalue())
    seq_id = 3 << 12 | 2
    assert descriptor.trusted_packet_sequence_id == 3 << 12 | 1
    assert start == pb.TracePacket(
        timestamp=1_000_000_000, timestamp_clock_id=pb.BUILTIN_CLOCK_BOOTTIME,
        trusted_packet_sequence_id=seq_id,
        sequence_flags=pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        | pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE,
        clock_snapshot=pb.ClockSnapshot(clocks=[
            pb.ClockSnapshot.Clock(clock_id=pb.BUILTIN_CLOCK_BOOTTIME, timestamp=1_000_000_000),
            pb.ClockSnapshot.Clock(clock_id=64, timestamp=1_000_000_000, is_incremental=True)]),
        trace_packet_defaults=pb.TracePacketDefaults(
            timestamp_clock_id=64,
            track_event_defaults=pb.TrackEventDefaults(track_uuid=3 << 32 | 2)))
    # BEGIN: delta time, interned strings defined in the same packet
    assert begin.timestamp == 100 and begin.trusted_packet_sequence_id == seq_id
    assert begin.sequence_flags == pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
    names = {e.iid: e.name for e in begin.interned_data.event_names}
    keys = {e.iid: e.name for e in begin.interned_data.debug_annotation_names}
    strings = {e.iid: e.str for e in begin.interned_data.debug_annotation_string_values}
    te = begin.track_event
    assert te.type == pb.TrackEvent.TYPE_SLICE_BEGIN and not te.HasField("track_uuid")
    assert names[te.name_iid] == "op"
    assert [e.name for e in begin.interned_data.event_categories] == ["cpu_op"]
    got = {}
    for a in te.debug_annotations:
        kind = a.WhichOneof("value")
        got[keys[a.name_iid]] = (strings[a.string_value_iid].decode()
                                 if kind == "string_value_iid" else getattr(a, kind))
    assert got == {"s": "text", "i": 5, "big": 1 << 40, "neg": -2, "f": 0.5, "b": False,
                   "l": "[[4,8],[]]", "d": '{"k":1}', "none": "null"}
    assert list(te.flow_ids) == [77, 1 << 63 | 5]
    assert end.timestamp == 800 and end.track_event == pb.TrackEvent(
        type=pb.TrackEvent.TYPE_SLICE_END)
    assert instant.timestamp == 50 and instant.track_event.type == pb.TrackEvent.TYPE_INSTANT
    assert counter.timestamp == 50 and counter.track_event == pb.TrackEvent(
        type=pb.TrackEvent.TYPE_COUNTER, double_counter_value=2.5)


def _write(items: list[tuple[int, int]], names: list[str], merge_key: str = "k"
           ) -> tuple[bytes, int]:
    """One track of ``(start, end)`` slices, split over backing tracks; returns (file, backs)."""
    buf = io.BytesIO()
    piece = Piece(buf, 1)
    proc = piece.new_uuid()
    piece.descriptor(track_descriptor(proc, name="p", pid=1, explicit_children=True))
    events = [{"name": n, "cat": "c", "args": {"i": i}} for i, n in enumerate(names)]
    backs = split(sorted((s, -e, i) for i, (s, e) in enumerate(items)))
    for back in backs:
        uuid = piece.new_uuid()
        piece.descriptor(track_descriptor(uuid, name="stream 7", parent=proc, order_rank=1,
                                          merge_key=merge_key))
        seq = piece.sequence(uuid)
        piece.buf += seq.start(back[0][0])
        emit_slices(seq, piece.buf, back, events)
    piece.flush()
    return buf.getvalue(), len(backs)


def _read(data: bytes, tmp_path) -> tuple[list, dict]:
    path = tmp_path / "t.pftrace"
    path.write_bytes(data)
    contents = read_pftrace(path)
    assert contents.problems == []
    done, problems = slices(contents)
    assert problems == []
    return done, contents.tracks


def test_times_nesting_and_order_survive(tmp_path) -> None:
    # parent, two children touching at 300 (END before BEGIN), a zero-length one, a sibling
    # starting where the parent ends, and big gaps (multi-byte deltas)
    b = 10**18
    items = [(b + 1_000, b + 900_000), (b + 1_000, b + 300_000), (b + 300_000, b + 300_200),
             (b + 300_100, b + 300_100), (b + 900_000, b + 901_000), (b + 10**12, b + 10**12 + 5)]
    names = ["parent", "child1", "child2", "zero", "after", "far"]
    done, tracks = _read(_write(items, names)[0], tmp_path)
    got = {s.name: (s.start, s.end, s.depth, s.args["i"]) for s in done}
    for i, (name, (s, e)) in enumerate(zip(names, items)):
        assert got[name][:2] == (s, e), name
        assert got[name][3] == i
    assert got["parent"][2] == 0 and got["child1"][2] == 1 and got["child2"][2] == 1
    assert got["zero"][2] == 2 and got["after"][2] == 0
    zero = next(s for s in done if s.name == "zero")
    assert zero.start == zero.end


def test_crossing_slices_go_to_backing_tracks_unmoved(tmp_path) -> None:
    rnd = random.Random(3)
    items, t = [], 10**15
    for _ in range(400):                       # overlapping kernels on one stream
        t += rnd.randrange(0, 5000)
        items.append((t, t + rnd.randrange(1, 20_000)))
    data, backs = _write(items, [f"k{i % 7}" for i in range(len(items))])
    assert backs > 1
    done, tracks = _read(data, tmp_path)
    assert sorted((s.start, s.end) for s in done) == sorted(items)
    children = [t for t in tracks.values() if t.parent is not None]
    assert len(children) == backs
    assert {(t.name, t.merge_key, t.order_rank, t.parent) for t in children} == {
        ("stream 7", "k", 1, children[0].parent)}


def test_interning_is_per_sequence_and_shrinks_output() -> None:
    items = [(10**15 + 100 * i, 10**15 + 100 * i + 50) for i in range(2000)]
    data, _ = _write(items, ["the same long kernel name " * 4] * len(items))
    assert data.count(b"the same long kernel name") == 4       # defined once, used by iid
    assert len(data) < 2000 * 40


def test_pieces_concatenate_into_one_trace(tmp_path) -> None:
    a, _ = _write([(10**15, 10**15 + 10)], ["a"])
    buf = io.BytesIO()
    piece = Piece(buf, 2)
    proc, uuid = piece.new_uuid(), piece.new_uuid()
    piece.descriptor(track_descriptor(proc, name="q", pid=2))
    piece.descriptor(track_descriptor(uuid, name="other", parent=proc))
    seq = piece.sequence(uuid)
    piece.buf += seq.start(10**15)
    emit_slices(seq, piece.buf, [(10**15, -(10**15 + 10), 0)], [{"name": "b", "cat": "c"}])
    piece.flush()
    both = tmp_path / "both.pftrace"
    both.write_bytes(a + buf.getvalue())
    contents = read_pftrace(both)
    done, problems = slices(contents)
    assert problems == [] and sorted(s.name for s in done) == ["a", "b"]
    assert contents.sequences == {1 << 12 | 1, 1 << 12 | 2, 2 << 12 | 1, 2 << 12 | 2}
    assert len(contents.tracks) == 4 and all(t.uuid >> 32 in (1, 2) for t in contents.tracks.values())
    assert len(pb.Trace.FromString(both.read_bytes()).packet) == sum(
        len(packets) for _, packets in iter_packet_batches(both))


def test_cross_piece_holds_more_tracks_than_a_rank_piece(tmp_path) -> None:
    """Every process group's summary and counter live in the cross-rank piece (16,384 ranks of
    TP 8: 2,057 groups); it takes more than a rank piece's 4,095 sequences, each its own
    (perfetto's parser), beside a rank piece and the last rank piece; a rank piece stops at
    4,095 and a piece id past the last rank is refused."""
    n = 5000
    buf = io.BytesIO()
    piece = Piece(buf, 0)
    for k in range(n):
        uuid = piece.new_uuid()
        piece.descriptor(track_descriptor(uuid, name=f"t{k}"))
        seq = piece.sequence(uuid)
        piece.buf += seq.start(10**15 + k)
        emit_slices(seq, piece.buf, [(10**15 + k, -(10**15 + k + 5), 0)], [{"name": f"s{k}"}])
    piece.flush()
    for piece_id in (1, Piece.MAX_PIECES - 1):
        rank = Piece(buf, piece_id)
        uuid = rank.new_uuid()
        rank.descriptor(track_descriptor(uuid, name=f"rank piece {piece_id}"))
        seq = rank.sequence(uuid)
        rank.buf += seq.start(10**15)
        emit_slices(seq, rank.buf, [(10**15, -(10**15 + 5), 0)], [{"name": f"r{piece_id}"}])
        rank.flush()
    path = tmp_path / "many.pftrace"
    path.write_bytes(buf.getvalue())
    packets = _packets(path.read_bytes())
    ids = {p.trusted_packet_sequence_id for p in packets}
    assert 0 not in ids and all(i < 1 << 32 for i in ids)
    assert len(ids) == 1 + n + 2 * 2          # descriptors' own sequence, one per track
    events = [p for p in packets if p.HasField("track_event")]
    assert len({p.trusted_packet_sequence_id for p in events}) == n + 2
    done, problems = slices(read_pftrace(path))
    assert problems == [] and len(done) == n + 2
    assert sorted(s.name for s in done) == sorted([f"s{k}" for k in range(n)]
                                                  + ["r1", f"r{Piece.MAX_PIECES - 1}"])
    rank = Piece(io.BytesIO(), 1)
    for _ in range(Piece.MAX_SEQUENCES - 1):          # its descriptor sequence took one
        rank.sequence(rank.new_uuid())
    with pytest.raises(ValueError, match="more than 4095 tracks"):
        rank.sequence(rank.new_uuid())
    with pytest.raises(ValueError, match="at most"):
        Piece(io.BytesIO(), Piece.MAX_PIECES)


def test_timestamps_must_not_go_back() -> None:
    seq = Sequence(1, 2)
    seq.start(100)
    with pytest.raises(ValueError):
        seq.event(50, counter_event(1))
    with pytest.raises(ValueError):
        seq.counters([(200, 1.0), (150, 2.0)])


def test_a_counter_track_reads_back_sample_by_sample() -> None:
    """Thousands of samples in one loop: protobuf's own parser reads each one's time (the
    sequence's incremental clock) and value, the interned name of the first packet's sequence
    carried on the first packet only."""
    rng = random.Random(3)
    times = sorted(rng.randrange(10**9, 10**12) for _ in range(3000))
    samples = [(t, rng.choice([0.0, 1.5, rng.random() * 1e4, 1e-300, -2.0])) for t in times]
    seq = Sequence(7, 9)
    seq.name("pending")                     # interned data still to be written
    data = seq.start(times[0]) + bytes(seq.counters(samples))
    start, *packets = _packets(data)
    assert len(packets) == len(samples) and packets[0].HasField("interned_data")
    assert not any(p.HasField("interned_data") for p in packets[1:])
    t = start.timestamp
    for packet, (ts, value) in zip(packets, samples):
        t += packet.timestamp
        assert t == ts and packet.trusted_packet_sequence_id == 7
        assert packet.track_event.type == pb.TrackEvent.TYPE_COUNTER
        assert packet.track_event.double_counter_value == value


def test_args_round_trip_exactly(tmp_path) -> None:
    args = {"External id": 12, "Input Dims": [[4, 8], [8]], "grid": [132, 1, 1],
            "est. achieved occupancy %": 19.5, "stream": 7, "Collective name": "allreduce",
            "ids": 2**62 + 1, "unicode": "µs · ✓"}
    buf = io.BytesIO()
    piece = Piece(buf, 1)
    seq = piece.sequence(piece.new_uuid())
    piece.buf += seq.start(5)
    many = [{"name": "k", "cat": "kernel", "args": dict(args, **{"External id": i})}
            for i in range(3000)]               # enough distinct ids to stop caching them
    emit_slices(seq, piece.buf, [(10 + 3 * i, -(11 + 3 * i), i) for i in range(3000)], many)
    piece.flush()
    done, _ = _read(buf.getvalue(), tmp_path)
    for s in done:
        want = dict(args, **{"External id": many[s.args["External id"]]["args"]["External id"]})
        want = {k: orjson.dumps(v).decode() if isinstance(v, list) else v
                for k, v in want.items()}
        assert s.args == want


def test_cached_args_round_trip_as_each_event_holds_them(tmp_path) -> None:
    """The writer caches a key order's encoded args by their non-id values: what comes back
    is still each event's own args, with ids of int and float type, values that change, None
    NaN and infinity at one key (all JSON null), and a string where an id was."""
    events = []
    for i in range(1500):
        args = {"External id": i * 7919, "kind": ("a", "b", "c")[i % 3], "rate": i / 7,
                "dims": [[i % 5, 8], []], "maybe": (None, float("nan"), 1.5, float("inf"))[i % 4]}
        if i % 500 == 499:
            args["External id"] = f"id-{i}"
        events.append({"name": "op", "cat": "cpu_op", "args": args})
    buf = io.BytesIO()
    piece = Piece(buf, 1)
    seq = piece.sequence(piece.new_uuid())
    piece.buf += seq.start(5)
    emit_slices(seq, piece.buf, [(10 + 3 * i, -(11 + 3 * i), i) for i in range(1500)], events)
    piece.flush()
    done, _ = _read(buf.getvalue(), tmp_path)
    assert len(done) == 1500
    for s in done:
        want = events[(s.start - 10) // 3]["args"]
        got = dict(s.args)
        maybe = got.pop("maybe")
        if want["maybe"] is None:
            assert maybe == "null"
        elif not math.isfinite(want["maybe"]):
            assert isinstance(maybe, float) and repr(maybe) == repr(want["maybe"])
        else:
            assert maybe == want["maybe"]
        assert got == {k: orjson.dumps(v).decode() if isinstance(v, list) else v
                       for k, v in want.items() if k != "maybe"}


def test_id_strings_written_in_place_and_learnt_across_a_pieces_tracks() -> None:
    """A string key whose values are mostly new (an instance's name) is an id: its strings are
    written in place, not interned, and a piece's later tracks know it from their first event;
    a repeating string stays interned. Read back with perfetto's own protobuf classes."""
    tracks = 3
    events = [{"name": "all_reduce", "cat": "comm",
               "args": {"op": ("sum", "max")[i % 2], "instance": f"tp#{i} step {i // 8}",
                        "skew_ns": 1000 + 37 * i}} for i in range(150 * tracks)]
    buf = io.BytesIO()
    piece = Piece(buf, 0)
    for t in range(tracks):
        seq = piece.sequence(piece.new_uuid())
        piece.buf += seq.start(5)
        emit_slices(seq, piece.buf, [(10 + 3 * i, -(11 + 3 * i), i)
                                     for i in range(150 * t, 150 * (t + 1))], events)
    piece.flush()
    names: dict[tuple[int, int], str] = {}
    strings: dict[tuple[int, int], str] = {}
    got, in_place = [], []
    for p in _packets(buf.getvalue()):
        seq_id = p.trusted_packet_sequence_id
        for n in p.interned_data.debug_annotation_names:
            names[seq_id, n.iid] = n.name
        for s in p.interned_data.debug_annotation_string_values:
            strings[seq_id, s.iid] = s.str.decode()
        if p.track_event.type != pb.TrackEvent.TYPE_SLICE_BEGIN:
            continue
        args = {}
        for a in p.track_event.debug_annotations:
            key = names[seq_id, a.name_iid]
            which = a.WhichOneof("value")
            args[key] = (strings[seq_id, a.string_value_iid] if which == "string_value_iid"
                         else getattr(a, which))
            if key != "skew_ns":
                in_place.append((seq_id, key, which == "string_value"))
        got.append(args)
    assert got == [e["args"] for e in events]
    seqs = sorted({s for s, _, _ in in_place})
    assert len(seqs) == tracks
    assert not any(inline for _, key, inline in in_place if key == "op")
    later = [inline for s, key, inline in in_place if key == "instance" and s != seqs[0]]
    assert later and all(later)
