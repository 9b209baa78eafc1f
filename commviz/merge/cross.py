"""The cross-rank piece: the root descriptor, and per process group a summary of its instances.

The root track (uuid 0) asks for explicit process order (ranks in order). Above the ranks, a
"collectives · all ranks" group holds, per process group, one slice per collective instance
(first start to last end over its ranks, with skew and bandwidth as args, from
``commviz.merge.summary``) and its bus bandwidth counter. The rank pieces carry everything
else, so this piece is small and written last, from the ranks' CommEvents only.

Each rank's piece links its lane slices to the collective's instance by a flow id that every
rank derives alone; an instance seen on one rank only (its peers' records or traces are missing,
the job died mid-step) would leave a one-ended flow. ``lone_flows`` finds those ids per rank, and
``copy_piece`` copies a rank's piece into the merged trace with its own taken out of its track
events.
"""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Sequence

from commviz.match.model import CommEvent, InstanceKey
from commviz.merge.piece import carries_cross_flow, cross_flow_id, lane_name, lane_order
from commviz.merge.stops import STOP_CAT, Stop
from commviz.merge.summary import SummaryTracks, summary_tracks
from commviz.write.pftrace import Piece, emit_slices, split, track_descriptor
from commviz.write.proto import FIXED64, LEN, UNIT_COUNT, F, read_varint, tag, varint

_FLOW_TAG = tag(F.FLOW_IDS, FIXED64)
_FLOW_KEY = F.FLOW_IDS << 3 | FIXED64
_PACKET_KEY = 1 << 3 | LEN
_TRACK_EVENT_KEY = F.TRACK_EVENT << 3 | LEN
# A flow id field whose id has the top bit (CROSS_FLOW_BIT) set; a lookahead, so matches may
# overlap (a random byte pair inside one id never hides the next field).
_CROSS_FLOW_RE = re.compile(b"(?=" + re.escape(_FLOW_TAG) + rb"(.{7}[\x80-\xff]))", re.DOTALL)


def write_cross(path: Path, events: list[CommEvent], pgs: dict[str, dict],
                stops: Sequence[Stop] = ()) -> dict[str, int]:
    """Write the cross-rank piece to ``path``; return its counts. ``stops``: where each rank
    stopped (``commviz.merge.stops``), one track per rank above the summaries."""
    summary = summary_tracks(events) if events else None
    stats = {"summary_slices": 0, "bandwidth_samples": 0, "stop_markers": 0}
    with open(path, "wb") as f:
        piece = Piece(f, 0)
        piece.descriptor(track_descriptor(0, explicit_children=True, explicit_processes=True))
        if summary is not None and (summary.slices or summary.counters):
            group = piece.new_uuid()
            piece.descriptor(track_descriptor(group, name="collectives · all ranks",
                                              explicit_children=True, order_rank=-1))
            write_summary(piece, group, summary, pgs, stats)
        if stops:
            stats["stop_markers"] = write_stops(piece, stops)
        piece.flush()
    return stats


def write_stops(piece: Piece, stops: Sequence[Stop]) -> int:
    """A "where each rank stopped" group, first of all, with one instant per rank."""
    group = piece.new_uuid()
    piece.descriptor(track_descriptor(group, name="where each rank stopped",
                                      explicit_children=True, order_rank=-2))
    for stop in stops:
        uuid = piece.new_uuid()
        piece.descriptor(track_descriptor(uuid, name=f"rank {stop.rank} stopped", parent=group,
                                          order_rank=stop.rank))
        seq = piece.sequence(uuid)
        piece.buf += seq.start(stop.ts_ns)
        emit_slices(seq, piece.buf, [(stop.ts_ns, -stop.ts_ns, 0)],
                    [{"name": stop.name, "cat": STOP_CAT, "args": stop.args}])
    return len(stops)


def write_summary(piece: Piece, group: int, summary: SummaryTracks, pgs: dict[str, dict],
                  stats: dict[str, int], named: dict[str, tuple[str, str]] | None = None
                  ) -> None:
    """The summary's slice and counter tracks under ``group``; ``named``: a lane's name and
    description where its pg is not one group (the overview's folded groups)."""
    rows: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    events: list[dict] = []
    for s in summary.slices:
        rows[s.pg][s.row].append((s.start_ns, -max(s.end_ns, s.start_ns), len(events)))
        events.append({"name": s.name, "cat": "commviz.summary", "args": s.args})
    counters: dict[str, list] = defaultdict(list)
    for c in summary.counters:
        counters[c.pg].append((c.ts_ns, c.value))
    plan = []
    for pg in sorted(set(rows) | set(counters), key=lambda g: (lane_order(g), g)):
        base = 2 * lane_order(pg)
        name, about = (named or {}).get(pg) or (lane_name(pg, pgs.get(pg)), None)
        for row in sorted(rows.get(pg, {})):
            for back in split(sorted(rows[pg][row])):
                uuid = piece.new_uuid()
                piece.descriptor(track_descriptor(uuid, name=f"{name} · instances", parent=group,
                                                  order_rank=base, merge_key=f"summary {pg}",
                                                  description=about))
                plan.append((uuid, back))
        if counters.get(pg):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=f"{name} · busbw GB/s", parent=group,
                                              order_rank=base + 1, counter=True,
                                              counter_unit=UNIT_COUNT, counter_unit_name="GB/s"))
            plan.append((uuid, sorted(counters[pg])))
    for uuid, items in plan:
        seq = piece.sequence(uuid)
        piece.buf += seq.start(items[0][0])
        if len(items[0]) == 3:
            stats["summary_slices"] += emit_slices(seq, piece.buf, items, events)
        else:
            piece.buf += seq.counters(items)
            stats["bandwidth_samples"] += len(items)


def lone_flows(events: list[CommEvent]) -> dict[int, set[int]]:
    """Per rank, the cross-rank flow ids of its instances that no other rank holds."""
    ranks: dict[InstanceKey, set[int]] = defaultdict(set)
    for ev in events:
        if carries_cross_flow(ev.key, ev.args):
            ranks[ev.key].add(ev.rank)
    lone: dict[int, set[int]] = defaultdict(set)
    for key, held in ranks.items():
        if len(held) == 1:
            lone[next(iter(held))].add(cross_flow_id(key))
    return lone


def copy_piece(path: Path, out: Any, drop: set[int]) -> int:
    """Append the piece at ``path`` to ``out`` without the flow ids in ``drop`` (the piece's
    own lone flows); how many flow ends were dropped.

    The ids are found by a byte search for cross-rank flow fields (top bit set; a rank's own
    flows have it clear); packets are framed only up to the last one found, and only those
    holding a flow field are decoded. The rank piece writes its comm lanes, the only slices
    with cross-rank flows, first: the rest of the file is copied as it is.
    """
    data = path.read_bytes() if drop else b""
    found = [m.start() for m in _CROSS_FLOW_RE.finditer(data)
             if int.from_bytes(m.group(1), "little") in drop]
    if not found:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
        return 0
    last = max(found)
    dropped = 0
    pos = 0
    while pos <= last:
        start = pos
        key, pos = _read(data, pos)
        size, pos = _read(data, pos)
        end = pos + size
        if key != _PACKET_KEY or end > len(data):
            raise ValueError(f"{path}: not a stream of trace packets at byte {start}")
        body = data[pos:end]
        if _FLOW_TAG in body:
            body, n = _packet_without(body, drop)
            dropped += n
            out.write(tag(1, LEN) + varint(len(body)) + body)
        else:
            out.write(data[start:end])
        pos = end
    out.write(data[pos:])
    return dropped


def _read(buf: bytes, pos: int) -> tuple[int, int]:
    got = read_varint(buf, pos)
    if got is None:
        raise ValueError("truncated varint")
    return got


def _fields(msg: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(field key, start, value start, end) of each field of a message."""
    pos = 0
    while pos < len(msg):
        start = pos
        key, pos = _read(msg, pos)
        wire = key & 7
        value = pos
        if wire == 0:
            _, pos = _read(msg, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            size, value = _read(msg, pos)
            pos = value + size
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield key, start, value, pos


def _packet_without(packet: bytes, drop: set[int]) -> tuple[bytes, int]:
    """A packet with the flow ids in ``drop`` taken out of its track event."""
    out = bytearray()
    total = 0
    for key, start, value, end in _fields(packet):
        if key != _TRACK_EVENT_KEY:
            out += packet[start:end]
            continue
        event, n = _drop_flows(packet[value:end], drop)
        total += n
        out += varint(key) + varint(len(event)) + event
    return bytes(out), total


def _drop_flows(event: bytes, drop: set[int]) -> tuple[bytes, int]:
    out = bytearray()
    dropped = 0
    for key, start, value, end in _fields(event):
        if key == _FLOW_KEY and int.from_bytes(event[value:end], "little") in drop:
            dropped += 1
            continue
        out += event[start:end]
    return bytes(out), dropped
