r"""The merged trace as one Chrome JSON file (chrome://tracing, Perfetto's JSON import, HTA).

Each rank's events keep their phases, names and args; what changes so ranks can share a file:
pids are made rank-unique (``(rank + 1) * 10**7 + pid``), flow ids are offset by rank, ``ts``
is microseconds after one common ``baseTimeNanoseconds`` on the merged clock, process names
say the rank, and a flow with one end (cut off, or its other end not believed) is left out.
Each rank also gets a "comm lanes" process with one thread per process group.
Ranks are written as fragments (by the workers) and joined into one file by ``join``, or each
into its own file by ``write_rank_trace`` (HTA reads one file per rank).

Top-level keys are written as the profiler writes them, with a space after each colon:
Holistic Trace Analysis finds a file's rank with the regex ``"rank":\s+(\d+)``.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import orjson

PID_SPAN = 10_000_000
LANES_PID = PID_SPAN - 1
FLOW_SHIFT = 40
FLOW_PHASES = frozenset({"s", "t", "f"})


def rank_pid(rank: int, pid: Any) -> int:
    if isinstance(pid, int) and 0 <= pid < LANES_PID:
        return (rank + 1) * PID_SPAN + pid
    return (rank + 1) * PID_SPAN + zlib.crc32(str(pid).encode()) % LANES_PID


def write_rank_fragment(out: Path, *, rank: int, name: str, events: list[dict],
                        segments: list[tuple[int, int, int]], extra: dict[int, dict],
                        lanes: list[dict], lane_items: dict[str, list], lane_names: dict[str, str],
                        lane_orders: dict[str, int], base_ns: int,
                        launches: Iterable[tuple[int, int]] = ()) -> int:
    """Write one rank's events as comma-separated JSON objects; return how many.

    ``launches``: (launch, GPU event) index pairs that need a flow the input lacks (drawn
    from correlation ids): written as Kineto writes its own (``ac2g``, id = correlation).
    """
    dumps = orjson.dumps
    flow_offset = (rank + 1) << FLOW_SHIFT
    drawn = two_ended_flows(events[i] for lo, hi, _ in segments for i in range(lo, hi))
    count = 0
    with open(out, "wb") as f:
        buf = bytearray()

        def put(ev: dict) -> None:
            nonlocal count
            if count:
                buf.extend(b",")
            try:
                buf.extend(dumps(ev, option=orjson.OPT_NON_STR_KEYS))
            except TypeError:           # an integer past 64 bits (the decoder keeps them)
                buf.extend(json.dumps(ev, ensure_ascii=False, default=str).encode())
            count += 1

        for lo, hi, seg_base in segments:
            shift_us = (seg_base - base_ns) / 1000
            for i in range(lo, hi):
                if events[i].get("ph") in FLOW_PHASES and _flow_key(events[i]) not in drawn:
                    continue                    # a flow with one end links nothing
                ev = dict(events[i])
                ev["pid"] = rank_pid(rank, ev.get("pid"))
                if "ts" in ev:
                    ev["ts"] = round(ev["ts"] + shift_us, 3)
                if "id" in ev and isinstance(ev["id"], int):
                    ev["id"] = ev["id"] + flow_offset
                more = extra.get(i)
                if more:
                    ev["args"] = {**(ev.get("args") or {}), **more}
                if ev.get("ph") == "M":
                    _rename(ev, rank, name)
                put(ev)
                if len(buf) > 1 << 22:
                    f.write(buf)
                    buf.clear()
        def shift(i: int) -> float:
            return next((b - base_ns) / 1000 for lo, hi, b in segments if lo <= i < hi)

        for source, target in launches:
            for ph, i in (("s", source), ("f", target)):
                ev = events[i]
                flow = {"ph": ph, "id": ev["args"]["correlation"] + flow_offset,
                        "pid": rank_pid(rank, ev.get("pid")), "tid": ev.get("tid"),
                        "ts": round(ev["ts"] + shift(i), 3), "cat": "ac2g", "name": "ac2g"}
                put({**flow, "bp": "e"} if ph == "f" else flow)
        lanes_pid = (rank + 1) * PID_SPAN + LANES_PID
        put({"ph": "M", "name": "process_name", "pid": lanes_pid, "tid": 0,
             "args": {"name": f"{name} · comm lanes"}})
        put({"ph": "M", "name": "process_sort_index", "pid": lanes_pid, "tid": 0,
             "args": {"sort_index": rank * 1000}})
        for pg, items in lane_items.items():
            tid = lane_orders[pg]
            put({"ph": "M", "name": "thread_name", "pid": lanes_pid, "tid": tid,
                 "args": {"name": lane_names[pg]}})
            for start, neg_end, index in items:
                lane = lanes[index]
                put({"ph": "X", "cat": lane["cat"], "name": lane["name"], "pid": lanes_pid,
                     "tid": tid, "ts": round((start - base_ns) / 1000, 3),
                     "dur": round((-neg_end - start) / 1000, 3), "args": lane["args"]})
        f.write(buf)
    return count


def _flow_key(ev: dict) -> tuple[Any, Any]:
    return ev.get("cat"), ev.get("id")


def two_ended_flows(events: Iterable[dict]) -> set[tuple[Any, Any]]:
    """(cat, id) of the flows among ``events`` with a start and a step or finish: the others
    (a trace cut mid-step, an end whose event was not believed) would be drawn with one end."""
    phases: dict[tuple[Any, Any], set[str]] = {}
    for ev in events:
        if ev.get("ph") in FLOW_PHASES:
            phases.setdefault(_flow_key(ev), set()).add(ev["ph"])
    return {key for key, ph in phases.items() if "s" in ph and ph & {"t", "f"}}


def _rename(ev: dict, rank: int, name: str) -> None:
    args = dict(ev.get("args") or {})
    if ev.get("name") == "process_name":
        args["name"] = f"{name} · {args.get('name', '')}".rstrip(" ·")
    elif ev.get("name") == "process_sort_index":
        args["sort_index"] = rank * 1000 + 1 + (args.get("sort_index", 0) % 999
                                                if isinstance(args.get("sort_index"), int) else 0)
    ev["args"] = args


def _head(meta: dict[str, Any]) -> bytes:
    """The top-level keys, spaced as the profiler writes them, and the opening of traceEvents."""
    return json.dumps(meta)[:-1].encode() + b', "traceEvents": ['


def _events(out: BinaryIO, fragments: list[Path]) -> None:
    first = True
    for path in fragments:
        if path.stat().st_size == 0:
            continue
        if not first:
            out.write(b",")
        with open(path, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
        first = False


def trace_bytes(meta: dict[str, Any], events: list[dict]) -> bytes:
    """A whole Chrome trace: ``meta``'s keys spaced as the profiler writes them, the events
    compact (orjson)."""
    body = b",".join(orjson.dumps(ev, option=orjson.OPT_NON_STR_KEYS) for ev in events)
    return _head(meta) + body + b"]}"


def join(out: BinaryIO, fragments: list[Path], *, base_ns: int, meta: dict[str, Any]) -> None:
    """One Chrome trace from the ranks' fragments, streamed (never all in memory)."""
    out.write(_head({"schemaVersion": 1, "commviz_merged": True, "displayTimeUnit": "ms",
                     "baseTimeNanoseconds": base_ns, **meta}))
    _events(out, fragments)
    out.write(b"]}")


def write_rank_trace(out: BinaryIO, fragment: Path, *, rank: int, base_ns: int,
                     distributed_info: dict | None, meta: dict[str, Any]) -> None:
    """One rank's events on the merged clock as a trace of its own, with the profiler's
    ``distributedInfo`` (its rank set to ``rank``) so tools that read one file per rank can."""
    info = {**(distributed_info or {}), "rank": rank}
    out.write(_head({"schemaVersion": 1, "distributedInfo": info, "displayTimeUnit": "ms",
                     "baseTimeNanoseconds": base_ns, **meta}))
    _events(out, [fragment])
    out.write(b"]}")
