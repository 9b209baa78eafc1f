"""``commviz overview RUN_DIR``: every rank's collectives in one small trace, from comm tables only.

The merged trace of a 1,024-rank job is far too large for one Perfetto tab; its comm lanes are
not. The overview holds, per rank, one process with only its comm lanes (the same lane names,
order and cross-rank flow ids as the merged trace, so the two read alike), and above them the
per-group summary and bus-bandwidth tracks and a "stragglers" track naming the late rank of
every instance whose skew stands out. It reads the ranks' comm tables (``merge.table``), never
a trace, shard or matched run's GPU ops, and streams them twice, one rank at a time:

1. fold each row into its instance (first/last start, last end, late rank, ranks seen, bytes):
   memory grows with the number of instances, not with ranks × collectives;
2. write each rank's process, its slices carrying their wait and whether this rank was late.

A person then picks the ranks that matter (``commviz merge RUN_DIR --ranks ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from commviz import metadata as md
from commviz.errors import SourceError
from commviz.match.artifact import PgInfo
from commviz.match.model import InstanceKey, KeyKind
from commviz.merge.core import progress_bar
from commviz.merge.cross import write_summary
from commviz.merge.piece import (LANE_CAT, ORDER_LANE, PID_BASE, cross_flow_id, instance_text,
                                 lane_name, lane_order)
from commviz.merge import bandwidth as bw
from commviz.merge.instances import (Span, bandwidth_ranks, expected_ranks, instance_label,
                                     straggler_threshold)
from commviz.merge.summary import SummaryTracks, tracks_for
from commviz.merge.table import CommTable, Flag, iter_tables, table_ranks
from commviz.write.pftrace import Piece, emit_slices, flow_field, split, track_descriptor

OVERVIEW_NAME = "overview.pftrace"
STRAGGLERS_TRACK = "stragglers · late rank per instance"


@dataclass(slots=True)
class Seen(Span):
    """One collective instance, folded one rank at a time (what a summary slice needs)."""

    key: InstanceKey
    pg: str
    op: str
    ctype: str
    first_start_ns: int
    last_start_ns: int
    last_end_ns: int
    late_rank: int
    count: int = 0                  # ranks that hold it
    launch_only: bool = False
    failed: bool = False
    size_bytes: int | None = None
    expected: int = 0               # ranks that should hold it
    bandwidth: bw.Bandwidth | None = None
    straggler: int | None = None

    @property
    def label(self) -> str:
        return instance_label(self.key, self.op, None)


@dataclass
class Fold:
    """Pass 1: every instance of the run, and what is known of each rank."""

    instances: dict[InstanceKey, Seen] = field(default_factory=dict)
    pgs: dict[str, PgInfo] = field(default_factory=dict)
    hosts: dict[int, str | None] = field(default_factory=dict)
    rows: int = 0

    def add(self, table: CommTable) -> None:
        self.hosts[table.rank] = table.host
        for pg, info in table.pgs.items():
            self.pgs.setdefault(pg, info)
        rank = table.rank
        for row in table.rows:
            self.rows += 1
            seen = self.instances.get(row.key)
            if seen is None:
                seen = self.instances[row.key] = Seen(
                    row.key, row.pg, row.op, row.ctype, row.start_ns, row.start_ns,
                    row.end_ns, rank)
            seen.count += 1
            seen.first_start_ns = min(seen.first_start_ns, row.start_ns)
            if (row.start_ns, rank) > (seen.last_start_ns, seen.late_rank):
                seen.last_start_ns, seen.late_rank = row.start_ns, rank
            seen.last_end_ns = max(seen.last_end_ns, row.end_ns)
            seen.launch_only |= bool(row.flags & Flag.LAUNCH_ONLY)
            seen.failed |= bool(row.flags & Flag.FAILED)
            if row.size_bytes is not None:
                seen.size_bytes = max(seen.size_bytes or 0, row.size_bytes)

    def finish(self) -> list[Seen]:
        """Bandwidth and stragglers, by the review's rules (``merge.instances``)."""
        by_pg: dict[str, list[Seen]] = defaultdict(list)
        for seen in self.instances.values():
            info = self.pgs.get(seen.pg)
            ranks = expected_ranks(seen.key, {md.PG_RANKS: info.ranks if info else None})
            seen.expected = len(ranks) or seen.count
            seen.bandwidth = bw.bandwidth(seen.ctype, seen.size_bytes, seen.comm_ns,
                                          bandwidth_ranks(seen.key, seen.expected))
            if seen.count > 1 and not seen.launch_only:
                by_pg[seen.pg].append(seen)
        for insts in by_pg.values():
            threshold = straggler_threshold([i.skew_ns for i in insts])
            for inst in insts:
                inst.straggler = inst.late_rank if inst.skew_ns >= threshold else None
        return sorted(self.instances.values(), key=lambda i: (i.first_start_ns, i.pg))


def slice_args(seen: Seen) -> dict[str, Any]:
    """A summary slice's args: counts, not rank lists (a world-size list per slice is large)."""
    args: dict[str, Any] = {
        "commviz.op": seen.op, "commviz.skew_ns": seen.skew_ns,
        "commviz.late_rank": seen.late_rank, "commviz.ranks_seen": seen.count,
        "commviz.ranks_expected": seen.expected, "commviz.instance": instance_text(seen.key),
    }
    if seen.straggler is not None:
        args["commviz.straggler"] = seen.straggler
    if seen.comm_ns is not None:
        args["commviz.comm_ns"] = seen.comm_ns
    if seen.size_bytes is not None:
        args["commviz.size_bytes"] = seen.size_bytes
    if seen.bandwidth is not None:
        args["commviz.busbw_GBps"] = round(seen.bandwidth.busbw_gbps, 3)
    return args


def summary_of(instances: list[Seen]) -> SummaryTracks:
    return tracks_for(instances, slice_args)


@dataclass
class OverviewResult:
    out: Path
    ranks: int
    instances: int
    rows: int
    stragglers: dict[int, int]          # rank -> instances it straggled
    problems: list[str]
    bytes: int
    seconds: float


def _write_cross(f: BinaryIO, instances: list[Seen], pgs: dict[str, PgInfo]) -> None:
    """Root, the summary tracks and the stragglers track (piece 0, as in the merged trace)."""
    piece = Piece(f, 0)
    piece.descriptor(track_descriptor(0, explicit_children=True, explicit_processes=True))
    group = piece.new_uuid()
    piece.descriptor(track_descriptor(group, name="collectives · all ranks",
                                      explicit_children=True, order_rank=-1))
    by_pg: dict[str, list[Seen]] = defaultdict(list)
    for seen in instances:
        by_pg[seen.pg].append(seen)
    stats = {"summary_slices": 0, "bandwidth_samples": 0}
    for pg in sorted(by_pg):   # one group's slices at a time: memory of a group, not the run
        write_summary(piece, group, summary_of(by_pg.pop(pg)), pgs, stats)
        piece.maybe_flush()
    late = [s for s in instances if s.straggler is not None]
    if late:
        events = [{"name": f"rank {s.straggler} late · {lane_name(s.pg, pgs.get(s.pg))}",
                   "cat": "commviz.straggler",
                   "args": {"commviz.straggler": s.straggler, "commviz.skew_ns": s.skew_ns,
                            "commviz.instance": instance_text(s.key), "commviz.op": s.op}}
                  for s in late]
        items = sorted((s.first_start_ns, -s.last_start_ns, i) for i, s in enumerate(late))
        for back in split(items):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=STRAGGLERS_TRACK, parent=group,
                                              order_rank=-1, merge_key="stragglers"))
            seq = piece.sequence(uuid)
            piece.buf += seq.start(back[0][0])
            emit_slices(seq, piece.buf, back, events)
            piece.maybe_flush()
    piece.flush()


def _write_rank(f: BinaryIO, table: CommTable, fold: Fold) -> None:
    """One rank's process: its comm lanes, each slice with its wait and lateness."""
    rank = table.rank
    piece = Piece(f, rank + 1)
    proc = piece.new_uuid()
    name = f"rank {rank} · {table.host or '?'}"
    piece.descriptor(track_descriptor(proc, name=name, pid=PID_BASE + rank, process_name=name,
                                      explicit_children=True, order_rank=rank))
    events: list[dict] = []
    flows: dict[int, bytes] = {}
    items: dict[str, list] = defaultdict(list)
    for row in table.rows:
        seen = fold.instances[row.key]
        args: dict[str, Any] = {md.SEQ: row.key.seq} if row.key.kind is KeyKind.COLLECTIVE else {}
        args[md.PG_NAME] = row.pg
        args["commviz.instance"] = instance_text(row.key)
        if row.size_bytes is not None:
            args["commviz.size_bytes"] = row.size_bytes
        if not seen.launch_only:
            args["commviz.wait_ns"] = max(0, min(seen.last_start_ns, row.end_ns) - row.start_ns)
        if seen.late_rank == rank and seen.count > 1:
            args["commviz.late"] = True
        if seen.straggler == rank:
            args["commviz.straggler"] = rank
        if seen.count > 1:                      # an instance on one rank has no other end
            flows[len(events)] = flow_field(cross_flow_id(row.key))
        items[row.pg].append((row.start_ns, -row.end_ns, len(events)))
        events.append({"name": row.op, "cat": LANE_CAT, "args": args})
    for pg in sorted(items, key=lambda g: (lane_order(g), g)):
        for back in split(sorted(items[pg])):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=lane_name(pg, table.pgs.get(pg)),
                                              parent=proc, order_rank=ORDER_LANE + lane_order(pg),
                                              merge_key=f"lane {pg}"))
            seq = piece.sequence(uuid)
            piece.buf += seq.start(back[0][0])
            emit_slices(seq, piece.buf, back, events, None, flows)
            piece.maybe_flush()
    piece.flush()


def write_overview(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                   *, progress: bool = True) -> OverviewResult:
    """Write the overview of every rank with a comm table (or a matched run to make one)."""
    started = time.perf_counter()
    run = Path(run_dir)
    if not run.is_dir():
        raise SourceError(str(run), "not a directory")
    ranks = table_ranks(run)
    if not ranks:
        raise SourceError(str(run), "no comm tables (comm_rank*.json) and no matched runs "
                                    "(matched_rank*.json): run `commviz merge` or a launch first")
    target = Path(out) if out is not None else run / OVERVIEW_NAME
    problems: list[str] = []
    fold = Fold()
    for table in _tables(run, ranks, problems, progress, "overview: reading tables"):
        fold.add(table)
        problems.extend(f"rank {table.rank}: {p}" for p in table.problems)
    instances = fold.finish()
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as f:
            _write_cross(f, instances, fold.pgs)
            for table in _tables(run, sorted(fold.hosts), [], progress, "overview: writing"):
                _write_rank(f, table, fold)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    stragglers: dict[int, int] = defaultdict(int)
    for seen in instances:
        if seen.straggler is not None:
            stragglers[seen.straggler] += 1
    return OverviewResult(out=target, ranks=len(fold.hosts), instances=len(instances),
                          rows=fold.rows, stragglers=dict(stragglers), problems=problems,
                          bytes=target.stat().st_size,
                          seconds=round(time.perf_counter() - started, 3))


def _tables(run: Path, ranks: list[int], problems: list[str], progress: bool, label: str
            ) -> Iterator[CommTable]:
    bar = progress_bar(label, len(ranks)) if progress else None
    try:
        for table in iter_tables(run, ranks, problems):
            yield table
            if bar:
                bar.advance()
    finally:
        if bar:
            bar.close()


# -- the command -------------------------------------------------------------------------------

def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "overview", help="one small trace of every rank's collectives, from the comm tables",
        description="Every rank's comm lanes, the per-group summary and bandwidth tracks and "
                    "the stragglers, from the ranks' comm tables only (no trace is read): a "
                    "1,024-rank job in one Perfetto tab. Then merge the ranks that matter: "
                    "commviz merge RUN_DIR --ranks ...")
    p.add_argument("run_dir", help="run dir with comm_rank*.json (or matched_rank*.json)")
    p.add_argument("-o", "--out", help=f"output file (default RUN_DIR/{OVERVIEW_NAME})")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    result = write_overview(args.run_dir, args.out, progress=True)
    for problem in result.problems:
        print(f"commviz overview: problem: {problem}", file=sys.stderr)
    print(f"overview of {result.ranks} ranks: {result.instances} collective instances, "
          f"{result.rows} rank slices, in {result.seconds} s")
    if result.stragglers:
        worst = sorted(result.stragglers.items(), key=lambda kv: (-kv[1], kv[0]))[:8]
        print("stragglers (rank: instances): " + ", ".join(f"{r}: {n}" for r, n in worst))
    print(f"wrote {result.out} ({result.bytes} bytes)")
    return 0
