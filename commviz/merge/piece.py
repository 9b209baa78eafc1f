"""One rank's piece of the merged trace: its process, CPU threads, GPU streams and comm lanes.

Runs in a worker process, one rank at a time, and writes the piece to a file (workers hand back
paths, never trace data). Layout of the process "rank R · host · device":

- one comm lane per process group ("PG tp · ranks [0, 1]"), ordered by group name on every
  rank, holding the rank's collectives (CommEvents) with their metadata as args, and a flow
  whose id comes from the collective's instance key, so the same collective on every rank of
  the group is chained without any rank knowing the others;
- each GPU stream, then each CPU thread, with every profiler event at its own time; events
  that cross (do not nest) go to extra backing tracks with the same name and merge key, so the
  UI shows one row and nothing is moved;
- CPU launch -> GPU kernel flows from the profiler's own flow events (``ac2g``), bound by
  correlation id, or drawn from the correlation ids where a trace has none (``flows.py``).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import pickle
import time
import zlib
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import orjson

from commviz import metadata as md
from commviz.errors import TraceError
from commviz.match import artifact
from commviz.match.artifact import Clock, PgInfo, RankArtifact, TraceLabels
from commviz.match.model import CommEvent, InstanceKey, comm_columns, comm_events
from commviz.merge.flows import Correlated, Edge, FlowPoint, launch_edges
from commviz.merge.keep import Keep, Spans, events_inside
from commviz.trace.joinable import native
from commviz.kernels import GPU_CATS
from commviz.trace.load import Trace, load_trace
from commviz.write.chrome import write_rank_fragment
from commviz.write.pftrace import Piece, emit_slices, flow_field, split, track_descriptor

PID_BASE = 1_000_000                  # synthetic pid of rank R: PID_BASE + R (OS pids repeat)
ORDER_LANE, ORDER_STREAM, ORDER_THREAD, ORDER_OTHER = 0, 100_000, 200_000, 300_000
CROSS_FLOW_BIT = 1 << 63
_TIMED = frozenset({"s", "t", "f", "i", "I", "C"})      # converted phases other than X and M
MAX_NS = (1 << 63) - 1                # Perfetto's timestamps: what trace processor can hold
LANE_CAT = "commviz"
INSTANCE = "commviz.instance"         # lane slice arg: the instance key, as JSON
LANE_KEY = "lane "                    # comm lanes' sibling merge key: LANE_KEY + process group


def cross_flow_id(key: InstanceKey) -> int:
    """The flow id of a collective instance, the same on every rank (top bit set)."""
    digest = hashlib.blake2b(repr(key.wire()).encode(), digest_size=8).digest()
    return CROSS_FLOW_BIT | int.from_bytes(digest, "little") >> 1


def carries_cross_flow(key: InstanceKey | None, args: dict[str, Any]) -> bool:
    """Whether a lane slice links to its instance on other ranks (a one-rank group has none)."""
    return key is not None and args.get(md.GROUP_SIZE) != 1


def instance_text(key: InstanceKey) -> str:
    """A lane slice's ``commviz.instance`` arg: the key's compact form as JSON."""
    return orjson.dumps(key.wire()).decode()


def local_flow_base(rank: int) -> int:
    return (rank + 1) << 40


def lane_order(pg: str) -> int:
    """A lane's place among the lanes: by group name, numerically, the same on every rank."""
    if pg.isdigit() and int(pg) < 50_000:
        return int(pg)
    return 50_000 + zlib.crc32(pg.encode()) % 50_000


@dataclass
class RankJob:
    """What a worker needs to convert one rank (small and picklable)."""

    rank: int
    out: Path
    record: dict | None
    trace_paths: list[Path]
    matched: Path | None                # the rank's matched run: read when fresh, else written
                                        # (None: neither, where it would go to the scratch dir
                                        # and be deleted unread)
    inputs: str                         # fingerprint of record + traces (artifact.inputs_...)
    record_inputs: str | None           # of the record alone (its traces may stay on its node)
    clock: Clock = Clock()              # this rank's clock (a pending one: its own, match only)
    host: str | None = None
    fmt: str = "pftrace"
    fingerprint: str | None = None      # of the shard's inputs and clock, written into the piece
    shard: Path | None = None           # the rank's own shard, reused if its fingerprint matches
    json_base_ns: int = 0               # --format json: ts are µs after this wall time
    keep: Keep | None = None            # --steps / --window: only events starting inside
    early: Path | None = None           # where its ``Matched`` goes once matched (``send_early``)

    @property
    def offset_ns(self) -> int:
        return self.clock.offset_ns


@dataclass
class RankResult:
    rank: int
    out: Path | None
    stats: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    events: list[CommEvent] = field(default_factory=list)   # for the cross-rank summary
    pgs: dict[str, PgInfo] = field(default_factory=dict)
    sent_early: bool = False            # events went ahead as a ``Matched`` (``send_early``)


class Matched(NamedTuple):
    """A rank's matched collectives and groups, sent ahead of its result (``send_early``), so
    the main process writes the cross-rank piece while the ranks' pieces are still written."""

    rank: int
    events: list[CommEvent]
    pgs: dict[str, PgInfo]

    def __reduce__(self) -> tuple:
        """Pickled with its events as columns (``comm_columns``)."""
        return _matched, (self.rank, comm_columns(self.events), self.pgs)


def _matched(rank: int, columns: list[list], pgs: dict[str, PgInfo]) -> Matched:
    return Matched(rank, comm_events(columns), pgs)


def result_of(job: RankJob, art: RankArtifact, out: Path | None) -> RankResult:
    """What the merge keeps of a rank: its matched collectives, groups, problems and counts."""
    stats = {"rank": job.rank, "host": art.host, **art.stats,
             "lanes": dict(Counter(ev.pg for ev in art.events))}
    return RankResult(rank=job.rank, out=out, stats=stats, problems=list(art.problems),
                      events=art.events, pgs=art.pgs)


def build_artifact(job: RankJob, traces: list[Trace], problems: list[str]) -> RankArtifact:
    """Match the rank once, on its clock, and save it beside its shard (``RankJob.matched``)."""
    art = artifact.build(job.rank, traces, job.record, inputs=job.inputs,
                         record_inputs=job.record_inputs, clock=job.clock, host=job.host,
                         problems=problems)
    if job.fmt == "pftrace" and job.fingerprint:
        art.shard = job.fingerprint
    if job.matched is not None:
        artifact.save(art, job.matched)
    return art


def load_traces(job: RankJob, problems: list[str]) -> list[Trace]:
    traces = []
    for path in job.trace_paths:
        try:
            trace = load_trace(path, rank=job.rank, shapes_as_text=job.fmt == "pftrace")
        except TraceError as exc:
            problems.append(str(exc))
            continue
        problems.extend(trace.problems)       # events whose times were not believed
        traces.append(trace)
    return traces


def _device(job: RankJob, gpu_pids: set) -> str:
    device = (job.record or {}).get("device")
    if device:
        return str(device)
    ints = sorted(p for p in gpu_pids if isinstance(p, int))
    return f"cuda:{ints[0]}" if ints else "cpu"


def lane_name(pg: str, info: PgInfo | None) -> str:
    """"PG tp · ranks [0, 1]"; a group made without a description (``md.group_label``) by its
    number and ranks: "PG 3 · ranks [0, 2]"."""
    desc = info.desc if info is not None else None
    label = f"PG {desc}" if desc and desc != md.UNDESCRIBED else f"PG {pg}"
    ranks = info.ranks if info is not None else None
    if isinstance(ranks, str):
        return f"{label} · ranks {ranks}"
    return f"{label} · ranks {list(ranks)}" if ranks is not None else label


def lane_events(events: list[CommEvent]) -> tuple[list[dict], dict[str, list]]:
    """Chrome-style event dicts for the comm lanes, and per pg the (start, -end, index) items."""
    out: list[dict] = []
    items: dict[str, list] = defaultdict(list)
    for ev in events:
        args = dict(ev.args)
        args["commviz.source"] = ev.source.value
        if ev.stream is not None:
            args["commviz.stream"] = ev.stream
        if ev.graphed:
            args["commviz.graphed"] = True
        if ev.key is not None:
            args[INSTANCE] = instance_text(ev.key)
        start, end = ev.start_ns, max(ev.end_ns, ev.start_ns)
        items[ev.pg].append((start, -end, len(out)))
        out.append({"name": ev.op, "cat": LANE_CAT, "args": args, "key": ev.key})
    for lst in items.values():
        lst.sort()
    return out, items


class _Layout:
    """One pass over the profiler events: per (pid, tid) track the sorted slice items (only
    those starting inside ``spans`` when given: ``--steps`` / ``--window``)."""

    def __init__(self, events: list[dict], segments: list[tuple[int, int, int]],
                 spans: Spans | None = None) -> None:
        self.items: dict[tuple, list] = defaultdict(list)
        self.gpu: set[tuple] = set()
        self.flows: list[FlowPoint] = []
        self.correlated: Correlated = defaultdict(list)       # (trace, correlation) -> (i, track)
        self.counters: dict[tuple, list] = defaultdict(list)      # (pid, name, arg) -> [(ns, v)]
        self.process_labels: dict[Any, str] = {}               # pid -> "GPU 0" / "CPU"
        self.thread_names: dict[tuple, str] = {}
        self.skipped: dict[str, int] = defaultdict(int)
        self.negative = 0
        self.out_of_range = 0               # events before 0 or past MAX_NS: left out, counted
        inside = spans.inside if spans is not None else None
        scan = native if events.__class__ is list else None
        for seg, (lo, hi, base) in enumerate(segments):
            i = lo
            while i < hi:
                if scan is not None:        # the C pass, up to an event it leaves to Python
                    i, negative, out_of_range = scan.slices(
                        events, i, hi, seg, base, inside, GPU_CATS, self.items, self.gpu,
                        self.correlated, self.flows, FlowPoint, MAX_NS)
                    self.negative += negative
                    self.out_of_range += out_of_range
                    if i >= hi:
                        break
                self._event(events[i], i, seg, base, inside)
                i += 1
        for lst in self.items.values():
            lst.sort()

    def _event(self, ev: dict, i: int, seg: int, base: int,
               inside: Callable[[int], bool] | None) -> None:
        """One event of trace ``seg`` (the reference for ``_scan.slices``, and its fallback)."""
        ph = ev.get("ph")
        if ph == "X":
            key = (ev.get("pid"), ev.get("tid"))
            start = base + round(ev["ts"] * 1000)
            dur = ev.get("dur")
            dur = round(dur * 1000) if dur else 0
            if dur < 0:                     # invalid: kept as an instant, and counted
                self.negative += 1
                dur = 0
            if start < 0 or start + dur > MAX_NS:
                self.out_of_range += 1
                return
            if inside is not None and not inside(start):
                return
            self.items[key].append((start, -(start + dur), i))
            if ev.get("cat") in GPU_CATS:
                self.gpu.add(key)
            args = ev.get("args")
            if args:
                corr = args.get("correlation")
                if corr is not None:
                    self.correlated[(seg, corr)].append((i, key))
        elif ph == "M":
            self._meta(ev)
        elif ph in _TIMED:
            ts = base + round(ev["ts"] * 1000)
            if not 0 <= ts <= MAX_NS:
                self.out_of_range += 1
            elif inside is not None and not inside(ts):
                return
            elif ph == "C":
                for arg, value in (ev.get("args") or {}).items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self.counters[(ev.get("pid"), ev.get("name"), arg)].append((ts, value))
            elif ph in ("i", "I"):
                self.items[(ev.get("pid"), ev.get("tid"))].append((ts, -ts, i))
            else:
                self.flows.append(FlowPoint(seg, ev.get("cat"), ev.get("id"), ph,
                                            (ev.get("pid"), ev.get("tid")), ts))
        else:
            self.skipped[str(ph)] += 1

    def _meta(self, ev: dict) -> None:
        args = ev.get("args") or {}
        kind = ev.get("name")
        if kind == "process_labels" and args.get("labels"):
            self.process_labels[ev.get("pid")] = str(args["labels"])
        elif kind == "thread_name" and args.get("name") is not None:
            self.thread_names[(ev.get("pid"), ev.get("tid"))] = str(args["name"]).strip()

    def track_name(self, key: tuple) -> str:
        pid, tid = key
        name = self.thread_names.get(key)
        if key in self.gpu:
            proc = self.process_labels.get(pid) or f"GPU {pid}"
            stream = tid if isinstance(tid, str) else f"stream {tid}"   # early Kineto: "stream 7"
            return f"{proc} · {name or stream}"
        if name:
            return name
        if pid in ("Spans", "Traces", ""):
            return f"{pid or 'global'} · {tid or 'profiler'}".strip(" ·")
        return f"thread {tid}"

    def track_order(self, key: tuple, os_pids: set) -> tuple:
        pid, tid = key
        if key in self.gpu:
            return (ORDER_STREAM, _num(pid), _num(tid), str(key))
        if pid in os_pids:
            return (ORDER_THREAD, tid != pid, _num(tid), str(key))
        return (ORDER_OTHER, 0, 0, str(key))


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("inf")


def _flow_fields(edges: list[Edge], rank: int) -> dict[int, bytes]:
    """Event index -> its encoded flow ids, one id per edge."""
    flows: dict[int, bytes] = defaultdict(bytes)
    for n, (source, target) in enumerate(edges, start=local_flow_base(rank)):
        flows[source] += flow_field(n)
        flows[target] += flow_field(n)
    return dict(flows)


def _concat(traces: list[Trace], labels: list[TraceLabels], offset_ns: int
            ) -> tuple[list[dict], list[tuple[int, int, int]], dict[int, dict]]:
    """All traces' events in one list, each trace's (lo, hi, time base) and the args to add."""
    combined = traces[0].events if len(traces) == 1 else [e for t in traces for e in t.events]
    by_trace = {lab.trace: lab for lab in labels}
    segments: list[tuple[int, int, int]] = []
    extra: dict[int, dict] = {}
    lo = 0
    for trace in traces:
        hi = lo + len(trace.events)
        segments.append((lo, hi, trace.base_ns + offset_ns))
        part = by_trace.get(trace.path.name)
        if part is not None:
            for index, args in part.kernel_args.items():
                extra.setdefault(index + lo, {}).update(args)
            for index, marks in part.marks.items():
                extra.setdefault(index + lo, {}).update(marks)
        lo = hi
    return combined, segments, extra


@dataclass
class _Rank:
    """Everything known about one rank once its inputs are read."""

    job: RankJob
    events: list[dict]                   # profiler events, all traces
    segments: list[tuple[int, int, int]]
    extra: dict[int, dict]
    layout: _Layout
    lanes: list[dict]
    lane_items: dict[str, list]
    pgs: dict[str, PgInfo]
    name: str                            # "rank R · host · device"

    def tracks(self) -> list[tuple[tuple, str, int]]:
        """(pid, tid) tracks in display order, with their names and order ranks."""
        layout = self.layout
        os_pids = {k[0] for k in layout.items if k not in layout.gpu and isinstance(k[0], int)}
        keys = sorted(layout.items, key=lambda k: layout.track_order(k, os_pids))
        return [(key, layout.track_name(key), layout.track_order(key, os_pids)[0] + n)
                for n, key in enumerate(keys)]

    def lane_order(self) -> list[str]:
        return sorted(self.lane_items, key=lambda g: (lane_order(g), g))

    def launch_edges(self) -> tuple[list[Edge], list[Edge], int]:
        return launch_edges(self.events, self.layout.items, self.layout.correlated,
                            self.layout.flows, len(self.segments))


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: parsing a trace allocates millions of containers,
    and each automatic collection would walk all of them again (a trace's events hold no
    cycles; reference counting frees them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Held:
    """In a merge worker, the last rank's decoded traces and layout: freed when the worker's
    next rank starts rather than before its result goes back. Freeing a rank's millions of
    objects takes about a tenth of its conversion; this way a worker's last rank hands back
    its result without that wait, and the worker process ends without freeing them (its pool
    starts it by fork, which leaves with ``os._exit``). Off outside the pool's workers, so a
    merge run in-process keeps nothing."""

    on = False
    objects: tuple = ()


def hold_last_rank() -> None:
    """The merge pool's worker initializer (``_Held``, ``keep_freed_memory``)."""
    _Held.on = True
    keep_freed_memory()


M_TOP_PAD = -2                  # glibc's mallopt parameter
TOP_PAD = 64 << 20


def keep_freed_memory() -> None:
    """In a merge worker, have glibc keep up to 64 MiB freed at the top of its heap (it keeps
    128 KiB) for the allocations that follow, rather than hand it back to the kernel and have
    each page faulted in and zeroed again: a merge's faults fall by 6 % and its kernel time by
    a fifth on a 2-core VM, where a fault costs about 2 us. Elsewhere than glibc, nothing."""
    try:
        ctypes.CDLL(None).mallopt(M_TOP_PAD, TOP_PAD)
    except (OSError, AttributeError):
        pass


def send_early(path: Path, matched: Matched) -> None:
    """Leave a rank's ``Matched`` at ``path`` (``RankJob.early``) whole or not at all: the main
    process reads it the moment it is there."""
    part = path.with_name(f".{path.name}.part")
    part.write_bytes(pickle.dumps(matched, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(part, path)


def read_early(path: Path) -> Matched:
    """What ``send_early`` left at ``path`` (a file of the merge's own scratch dir, whole once
    it has that name)."""
    return pickle.loads(path.read_bytes())


def convert_rank(job: RankJob, art: RankArtifact | None = None) -> RankResult:
    """Convert one rank into its piece file (pftrace, or a Chrome JSON fragment), from its
    matched run ``art`` (built and saved here when not given)."""
    _Held.objects = ()
    with no_gc():
        return _convert(job, art)


class Phases:
    """Seconds each step of a rank's conversion took (``stats["phases"]``: read, match,
    layout, flows, write), so a slow merge says where its time went."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = round(now - self._last, 4)
        self._last = now


def _convert(job: RankJob, art: RankArtifact | None) -> RankResult:
    problems: list[str] = []
    phases = Phases()
    traces = load_traces(job, problems)
    phases.done("read")
    if art is None:
        art = build_artifact(job, traces, problems)
        problems = []                  # the trace problems are the artifact's now
    phases.done("match")
    combined, segments, extra = _concat(traces, art.labels, job.offset_ns)
    spans = job.keep.spans(combined, segments) if job.keep is not None else None
    if spans is not None:
        if not spans:
            problems.append(f"rank {job.rank}: its traces hold no {job.keep.label}; nothing "
                            "of it kept")
        art = replace(art, events=events_inside(art.events, spans))
    events = art.events
    if job.early is not None:
        send_early(job.early, Matched(job.rank, events, art.pgs))
    layout = _Layout(combined, segments, spans)
    if layout.negative:
        problems.append(f"rank {job.rank}: {layout.negative} profiler events have a negative "
                        "duration; they are shown as instants at their start")
    if layout.out_of_range:
        problems.append(f"rank {job.rank}: {layout.out_of_range} profiler events lie outside "
                        "the times a Perfetto trace can hold (before 0 or past 2^63 ns on the "
                        "merged clock: a ts or dur the profiler cannot have meant); left out")
    for ph, n in sorted(layout.skipped.items()):
        problems.append(f"rank {job.rank}: {n} profiler events of phase {ph!r} were not "
                        "converted (commviz converts X, i, s/t/f, C and M events)")
    lanes, lane_items = lane_events(events)
    phases.done("layout")
    device = _device(job, {k[0] for k in layout.gpu})
    host = job.host or art.host or "?"
    rank = _Rank(job, combined, segments, extra, layout, lanes, lane_items, art.pgs,
                 process_name(job.rank, host, device))
    result = result_of(job, art, job.out)
    result.problems.extend(p for p in problems if p not in result.problems)
    result.stats.update(host=host, device=device, traces=len(traces),
                        profiler_events=len(combined))
    if job.fmt == "json":
        _write_json(rank, result, phases)
    else:
        _write_pftrace(rank, result, phases)
    phases.done("write")
    result.stats["phases"] = phases.seconds
    if job.early is not None:           # the main process has them already
        result.events, result.sent_early = [], True
    if _Held.on:
        _Held.objects = (traces, combined, layout, rank, art)
    return result


def process_name(rank: int, host: str, device: str) -> str:
    return f"rank {rank} · {host} · {device}"


def _write_pftrace(r: _Rank, result: RankResult, phases: Phases) -> None:
    job = r.job
    bound, derived, unbound = r.launch_edges()
    phases.done("flows")
    flows = _flow_fields(bound + derived, job.rank)
    flow_stats = {"flows": len(bound) + len(derived), "flows_from_correlation": len(derived),
                  "flow_points_unbound": unbound}
    lane_flows = {i: flow_field(cross_flow_id(ev["key"])) for i, ev in enumerate(r.lanes)
                  if carries_cross_flow(ev["key"], ev["args"])}
    result.stats.update(flow_stats, cross_flows=len(lane_flows))
    os_pids = sorted({k[0] for k in r.layout.items
                      if k not in r.layout.gpu and isinstance(k[0], int)})
    sources = ", ".join(p.name for p in job.trace_paths) or "its record"
    desc = f"converted by commviz from {sources}"
    if job.fingerprint:
        desc += f" (shard {job.fingerprint}, inputs {job.inputs})"
    with open(job.out, "wb") as f:
        piece = Piece(f, job.rank + 1)
        proc = piece.new_uuid()
        piece.descriptor(track_descriptor(
            proc, name=r.name, pid=PID_BASE + job.rank, process_name=r.name,
            labels=[f"os pid {p}" for p in os_pids], explicit_children=True,
            order_rank=job.rank, description=desc))
        plan: list[tuple[int, list, list[dict], dict, dict]] = []
        backing = 0

        def add(name: str, order: int, merge_key: str, items: list, events: list[dict],
                extra: dict, flows: dict) -> None:
            nonlocal backing
            backs = split(items)
            backing += len(backs) - 1
            for back in backs:
                uuid = piece.new_uuid()
                piece.descriptor(track_descriptor(uuid, name=name, parent=proc,
                                                  order_rank=order, merge_key=merge_key))
                plan.append((uuid, back, events, extra, flows))

        for pg in r.lane_order():
            add(lane_name(pg, r.pgs.get(pg)), ORDER_LANE + lane_order(pg), f"{LANE_KEY}{pg}",
                r.lane_items[pg], r.lanes, {}, lane_flows)
        for key, name, order in r.tracks():
            add(name, order, f"track {key[0]}:{key[1]}", r.layout.items[key], r.events,
                r.extra, flows)
        counters = []
        for (pid, cname, arg), samples in sorted(r.layout.counters.items(), key=str):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=f"{cname} {arg}", parent=proc,
                                              order_rank=ORDER_OTHER, counter=True))
            counters.append((uuid, sorted(samples)))
        slices = 0
        for uuid, items, events, extra, fl in plan:
            seq = piece.sequence(uuid)
            piece.buf += seq.start(items[0][0])
            slices += emit_slices(seq, piece.buf, items, events, extra, fl)
            piece.maybe_flush()
        for uuid, samples in counters:
            seq = piece.sequence(uuid)
            piece.buf += seq.start(samples[0][0])
            piece.buf += seq.counters(samples)
        piece.flush()
    result.stats.update(slices=slices, backing_tracks=backing, bytes=piece.packets_bytes)


def _write_json(r: _Rank, result: RankResult, phases: Phases) -> None:
    _, derived, _ = r.launch_edges()       # the profiler's own flow events are copied as they are
    phases.done("flows")
    count = write_rank_fragment(
        r.job.out, rank=r.job.rank, name=r.name, events=r.events, segments=r.segments,
        extra=r.extra, lanes=r.lanes, lane_items=r.lane_items,
        lane_names={pg: lane_name(pg, r.pgs.get(pg)) for pg in r.lane_items},
        lane_orders={pg: lane_order(pg) for pg in r.lane_items}, base_ns=r.job.json_base_ns,
        launches=derived)
    result.stats.update(json_events=count, bytes=os.path.getsize(r.job.out))
