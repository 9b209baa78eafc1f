"""Reading a merged trace without commviz: the perfetto package's own protobuf classes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb


def flow_ends(path: Path) -> Counter:
    """flow id -> how many track events carry it (a flow needs two ends to be drawn)."""
    trace = pb.Trace()
    trace.ParseFromString(Path(path).read_bytes())
    ends: Counter = Counter()
    for packet in trace.packet:
        if packet.HasField("track_event"):
            ends.update(packet.track_event.flow_ids)
            ends.update(packet.track_event.terminating_flow_ids)
    return ends


def pg_seq(instance: str) -> tuple:
    """(process group, sequence number) of a lane slice's ``commviz.instance`` arg, read with
    the stdlib: the instance key as JSON, ``["c", pg, seq]`` for a collective."""
    import json

    kind, pg, seq = json.loads(instance)[:3]
    return pg, seq
