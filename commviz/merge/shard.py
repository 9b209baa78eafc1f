"""Per-rank shards: a rank's piece written on its own node, reused by the merge when still valid.

A shard's process descriptor says which inputs it was converted from (a fingerprint of the
record's content, the traces' names, sizes and ends, the clock offset and the writer version),
so ``merge_run`` reuses it only for the same inputs. The merge still needs the rank's
collectives for the cross-rank summary: they are read back from the shard's comm lanes, which
come first in the file, so only the start of a shard is parsed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import orjson

from commviz.match.model import CommEvent
from commviz.merge.piece import INSTANCE, LANE_CAT, PID_BASE, instance_from_text
from commviz.record import schema
from commviz.write.read import Reader, iter_packets, slices

WRITER_VERSION = "commviz-pftrace-1"
_SAMPLE = 1 << 16
_FINGERPRINT_RE = re.compile(r"\(inputs ([0-9a-f]{16,})(?:, record ([0-9a-f]{16,}))?\)")
_ADDED = ("commviz.source", "commviz.stream", "commviz.graphed", INSTANCE)


def shard_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / schema.shard_name(rank)


def _file_sample(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(_SAMPLE)
        size = f.seek(0, 2)
        f.seek(max(size - _SAMPLE, 0))
        tail = f.read(_SAMPLE)
    return f"{path.name}:{size}:".encode() + head + tail


def fingerprint(record: dict | None, trace_paths: list[Path], offset_ns: int) -> str:
    """Which inputs a piece comes from. Only the record parts the piece uses count (its exit
    reason and write time change when the job ends, after the shard was written)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{WRITER_VERSION}:{offset_ns}:".encode())
    if record is not None:
        used = {k: record.get(k) for k in ("rank", "world_size", "host", "device",
                                           "process_groups", "collectives", "graphs", "replays",
                                           "marks")}
        h.update(orjson.dumps(used, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
                              default=str))
    for path in trace_paths:
        try:
            h.update(_file_sample(path))
        except OSError:
            h.update(f"{path.name}:missing".encode())
    return h.hexdigest()


def read_shard(path: Path) -> tuple[tuple[str | None, str | None], list[CommEvent]]:
    """The shard's fingerprints (of all its inputs; of its record alone) and the collectives on
    its comm lanes."""
    reader = Reader()
    lanes: dict[int, str] = {}            # lane track uuid -> pg
    fingerprint_seen: tuple[str | None, str | None] = (None, None)
    rank: int | None = None
    for packet in iter_packets(path):
        reader.feed(packet)
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("process"):
                rank = d.process.pid - PID_BASE
                m = _FINGERPRINT_RE.search(d.description)
                fingerprint_seen = (m.group(1), m.group(2)) if m else (None, None)
            elif d.sibling_merge_key.startswith("lane "):
                lanes[d.uuid] = d.sibling_merge_key[5:]
            continue
        if packet.HasField("trace_packet_defaults"):
            if packet.trace_packet_defaults.track_event_defaults.track_uuid not in lanes:
                break                      # past the lanes: the rest is the rank's own events
    if rank is None:
        return (None, None), []
    done, _ = slices(reader.contents)
    events = []
    for s in done:
        if s.track not in lanes or s.category != LANE_CAT:
            continue
        args = {k: v for k, v in s.args.items() if k not in _ADDED}
        key = s.args.get(INSTANCE)
        events.append(CommEvent(rank=rank, pg=lanes[s.track], op=s.name or "", start_ns=s.start,
                                end_ns=s.end, args=args,
                                key=instance_from_text(key) if key else None,
                                source=str(s.args.get("commviz.source", "record")),
                                stream=s.args.get("commviz.stream"),
                                graphed=bool(s.args.get("commviz.graphed"))))
    events.sort(key=lambda e: (e.start_ns, e.end_ns))
    return fingerprint_seen, events

