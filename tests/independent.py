"""Expectations read without commviz: merged traces through the perfetto package's own
protobuf classes, profiler traces through the stdlib."""

from __future__ import annotations

import gzip
import json
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


class Slice:
    """One slice of a merged trace as Perfetto's protos spell it (``slices``)."""

    def __init__(self, name: str, track: str, process: str, ts: int, args: dict,
                 flow_ids: list[int]) -> None:
        self.name, self.track, self.process, self.ts = name, track, process, ts
        self.args, self.flow_ids = args, flow_ids
        self.dur = 0

    def __repr__(self) -> str:
        return f"Slice({self.name!r}, {self.process!r}/{self.track!r}, ts={self.ts})"


def slices(path: Path) -> list[Slice]:
    """Every slice of a .pftrace, read with the perfetto package's protos alone: interned
    names and values resolved per packet sequence, incremental timestamps summed, BEGIN/END
    paired per track, each track named with its process."""
    trace = pb.Trace()
    trace.ParseFromString(Path(path).read_bytes())
    tracks: dict[int, tuple[str, int | None, str | None]] = {}   # uuid -> (name, parent, process)
    state: dict[int, dict] = {}
    events: list[tuple[int, Slice | None, int]] = []             # (track uuid, slice/None=end, ts)
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            proc = d.process.process_name if d.HasField("process") else None
            tracks[d.uuid] = (d.name, d.parent_uuid if d.HasField("parent_uuid") else None, proc)
        seq = p.trusted_packet_sequence_id
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            state[seq] = {"names": {}, "keys": {}, "strings": {}, "clock": 0, "track": None}
        st = state.get(seq)
        if st is None:
            continue
        if p.HasField("trace_packet_defaults"):
            st["track"] = p.trace_packet_defaults.track_event_defaults.track_uuid
            st["clock_id"] = p.trace_packet_defaults.timestamp_clock_id
        if p.HasField("clock_snapshot"):
            for c in p.clock_snapshot.clocks:
                if c.clock_id == st.get("clock_id"):
                    st["clock"] = c.timestamp
        interned = p.interned_data
        st["names"].update({e.iid: e.name for e in interned.event_names})
        st["keys"].update({e.iid: e.name for e in interned.debug_annotation_names})
        st["strings"].update({e.iid: e.str.decode() for e in interned.debug_annotation_string_values})
        if not p.HasField("track_event"):
            continue
        st["clock"] += p.timestamp
        te = p.track_event
        uuid = te.track_uuid if te.HasField("track_uuid") else st["track"]
        if te.type == pb.TrackEvent.TYPE_SLICE_END:
            events.append((uuid, None, st["clock"]))
            continue
        if te.type not in (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_INSTANT):
            continue
        args = {}
        for a in te.debug_annotations:
            key = a.name if a.HasField("name") else st["keys"].get(a.name_iid)
            kind = a.WhichOneof("value")
            args[key] = (st["strings"].get(a.string_value_iid) if kind == "string_value_iid"
                         else getattr(a, kind) if kind else None)
        name = te.name if te.HasField("name") else st["names"].get(te.name_iid, "")
        s = Slice(name, "", "", st["clock"], args,
                  list(te.flow_ids) + list(te.terminating_flow_ids))
        events.append((uuid, s, st["clock"]) if te.type == pb.TrackEvent.TYPE_SLICE_BEGIN
                      else (uuid, None, -1))
        if te.type == pb.TrackEvent.TYPE_INSTANT:
            events[-1] = (uuid, s, st["clock"])
            events.append((uuid, None, st["clock"]))

    def process_of(uuid: int | None) -> str:
        while uuid is not None and uuid in tracks:
            name, parent, proc = tracks[uuid]
            if proc:
                return proc
            uuid = parent
        return ""

    out: list[Slice] = []
    open_: dict[int, list[Slice]] = {}
    for uuid, s, ts in events:
        if s is None:
            stack = open_.get(uuid)
            if stack:
                done = stack.pop()
                done.dur = ts - done.ts
            continue
        s.track = tracks.get(uuid, ("", None, None))[0]
        s.process = process_of(uuid)
        open_.setdefault(uuid, []).append(s)
        out.append(s)
    return out


LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
ELEMENT_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4}


def p2p_truth(trace: Path) -> list[dict]:
    """Per eager SendRecv kernel of a profiler trace (in launch order): its correlation, and
    the p2p ops the profiler recorded (``record_param_comms``) on the launching thread since
    that thread's previous NCCL launch, as (direction, peer, bytes)."""
    events = json.loads(gzip.decompress(Path(trace).read_bytes()))["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: e for e in xs
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    nccl = [e for e in xs if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel")
            and e["args"].get("correlation") in launch]
    launches = sorted((launch[k["args"]["correlation"]]["ts"], k) for k in nccl)
    comms = sorted((e for e in xs if e["name"] == "record_param_comms"
                    and e["args"].get("Collective name") in ("send", "recv")),
                   key=lambda c: c["ts"])
    out = []
    for n, (t, k) in enumerate(launches):
        if not k["name"].startswith("ncclDevKernel_SendRecv"):
            continue
        tid = launch[k["args"]["correlation"]]["tid"]
        prev = max((launches[i][0] for i in range(n)
                    if launch[launches[i][1]["args"]["correlation"]]["tid"] == tid),
                   default=float("-inf"))
        ops = []
        for c in comms:
            a = c["args"]
            if c["tid"] == tid and prev < c["ts"] < t:
                peer = a.get("Dst Rank") if a["Collective name"] == "send" else a.get("Src Rank")
                ops.append((a["Collective name"], peer,
                            a["In msg nelems"] * ELEMENT_BYTES[a["dtype"]]))
        out.append({"correlation": k["args"]["correlation"], "ops": ops})
    return out


def ops_text(ops: list[tuple[str, int, int]]) -> str:
    """(direction, peer, bytes) ops in the words of the issue: ``send→1 4 KiB, recv←1 4 KiB``."""
    from commviz.metadata import fmt_bytes

    return ", ".join(f"{d}{'→' if d == 'send' else '←'}{peer} {fmt_bytes(size)}"
                     for d, peer, size in ops)
