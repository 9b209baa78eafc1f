"""``commviz overview RUN_DIR``: every rank's collectives in one small trace, from comm tables only.

The merged trace of a 1,024-rank job is far too large for one Perfetto tab; its comm lanes are
not. The overview holds, per rank, one process with only its comm lanes (the same lane names,
order and cross-rank flow ids as the merged trace, so the two read alike), and above them the
per-group summary and bus-bandwidth tracks and a "stragglers" track naming the late rank of
every instance whose skew stands out. It reads the ranks' comm tables (``merge.table``), never
a trace, shard or matched run's GPU ops, and streams them twice, one rank at a time:

1. fold each row into its instance (first/last start, last end, late rank, ranks seen, bytes),
   kept as columns of machine ints (``Fold``, ~90 bytes an instance, no object per instance):
   memory grows with the number of instances only, about 1.1 MB for 12.5k (1,024 ranks);
2. write the summary one group at a time, then each rank's process, its slices carrying
   their wait and whether this rank was late.

A person then picks the ranks that matter (``commviz merge RUN_DIR --ranks ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from commviz import metadata as md
from commviz.errors import SourceError
from commviz.match.artifact import PgInfo
from commviz.match.model import InstanceKey, KeyKind
from commviz.merge.core import progress_bar
from commviz.merge.cross import write_summary
from commviz.merge.piece import (LANE_CAT, LANE_KEY, ORDER_LANE, PID_BASE, cross_flow_id,
                                 instance_text, lane_name, lane_order)
from commviz.merge import bandwidth as bw
from commviz.merge.instances import (Span, bandwidth_ranks, expected_ranks, instance_label,
                                     straggler_thresholds)
from commviz.merge.summary import SummaryTracks, comm_args, tracks_for
from commviz.merge.table import CommTable, Flag, Row, iter_tables, table_ranks
from commviz.write.pftrace import Piece, emit_slices, flow_field, split, track_descriptor

OVERVIEW_NAME = "overview.pftrace"
STRAGGLERS_TRACK = "stragglers · late rank per instance"


@dataclass(slots=True)
class Seen(Span):
    """One collective instance across the ranks, as a summary slice needs it (made from the
    fold's columns one group at a time, never for the whole run at once)."""

    key: InstanceKey
    pg: str
    op: str
    ctype: str
    first_start_ns: int
    last_start_ns: int
    last_end_ns: int
    late_rank: int
    count: int                      # ranks that hold it
    launch_only: bool
    failed: bool
    size_bytes: int | None
    expected: int                   # ranks that should hold it
    bandwidth: bw.Bandwidth | None
    straggler: int | None
    origin: str | None = None       # md.ORIGIN as its first rank recorded it

    @property
    def label(self) -> str:
        return instance_label(self.key, self.op, None)


class Names:
    """Strings as small ints: a run has few distinct groups, ops and collective types."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._ids: dict[str, int] = {}

    def id(self, name: str) -> int:
        got = self._ids.get(name)
        if got is None:
            got = self._ids[name] = len(self.names)
            self.names.append(name)
        return got


_PLAIN = (None, None, (), None)      # an InstanceKey's src, dst, pairs, replay when unused


@dataclass(slots=True)
class _Seqs:
    """One group's collectives by sequence number from ``base``: each one's index, or -1."""

    base: int
    slots: array


class KeyIndex:
    """Instance key -> index 0, 1, ...: about 16 bytes a collective instance where a dict of
    key objects costs about 200. A group numbers its collectives densely, so it keeps an array
    from sequence number to index; other keys (p2p, batches, annotations, graph replays, a
    sequence number far from its group's others) are few and keep a dict."""

    MAX_GAP = 1 << 16       # a sequence number this far outside its group's array: the dict

    def __init__(self, names: Names) -> None:
        self._names = names
        self._groups: dict[str, _Seqs] = {}
        self._pg = array("i")           # per index: the key's group (dense keys)
        self._seq = array("q")          # per index: the key's sequence number (dense keys)
        self._other: dict[InstanceKey, int] = {}
        self._other_keys: dict[int, InstanceKey] = {}

    def __len__(self) -> int:
        return len(self._seq)

    @staticmethod
    def _dense(key: InstanceKey) -> bool:
        """A group's collective (its sequence number and group are the whole key)."""
        return (key.kind is KeyKind.COLLECTIVE and key[3:] == _PLAIN and type(key.seq) is int
                and abs(key.seq) < 1 << 62)

    def find(self, key: InstanceKey) -> int | None:
        # ``_dense`` inlined (one call per row, twice per run); its range check is ``_place``'s
        if key.kind is KeyKind.COLLECTIVE and key[3:] == _PLAIN and type(key.seq) is int:
            group = self._groups.get(key.pg)
            if group is not None:
                off = key.seq - group.base
                if 0 <= off < len(group.slots) and group.slots[off] >= 0:
                    return group.slots[off]
        return self._other.get(key)

    def add(self, key: InstanceKey) -> int:
        """The index of a key ``find`` does not know."""
        i = len(self)
        if self._dense(key) and self._place(key.pg, key.seq, i):
            self._pg.append(self._names.id(key.pg))
            self._seq.append(key.seq)
        else:
            self._other[key] = i
            self._other_keys[i] = key
            self._pg.append(-1)
            self._seq.append(0)
        return i

    def _place(self, pg: str, seq: int, i: int) -> bool:
        group = self._groups.get(pg)
        if group is None:
            self._groups[pg] = _Seqs(seq, array("i", [i]))
            return True
        off = seq - group.base
        if off < 0:
            if -off > self.MAX_GAP:
                return False
            group.slots[0:0] = array("i", [-1]) * -off
            group.base, off = seq, 0
        elif off >= len(group.slots):
            if off - len(group.slots) > self.MAX_GAP:
                return False
            group.slots.extend(array("i", [-1]) * (off + 1 - len(group.slots)))
        group.slots[off] = i
        return True

    def key(self, i: int) -> InstanceKey:
        other = self._other_keys.get(i)
        if other is not None:
            return other
        return InstanceKey(KeyKind.COLLECTIVE, self._names.names[self._pg[i]], self._seq[i])


_BOTH = Flag.LAUNCH_ONLY | Flag.FAILED


class Fold:
    """Pass 1: every instance of the run as columns indexed by its key's index (``KeyIndex``),
    about 90 bytes an instance with the arrays' slack: 1.1 MB at 1,024 ranks of a TP × DP job
    (12.5k instances), where an object per instance held about 850 bytes (its key, its strings
    and ints from the JSON, its bandwidth)."""

    def __init__(self) -> None:
        self.names = Names()
        self.keys = KeyIndex(self.names)
        self.pg, self.op, self.ctype = array("i"), array("i"), array("i")   # ``names`` ids
        self.origin = array("i")            # ``names`` id of md.ORIGIN; -1: none
        self.first_start, self.last_start, self.last_end = array("q"), array("q"), array("q")
        self.late_rank, self.count = array("i"), array("i")
        self.flags = array("B")             # ``Flag`` bits of any rank
        self.size = array("q")              # the largest bytes of any rank; -1: none known
        self.straggler = array("i")         # by ``finish``; -1: none
        self.by_pg: dict[str, array] = {}   # by ``finish``: each group's indices by first start
        self.pgs: dict[str, PgInfo] = {}
        self.ranks: set[int] = set()
        self.rows = 0

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, table: CommTable) -> None:
        self.ranks.add(table.rank)
        for pg, info in table.pgs.items():
            self.pgs.setdefault(pg, info)
        rank = table.rank
        for row in table.rows:
            self.rows += 1
            start, end = row.start_ns, row.end_ns
            i = self.keys.find(row.key)
            if i is None:
                i = self._new(row, rank)
            self.count[i] += 1
            if start < self.first_start[i]:
                self.first_start[i] = start
            if (start, rank) > (self.last_start[i], self.late_rank[i]):
                self.last_start[i], self.late_rank[i] = start, rank
            if end > self.last_end[i]:
                self.last_end[i] = end
            self.flags[i] |= int(row.flags & _BOTH)
            if row.size_bytes is not None:
                self.size[i] = max(self.size[i], row.size_bytes, 0)

    def _new(self, row: Row, rank: int) -> int:
        """A new instance's columns, as its first rank saw it (``add`` then counts that rank)."""
        i = self.keys.add(row.key)
        name = self.names.id
        for column, value in ((self.pg, name(row.pg)), (self.op, name(row.op)),
                              (self.ctype, name(row.ctype)), (self.first_start, row.start_ns),
                              (self.last_start, row.start_ns), (self.last_end, row.end_ns),
                              (self.late_rank, rank), (self.count, 0), (self.flags, 0),
                              (self.size, -1), (self.straggler, -1),
                              (self.origin, -1 if row.origin is None else name(row.origin))):
            column.append(value)
        return i

    def skew(self, i: int) -> int:
        return self.last_start[i] - self.first_start[i]

    def finish(self) -> None:
        """Each group's instances by first start, and the stragglers by the review's rule
        (``merge.instances``): a late rank whose skew stands out in its group."""
        members: dict[int, array] = defaultdict(lambda: array("i"))
        for i, pg in enumerate(self.pg):
            members[pg].append(i)
        start = self.first_start.__getitem__
        for pg_id, idx in members.items():
            order = array("i", sorted(idx, key=start))    # stable: ties in fold order
            self.by_pg[self.names.names[pg_id]] = order
            timed = [i for i in order
                     if self.count[i] > 1 and not self.flags[i] & Flag.LAUNCH_ONLY]
            if timed:
                skews = [self.skew(i) for i in timed]
                for i, skew, threshold in zip(timed, skews, straggler_thresholds(skews)):
                    if skew >= threshold:
                        self.straggler[i] = self.late_rank[i]

    def seen(self, i: int) -> Seen:
        """Instance ``i`` with its expected ranks and bandwidth, for its summary slice."""
        key, pg = self.keys.key(i), self.names.names[self.pg[i]]
        info = self.pgs.get(pg)
        count = self.count[i]
        seen = Seen(key, pg, self.names.names[self.op[i]], self.names.names[self.ctype[i]],
                    self.first_start[i], self.last_start[i], self.last_end[i],
                    self.late_rank[i], count, bool(self.flags[i] & Flag.LAUNCH_ONLY),
                    bool(self.flags[i] & Flag.FAILED),
                    self.size[i] if self.size[i] >= 0 else None,
                    len(expected_ranks(key, {md.PG_RANKS: info.ranks if info else None}))
                    or count, None, self.straggler[i] if self.straggler[i] >= 0 else None,
                    self.names.names[self.origin[i]] if self.origin[i] >= 0 else None)
        seen.bandwidth = bw.bandwidth(seen.ctype, seen.size_bytes, seen.comm_ns,
                                      bandwidth_ranks(key, seen.expected))
        return seen


def slice_args(seen: Seen) -> dict[str, Any]:
    """A summary slice's args: counts, not rank lists (a world-size list per slice is large)."""
    args: dict[str, Any] = {
        "commviz.op": seen.op, "commviz.skew_ns": seen.skew_ns,
        "commviz.late_rank": seen.late_rank, "commviz.ranks_seen": seen.count,
        "commviz.ranks_expected": seen.expected, "commviz.instance": instance_text(seen.key),
    }
    if seen.straggler is not None:
        args["commviz.straggler"] = seen.straggler
    if seen.origin is not None:
        args[md.ORIGIN] = seen.origin
    comm_args(args, seen, algbw=False)
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


def _write_cross(f: BinaryIO, fold: Fold) -> None:
    """Root, the summary tracks and the stragglers track (piece 0, as in the merged trace)."""
    pgs = fold.pgs
    piece = Piece(f, 0)
    piece.descriptor(track_descriptor(0, explicit_children=True, explicit_processes=True))
    group = piece.new_uuid()
    piece.descriptor(track_descriptor(group, name="collectives · all ranks",
                                      explicit_children=True, order_rank=-1))
    stats = {"summary_slices": 0, "bandwidth_samples": 0}
    for pg in sorted(fold.by_pg):   # one group's slices at a time: memory of a group, not the run
        write_summary(piece, group, summary_of([fold.seen(i) for i in fold.by_pg[pg]]), pgs,
                      stats)
        piece.flush()       # not at 4 MiB (FLUSH_BYTES): the run's summary would fill that
    late = [fold.seen(i) for i in range(len(fold)) if fold.straggler[i] >= 0]
    late.sort(key=lambda s: (s.first_start_ns, s.pg))
    if late:
        events = [{"name": f"rank {s.straggler} late · {lane_name(s.pg, pgs.get(s.pg))}",
                   "cat": "commviz.straggler",
                   "args": {"commviz.straggler": s.straggler, "commviz.skew_ns": s.skew_ns,
                            "commviz.instance": instance_text(s.key), "commviz.op": s.op,
                            **({md.ORIGIN: s.origin} if s.origin is not None else {})}}
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
        i = fold.keys.find(row.key)
        if i is None:
            raise SourceError(f"rank {rank}", "its comm table changed while the overview read it")
        count = fold.count[i]
        args: dict[str, Any] = {md.SEQ: row.key.seq} if row.key.kind is KeyKind.COLLECTIVE else {}
        args[md.PG_NAME] = row.pg
        args["commviz.instance"] = instance_text(row.key)
        if row.origin is not None:
            args[md.ORIGIN] = row.origin
        if row.size_bytes is not None:
            args["commviz.size_bytes"] = row.size_bytes
        if not fold.flags[i] & Flag.LAUNCH_ONLY:
            args["commviz.wait_ns"] = max(0, min(fold.last_start[i], row.end_ns) - row.start_ns)
        if fold.late_rank[i] == rank and count > 1:
            args["commviz.late"] = True
        if fold.straggler[i] == rank:
            args["commviz.straggler"] = rank
        if count > 1:                      # an instance on one rank has no other end
            flows[len(events)] = flow_field(cross_flow_id(row.key))
        items[row.pg].append((row.start_ns, -row.end_ns, len(events)))
        events.append({"name": row.op, "cat": LANE_CAT, "args": args})
    for pg in sorted(items, key=lambda g: (lane_order(g), g)):
        for back in split(sorted(items[pg])):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=lane_name(pg, table.pgs.get(pg)),
                                              parent=proc, order_rank=ORDER_LANE + lane_order(pg),
                                              merge_key=f"{LANE_KEY}{pg}"))
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
    fold.finish()
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as f:
            _write_cross(f, fold)
            for table in _tables(run, sorted(fold.ranks), [], progress, "overview: writing"):
                _write_rank(f, table, fold)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    stragglers: dict[int, int] = defaultdict(int)
    for rank in fold.straggler:
        if rank >= 0:
            stragglers[rank] += 1
    return OverviewResult(out=target, ranks=len(fold.ranks), instances=len(fold),
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

def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Every rank's comm lanes, the per-group summary and bandwidth tracks and "
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
