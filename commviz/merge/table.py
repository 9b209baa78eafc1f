"""One rank's comm table, ``RUN_DIR/comm_rank{R}.json``: what the cross-rank review needs of it.

A rank's matched run (``matched_rank{R}.json``) grows with its trace: it holds every GPU op and
each collective's full metadata. The overview of a large job needs much less per rank: each
collective instance (group, op, instance key, start and end on the merged clock, bytes, nccl-tests
type, whether its span is a launch only or the call failed), the rank's groups and its problems.
The table is that projection, made from the matched run on the rank's own node, so only tables
travel to rank 0 for the overview; its size grows with the rank's collectives, never with its
trace. It is derived data: the matched run stays the source, and a table whose ``inputs`` and
clock no longer match the matched run beside it is rebuilt from it. Declared once
(``TableFile``, a ``commviz.filetype.FileType``); schema, version ``VERSION``::

    {"schema": "commviz.comm", "version": 4, "rank": int, "host": str | null,
     "inputs": str, "clock": {"offset_ns": int, "source": str},
     "pgs": {pg: {"desc": str | null, "ranks": [int] | str | null}},
     "problems": [str],
     "steps": [[n, start_ns, end_ns]],      # the rank's ProfilerStep#N ranges, by number
     "units": {origin: unit},               # where an origin's unit is not the origin itself
     "rows": [[pg, op, key, start_ns, end_ns, bytes | null, ctype, flags, origin]]}  # by start

``origin``: the call's ``commviz.origin`` (null: none recorded); ``units``: the unit each origin
serves (``metadata.origin_unit``: "FSDP layers.0" for its all-gathers and reduce-scatters),
listed once per origin, not per row. ``steps`` say which step each row belongs to, so two runs
compare per step (``commviz diff``); empty where the rank's traces held none. Version 1 had no
origin, version 2 no ``PIPELINE`` flag, version 3 no steps or units: such a table is rebuilt
from the matched run beside it, like any stale one.

``ranks``: a group of more than ``LIST_RANKS_MAX`` ranks is written as runs
(``metadata.ranks_text``: ``"0-16383"``, ``"5-16381 step 8"``), which ``metadata.group_ranks``
reads back: every rank's table names its groups, and a 16,384-rank world listed in full made
each table 113 kB (6x its rows) and the overview's read 3x slower.

``flags``: ``LAUNCH_ONLY`` | ``FAILED`` | ``PIPELINE``. Rows without an instance key are left
out (nothing across ranks can be said about them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import IntFlag
from pathlib import Path
from typing import Iterator, Literal, NamedTuple

from typing_extensions import TypedDict

from commviz import metadata as md
from commviz.errors import SourceError
from commviz.filetype import STRICT, FileType
from commviz.match import artifact
from commviz.match.artifact import Clock, ClockFile, PgFile, PgInfo, RankArtifact, WireKey
from commviz.match.model import InstanceKey
from commviz.merge import bandwidth as bw
from commviz.merge.instances import is_launch_only, is_pipeline_transfer, kernel_groups
from commviz.record.store import write_atomic
from commviz.trace.steps import Step

TABLE_GLOB = "comm_rank*.json"
LIST_RANKS_MAX = 16             # a larger group's ranks are written as runs


class Flag(IntFlag):
    LAUNCH_ONLY = 1      # the span covers the launch only: no comm time, wait or straggler
    FAILED = 2           # the call raised on this rank (md.ERROR): it moved no data
    PIPELINE = 4         # a pipeline schedule's transfer: its waits are bubbles, no straggler


_FLAGS = {n: Flag(n) for n in range(8)}      # Flag(n) is slow per row


class Row(NamedTuple):
    """One collective instance as one rank saw it."""

    pg: str
    op: str
    key: InstanceKey
    start_ns: int
    end_ns: int
    size_bytes: int | None
    ctype: str
    flags: Flag
    origin: str | None = None       # md.ORIGIN: the code or framework unit it comes from


@dataclass(slots=True)
class CommTable:
    rank: int
    host: str | None
    inputs: str                     # the matched run's inputs fingerprint
    clock: Clock
    pgs: dict[str, PgInfo]
    problems: list[str]
    rows: list[Row]
    steps: list[Step] = field(default_factory=list)        # ProfilerStep#N, merged clock
    units: dict[str, str] = field(default_factory=dict)     # origin -> unit, where they differ


def table_name(rank: int) -> str:
    return f"comm_rank{rank}.json"


def table_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / table_name(rank)


def from_artifact(art: RankArtifact) -> CommTable:
    """The rank's table, on the matched run's clock."""
    gpu = kernel_groups(art.events)
    rows = []
    units: dict[str, str] = {}
    for ev in art.events:
        if ev.key is None:
            continue
        origin = ev.args.get(md.ORIGIN)
        if origin is not None and origin not in units:
            units[origin] = md.origin_unit(ev.args) or origin
        flags = Flag(0)
        if is_launch_only(ev, gpu):
            flags |= Flag.LAUNCH_ONLY
        if md.ERROR in ev.args:
            flags |= Flag.FAILED
        if ev.key.kind.p2p and is_pipeline_transfer(ev.args):
            flags |= Flag.PIPELINE
        rows.append(Row(ev.pg, ev.op, ev.key, ev.start_ns, max(ev.end_ns, ev.start_ns),
                        bw.size_bytes(ev.args), bw.collective_type(ev.args), flags, origin))
    rows.sort(key=lambda r: (r.start_ns, r.end_ns))
    return CommTable(rank=art.rank, host=art.host, inputs=art.inputs, clock=art.clock,
                     pgs=dict(art.pgs), problems=list(art.problems), rows=rows,
                     steps=list(art.steps), units={o: u for o, u in units.items() if o != u})


Flags = Literal[0, 1, 2, 3, 4, 5, 6, 7]
# pg, op, key, start, end, size, collective type, flags, origin
RowFile = tuple[str, str, WireKey, int, int, int | None, str, Flags, str | None]


class TableFile(TypedDict):
    """``comm_rank{R}.json`` as declared (the module's docstring shows it)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.comm"]
    version: Literal[4]     # 2: rows gained the origin; 3: the pipeline flag; 4: steps, units
    rank: int
    host: str | None
    inputs: str
    clock: ClockFile
    pgs: dict[str, PgFile]
    problems: list[str]
    steps: list[tuple[int, int, int]]
    units: dict[str, str]
    rows: list[RowFile]


FILE = FileType(TableFile, "comm table")
SCHEMA, VERSION = FILE.schema, FILE.version


def to_json(table: CommTable) -> bytes:
    return FILE.dump_json(TableFile(
        schema=SCHEMA, version=VERSION, rank=table.rank, host=table.host, inputs=table.inputs,
        clock=ClockFile(offset_ns=table.clock.offset_ns, source=table.clock.source),
        pgs={pg: PgFile(desc=i.desc, ranks=_ranks_file(i.ranks)) for pg, i in table.pgs.items()},
        problems=table.problems, steps=[tuple(s) for s in table.steps], units=table.units,
        rows=[(*r[:7], int(r.flags), r.origin) for r in table.rows]))


def _ranks_file(ranks: list[int] | str | None) -> list[int] | str | None:
    return md.ranks_text(ranks) if isinstance(ranks, list) and len(ranks) > LIST_RANKS_MAX else ranks


def save(table: CommTable, path: Path) -> Path:
    """Write atomically (a gather or overview never reads half a file)."""
    write_atomic(path, to_json(table))
    return path


def load(path: Path, named: bool = True) -> CommTable:
    """Read a table; anything malformed is one ``SourceError`` naming the file and key.
    ``named=False``: the rows stay the file's tuples, a ``Row``'s fields by place with the
    flags an int (a reader that folds 131,072 tables by place spends a third of its time
    naming them)."""
    doc = FILE.load(path)
    clock = doc["clock"]
    rows = doc["rows"]
    return CommTable(
        rank=doc["rank"], host=doc["host"], inputs=doc["inputs"],
        clock=Clock(clock["offset_ns"], clock["source"]),
        pgs={pg: PgInfo(v["desc"], v["ranks"]) for pg, v in doc["pgs"].items()},
        problems=doc["problems"], steps=[Step(*s) for s in doc["steps"]], units=doc["units"],
        rows=[Row(pg, op, key, start, end, size, ctype, _FLAGS[flags], origin)
              for pg, op, key, start, end, size, ctype, flags, origin in rows] if named
        else rows)  # type: ignore[arg-type]


def write_table(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Rank R's table from its matched run (on its node, right after ``write_shard``)."""
    art = artifact.load(artifact.matched_path(run_dir, rank))
    return save(from_artifact(art), table_path(run_dir, rank))


def _rank_of(name: str, prefix: str) -> int | None:
    stem = name[len(prefix):].split(".", 1)[0]
    return int(stem) if name.startswith(prefix) and stem.isdigit() else None


def table_ranks(run_dir: Path) -> list[int]:
    """Ranks with a comm table or a matched run in the run dir (a table can be made from it)."""
    ranks = {_rank_of(p.name, "comm_rank") for p in run_dir.glob(TABLE_GLOB)}
    ranks |= {_rank_of(p.name, "matched_rank") for p in run_dir.glob(artifact.MATCHED_GLOB)}
    return sorted(r for r in ranks if r is not None)


def rank_table(run_dir: Path, rank: int, problems: list[str], named: bool = True
               ) -> CommTable | None:
    """Rank R's table: the saved one, unless the matched run beside it is newer (then rebuilt
    from it and saved when the run dir is writable). A rank with neither is a problem.
    ``named``: as ``load``'s."""
    path, matched = table_path(run_dir, rank), artifact.matched_path(run_dir, rank)
    table, unreadable = None, []
    if path.is_file():
        try:
            table = load(path, named)
        except SourceError as exc:          # a problem only if the matched run cannot stand in
            unreadable.append(str(exc))
    if matched.is_file() and (table is None or matched.stat().st_mtime > path.stat().st_mtime):
        try:
            art = artifact.load(matched)
        except SourceError as exc:
            problems += [*unreadable, str(exc)]
            return table
        if table is None or (table.inputs, table.clock) != (art.inputs, art.clock):
            table = from_artifact(art)
            if os.access(run_dir, os.W_OK):
                save(table, path)
    if table is None:
        problems += unreadable or [f"rank {rank}: no comm table ({path.name}) and no matched run "
                        f"({matched.name}) in {run_dir}"]
    return table


def iter_tables(run_dir: Path, ranks: list[int], problems: list[str], named: bool = True
                ) -> Iterator[CommTable]:
    """One rank's table at a time (the overview never holds every rank's rows); ``named``: as
    ``load``'s."""
    for rank in ranks:
        table = rank_table(run_dir, rank, problems, named)
        if table is not None:
            yield table
