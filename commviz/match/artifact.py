"""One rank's matched run, built once and saved beside its shard: ``RUN_DIR/matched_rank{R}.json``.

Matching a rank's traces with its record is the expensive, knowledge-heavy step; everything
after it (the rank's Perfetto shard, the merge's cross-rank piece and summary tracks,
``commviz report``) reads this artifact instead of matching again. It is built where the rank's
data is: by ``write_shard`` on the rank's node at the end of a launched job, else by the merge's
worker (or the report, whichever comes first) for plain traces. Like Flight Recorder's analyzer
(one typed database) and HTA (a run loaded once), every analysis reads the same events.

The clock is applied here and only here (``RankArtifact.aligned``): the matcher's times are the
rank's own wall clock, the artifact's are the merged clock (rank 0's), and it says which offset
it applied and how that was found. The file is JSON of plain values, declared once
(``MatchedFile``, a ``commviz.filetype.FileType``: reading, checking, writing and the version
follow from it); loading never runs anything (no pickle). Its schema, version ``VERSION``::

    {"schema": "commviz.matched", "version": 1, "rank": int, "host": str | null,
     "inputs": str,                 # fingerprint of the record and traces it was built from
     "record_inputs": str | null,   # of the record alone (its traces may stay on its node)
     "shard": str | null,           # fingerprint of the shard written with it, if any
     "clock": {"offset_ns": int, "source": str},        # added to the rank's own times
     "pgs": {pg: {"desc": str | null, "ranks": [int] | str | null}},
     "events": [[pg, op, start_ns, end_ns, args, key | null, source, stream | null, graphed]],
     "gpu": {"names": [str], "cats": [str],
             "ops": [[stream, name index, cat index, start_ns, end_ns, graphed]]},
     "labels": [{"trace": str, "kernel_args": [[event index, args]],
                 "marks": [[event index, args]]}],  # per trace: args the shard adds to events
     "problems": [str], "stats": {str: int},
     "steps": [[n, start_ns, end_ns]]}   # its ProfilerStep#N ranges (absent: none known)

``steps`` came after version 1 was out: a file without it reads as a rank whose steps are not
known, and a reader that predates it ignores it, so it needed no new version.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal

import orjson
from pydantic import PlainSerializer, PlainValidator
from typing_extensions import NotRequired, TypedDict

from commviz import metadata as md
from commviz.errors import CommvizError, SourceError
from commviz.filetype import STRICT, FileType
from commviz.match import match_traces
from commviz.match.model import CommEvent, InstanceKey, Source, events_from_record
from commviz.match.result import RankMatch
from commviz.trace.gpu import GpuOp, gpu_ops
from commviz.trace.load import Trace
from commviz.trace.steps import Step, step_ranges
from commviz.record.store import write_atomic

MATCHED_GLOB = "matched_rank*.json"
# In the matcher's reason for a kernel that had nothing to match with (no record and no
# profiler metadata), as opposed to one it could not match with certainty.
NO_METADATA = "no collective metadata"
_SAMPLE = 1 << 16
_RECORD_PARTS = ("rank", "world_size", "host", "device", "process_groups", "collectives",
                 "graphs", "replays", "marks")


def matched_name(rank: int) -> str:
    """Rank R's matched run, beside its record and shard (``commviz.record.schema``'s style)."""
    return f"matched_rank{rank}.json"


def matched_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / matched_name(rank)


@dataclass(frozen=True, slots=True)
class Clock:
    """What was added to the rank's own times to put them on the merged clock, and why."""

    offset_ns: int = 0
    source: str = "none"


@dataclass(frozen=True, slots=True)
class PgInfo:
    desc: str | None
    ranks: list[int] | str | None      # the record's list, or the profiler's "[0, 1]"


@dataclass(frozen=True, slots=True)
class TraceLabels:
    """Args the shard adds to one trace's events (by index into ``Trace.events``)."""

    trace: str
    kernel_args: dict[int, dict[str, Any]]
    marks: dict[int, dict[str, Any]]


@dataclass(slots=True)
class RankArtifact:
    """One rank's matched collectives and GPU ops on the merged clock, with what it came from."""

    rank: int
    host: str | None
    inputs: str
    record_inputs: str | None
    clock: Clock
    events: list[CommEvent]
    gpu_ops: list[GpuOp]
    pgs: dict[str, PgInfo]
    labels: list[TraceLabels]
    problems: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    shard: str | None = None
    steps: list[Step] = field(default_factory=list)     # its profiler steps, merged clock

    def aligned(self, clock: Clock) -> RankArtifact:
        """The same rank on ``clock``: the one place a rank's times move between clocks."""
        delta = clock.offset_ns - self.clock.offset_ns
        if delta == 0:
            return replace(self, clock=clock)
        events = [replace(ev, start_ns=ev.start_ns + delta, end_ns=ev.end_ns + delta)
                  for ev in self.events]
        ops = [op._replace(start_ns=op.start_ns + delta, end_ns=op.end_ns + delta)
               for op in self.gpu_ops]
        steps = [Step(n, a + delta, b + delta) for n, a, b in self.steps]
        return replace(self, clock=clock, events=events, gpu_ops=ops, steps=steps)

    def own_ends(self) -> dict[InstanceKey, int]:
        """Each instance's end on the rank's own clock (what the clock derivation compares)."""
        return {ev.key: ev.end_ns - self.clock.offset_ns for ev in self.events
                if ev.key is not None}

    def fresh_for(self, inputs: str, record_inputs: str | None, has_traces: bool) -> bool:
        """Whether it was built from these inputs (or, where the rank's traces stayed on their
        node, from this record)."""
        return self.inputs == inputs or (not has_traces and record_inputs is not None
                                         and self.record_inputs == record_inputs)


# -- fingerprints ------------------------------------------------------------------------------

def _file_sample(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(_SAMPLE)
        size = f.seek(0, 2)
        f.seek(max(size - _SAMPLE, 0))
        tail = f.read(_SAMPLE)
    return f"{path.name}:{size}:".encode() + head + tail


def inputs_fingerprint(record: dict | None, trace_paths: Iterable[Path]) -> str:
    """Which inputs a rank's matched run comes from. Only the record parts matching uses count
    (its exit reason, write time and clock change when the job ends, after a shard was made)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{SCHEMA}:{VERSION}:".encode())
    if record is not None:
        used = {k: record.get(k) for k in _RECORD_PARTS}
        h.update(orjson.dumps(used, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
                              default=str))
    for path in trace_paths:
        try:
            h.update(_file_sample(path))
        except OSError:
            h.update(f"{path.name}:missing".encode())
    return h.hexdigest()


# -- building ----------------------------------------------------------------------------------

def _pg_table(record: dict | None, traces: list[Trace], events: list[CommEvent]
              ) -> dict[str, PgInfo]:
    """pg name -> desc and ranks: from the record, else distributedInfo, else the events."""
    table: dict[str, PgInfo] = {}
    for g in (record or {}).get("process_groups") or []:
        table.setdefault(str(g.get("name")), PgInfo(g.get("desc"), g.get("ranks")))
    for t in traces:
        for g in (t.distributed_info or {}).get("pg_config") or []:
            if isinstance(g, dict):
                table.setdefault(str(g.get("pg_name")), PgInfo(g.get("pg_desc"), g.get("ranks")))
    for ev in events:
        table.setdefault(ev.pg, PgInfo(ev.args.get(md.PG_DESC), ev.args.get(md.PG_RANKS)))
    return table


def _match(traces: list[Trace], record: dict | None, rank: int,
           problems: list[str]) -> tuple[list[CommEvent], RankMatch | None]:
    """The matcher's result; if matching fails, the record's own spans are the collectives."""
    try:
        result = match_traces(traces, record, rank=rank)
    except CommvizError as exc:
        problems.append(str(exc))
    except Exception as exc:  # the matcher's failure must not cost the rank its trace
        where = ", ".join(str(t.path) for t in traces) or f"rank {rank}"
        problems.append(f"{where}: matching failed ({type(exc).__name__}: {exc}); its lanes "
                        "come from the record alone")
    else:
        return list(result.events), result
    return (events_from_record(record) if record is not None else []), None


def _labels(traces: list[Trace], match: RankMatch | None) -> list[TraceLabels]:
    parts = match.per_trace if match is not None and match.per_trace else [match] * len(traces)
    return [TraceLabels(t.path.name, dict(p.kernel_args) if p else {}, dict(p.marks) if p else {})
            for t, p in zip(traces, parts)]


def build(rank: int, traces: list[Trace], record: dict | None, *, inputs: str,
          record_inputs: str | None, clock: Clock, host: str | None = None,
          problems: Iterable[str] = ()) -> RankArtifact:
    """Match one rank once and put it on ``clock``."""
    found = list(problems)
    events, match = _match(traces, record, rank, found)
    ops = [op for t in traces for op in gpu_ops(t)]
    stats = {"traces": len(traces), "comm_events": len(events)}
    if match is not None:
        bare = sum(NO_METADATA in u.reason for u in match.unmatched)
        stats["unmatched"] = len(match.unmatched) - bare      # uncertain: left unlabelled
        stats["no_metadata"] = bare
    host = host or (record or {}).get("host") or next((t.host for t in traces if t.host), None)
    own = RankArtifact(rank=rank, host=host, inputs=inputs, record_inputs=record_inputs,
                       clock=Clock(0, "own"), events=events, gpu_ops=ops,
                       pgs=_pg_table(record, traces, events), labels=_labels(traces, match),
                       problems=found, stats=stats, steps=step_ranges(traces))
    return own.aligned(clock)


# -- the file ----------------------------------------------------------------------------------

class ClockFile(TypedDict):
    """A ``Clock`` in a file (matched runs, comm tables)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    offset_ns: int
    source: str


class PgFile(TypedDict):
    """A ``PgInfo`` in a file (matched runs, comm tables)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    desc: str | None
    ranks: list[int] | str | None


def _key_from_wire(value: Any) -> InstanceKey:
    if not isinstance(value, list):
        raise ValueError(f"an instance key is a list, not {value!r}")
    try:
        try:
            return _known_key(tuple(value))
        except TypeError:               # a batch's pairs (lists): not hashable, not cached
            return InstanceKey.from_wire(value)
    except (ValueError, TypeError):
        raise ValueError(f"instance key {value!r} is malformed") from None


@functools.lru_cache(maxsize=1 << 16)
def _known_key(wire: tuple) -> InstanceKey:
    """Keys repeat across the ranks (and files) one process reads: each is parsed once."""
    return InstanceKey.from_wire(wire)


# An instance key in its compact form (``InstanceKey.wire``), as matched runs and comm tables
# hold it.
WireKey = Annotated[InstanceKey, PlainValidator(_key_from_wire, json_schema_input_type=list),
                    PlainSerializer(InstanceKey.wire)]
_Event = tuple[str, str, int, int, dict[str, Any], WireKey | None, Source, int | None, bool]
_IndexedArgs = list[tuple[int, dict[str, Any]]]


class _Gpu(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    names: list[str]
    cats: list[str]
    ops: list[tuple[int, int, int, int, int, bool]]    # stream, name, cat, start, end, graphed


class _Labels(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    trace: str
    kernel_args: _IndexedArgs
    marks: _IndexedArgs


class MatchedFile(TypedDict):
    """``matched_rank{R}.json`` as declared (the module's docstring shows it)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.matched"]
    version: Literal[1]
    rank: int
    host: str | None
    inputs: str
    record_inputs: str | None
    shard: str | None
    clock: ClockFile
    pgs: dict[str, PgFile]
    events: list[_Event]
    gpu: _Gpu
    labels: list[_Labels]
    problems: list[str]
    stats: dict[str, int]
    steps: NotRequired[list[tuple[int, int, int]]]     # n, start, end (absent: none known)


FILE = FileType(MatchedFile, "matched run")
SCHEMA, VERSION = FILE.schema, FILE.version


def to_file(art: RankArtifact) -> MatchedFile:
    """The declared file of ``art`` (GPU op names and categories interned)."""
    names: dict[str, int] = {}
    cats: dict[str, int] = {}
    ops = [(op.stream, names.setdefault(op.name, len(names)), cats.setdefault(op.cat, len(cats)),
            op.start_ns, op.end_ns, op.graphed) for op in art.gpu_ops]
    return MatchedFile(
        schema=SCHEMA, version=VERSION, rank=art.rank, host=art.host, inputs=art.inputs,
        record_inputs=art.record_inputs, shard=art.shard,
        clock=ClockFile(offset_ns=art.clock.offset_ns, source=art.clock.source),
        pgs={pg: PgFile(desc=i.desc, ranks=i.ranks) for pg, i in art.pgs.items()},
        events=[(e.pg, e.op, e.start_ns, e.end_ns, e.args, e.key, e.source, e.stream, e.graphed)
                for e in art.events],
        gpu=_Gpu(names=list(names), cats=list(cats), ops=ops),
        labels=[_Labels(trace=lab.trace, kernel_args=sorted(lab.kernel_args.items()),
                        marks=sorted(lab.marks.items())) for lab in art.labels],
        problems=art.problems, stats=art.stats, steps=[tuple(s) for s in art.steps])


def from_file(doc: MatchedFile) -> RankArtifact:
    """A checked file as a RankArtifact; the GPU ops' name and category indices are checked
    here (the one thing the declaration cannot say)."""
    rank, gpu = doc["rank"], doc["gpu"]
    names, cats = gpu["names"], gpu["cats"]
    if any(not (0 <= o[1] < len(names) and 0 <= o[2] < len(cats)) for o in gpu["ops"]):
        raise ValueError("gpu.ops: a name or category index is out of range")
    ops = [GpuOp(rank, stream, names[name], cats[cat], start, end, graphed)
           for stream, name, cat, start, end, graphed in gpu["ops"]]
    events = [CommEvent(rank, pg, op, start, end, args, key, source, stream, graphed)
              for pg, op, start, end, args, key, source, stream, graphed in doc["events"]]
    clock = doc["clock"]
    return RankArtifact(
        rank=rank, host=doc["host"], inputs=doc["inputs"], record_inputs=doc["record_inputs"],
        shard=doc["shard"], clock=Clock(clock["offset_ns"], clock["source"]),
        events=events, gpu_ops=ops,
        pgs={pg: PgInfo(v["desc"], v["ranks"]) for pg, v in doc["pgs"].items()},
        labels=[TraceLabels(lab["trace"], dict(lab["kernel_args"]), dict(lab["marks"]))
                for lab in doc["labels"]],
        problems=doc["problems"], stats=doc["stats"],
        steps=[Step(*s) for s in doc.get("steps", ())])


def to_json(art: RankArtifact) -> bytes:
    """The file's bytes, by orjson rather than the declaration's pydantic serializer, which
    each merge worker would first build (a twelfth of a second, with its imports, per worker
    and rank): the same file (tests/test_filetypes.py), ``WireKey``'s serializer included.
    What orjson refuses (an integer past 64 bits) the declaration's serializer writes."""
    doc = to_file(art)
    try:
        return orjson.dumps(doc, default=_plain, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return FILE.dump_json(doc, fallback=_plain)


def _plain(value: Any) -> Any:
    """Values a record may hold that JSON lacks (sets, numpy scalars): as lists and numbers;
    instance keys in their compact form (``WireKey``)."""
    if isinstance(value, InstanceKey):
        return value.wire()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def save(art: RankArtifact, path: str | os.PathLike[str]) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    write_atomic(path, to_json(art))
    return path


def load(path: str | os.PathLike[str]) -> RankArtifact:
    """Read a matched run; anything malformed is one ``SourceError`` naming the file and key."""
    doc = FILE.load(path)
    try:
        return from_file(doc)
    except ValueError as exc:
        raise SourceError(str(path), f"not a usable matched run: {exc}") from None


def load_fresh(path: Path, inputs: str, record_inputs: str | None, has_traces: bool,
               problems: list[str]) -> RankArtifact | None:
    """The saved matched run if it was built from these inputs; a bad file is a problem."""
    if not path.is_file():
        return None
    try:
        art = load(path)
    except SourceError as exc:
        problems.append(f"{exc}; rebuilt from the rank's inputs")
        return None
    return art if art.fresh_for(inputs, record_inputs, has_traces) else None
