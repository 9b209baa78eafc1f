"""``commviz overview RUN_DIR``: every rank's collectives in one small trace, from comm tables only.

The merged trace of a 1,024-rank job is far too large for one Perfetto tab; its comm lanes are
not, up to a point: 16,384 ranks' lanes are 49k tracks. The overview reads the ranks' comm
tables (``merge.table``), never a trace, shard or matched run's GPU ops, each table once, into
columns (``review.fold``), and writes:

- "collectives · all ranks": per process group one slice per collective instance (first start
  to last end over its ranks, skew, late rank, bandwidth as args) and its bus-bandwidth
  counter, nested under "PG tp · 2048 groups" where a description names more than
  ``NEST_ABOVE`` groups; a "stragglers" track naming the late rank of every instance whose skew
  stands out; a "desyncs" track with each group's first disagreement;
- above ``FOLD_ABOVE`` ranks, a process "alike ranks (folded)": per process group one lane
  "PG tp · ranks 0-4, 6-7 (alike)" whose slices run from the alike ranks' median start to
  their median end, with their count and min/median/max starts, ends and waits as args;
- one process per kept rank (every rank up to ``FOLD_ABOVE``): its comm lanes, every slice,
  with the same lane names, order and cross-rank flow ids as the merged trace, so the two
  read alike. ``review.fold`` says which ranks are kept: every straggler, every rank a
  tolerance away from its group's typical rank, every failed call, every rank on a minority
  side of a desync; the process's labels say why.

Flows join an instance's slices across the kept ranks and the folded lane. Bytes grow with the
instances (about 4 kB a rank of a TP 8 job at 16,384 ranks), not with ranks x group size. A
person then picks the ranks that matter (``commviz merge RUN_DIR --ranks ...``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from commviz import metadata as md
from commviz.errors import SourceError
from commviz.match.artifact import PgInfo
from commviz.match.model import InstanceKey, KeyKind
from commviz.merge import bandwidth as bw
from commviz.merge.core import progress_bar
from commviz.merge.cross import write_summary
from commviz.merge.instances import Span, bandwidth_ranks, expected_ranks, instance_label
from commviz.merge.piece import (LANE_CAT, LANE_KEY, ORDER_LANE, PID_BASE, cross_flow_id,
                                 instance_text, lane_name, lane_order)
from commviz.merge.select import format_ranks
from commviz.merge.summary import SummaryTracks, comm_args, tracks_for
from commviz.merge.table import CommTable, Flag, iter_tables, table_ranks
from commviz.review.fold import Fold
from commviz.review.groupfold import AlikeGroups, fold_groups, lower_median
from commviz.write.pftrace import Piece, emit_slices, flow_field, split, track_descriptor

OVERVIEW_NAME = "overview.pftrace"
STRAGGLERS_TRACK = "stragglers · late rank per instance"
DESYNCS_TRACK = "desyncs · first disagreement per group"
FOLDED_PROCESS = "alike ranks (folded)"
# Up to this many ranks every rank keeps its own process (a Perfetto tab holds 64 ranks' lanes
# well); above, alike ranks fold (``review.fold``).
FOLD_ABOVE = 64
# A description shared by more groups than this gets a node of its own ("PG tp · 2048 groups").
NEST_ABOVE = 16
# Groups of more ranks than this are named by runs of ranks ("0-16383", "5-16381 step 8").
LIST_RANKS_MAX = 16
# From this many ranks the tables are read by two processes (``_read``).
READ_IN_TWO = 4096
FOLDED_PID = PID_BASE - 1            # rank R's process is PID_BASE + R
FOLDED_LANE = ("{n} ranks folded ({ranks}). Each slice runs from their median start to their "
               "median end; start_early_ns / start_late_ns: how long before and after it the "
               "first and last of them started, end_early_ns / end_late_ns likewise for the "
               "ends; wait_median_ns / wait_max_ns: their waits for the last rank.")
LAUNCH_ONLY, FAILED = int(Flag.LAUNCH_ONLY), int(Flag.FAILED)
ORDER_SUMMARY, ORDER_FOLDED = -2, -1


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


def seen_of(fold: Fold, idx: np.ndarray) -> list[Seen]:
    """The instances ``idx`` (of one group) with their expected ranks and bandwidth."""
    names, out = fold.names.names, []
    members: dict[str, int] = {}             # a group's collectives: its ranks, counted once
    cols = zip(idx.tolist(), fold.first_start[idx].tolist(), fold.last_start[idx].tolist(),
               fold.last_end[idx].tolist(), fold.late_rank[idx].tolist(),
               fold.count[idx].tolist(), fold.flags[idx].tolist(), fold.size[idx].tolist(),
               fold.straggler[idx].tolist())
    for i, first, last, end, late, count, flags, size, straggler in cols:
        key, pg = fold.keys.key(i), names[fold.pg[i]]
        plain = key.kind is KeyKind.COLLECTIVE
        if not plain or pg not in members:
            info = fold.pgs.get(pg)
            expected = len(expected_ranks(key, {md.PG_RANKS: info.ranks if info else None}))
            if plain:
                members[pg] = expected
        else:
            expected = members[pg]
        expected = expected or count
        origin = fold.origin[i]
        seen = Seen(key, pg, names[fold.op[i]], names[fold.ctype[i]], first, last, end, late,
                    count, bool(flags & LAUNCH_ONLY), bool(flags & FAILED),
                    size if size >= 0 else None, expected, None,
                    straggler if straggler >= 0 else None,
                    names[origin] if origin >= 0 else None)
        seen.bandwidth = bw.bandwidth(seen.ctype, seen.size_bytes, seen.comm_ns,
                                      bandwidth_ranks(key, expected))
        out.append(seen)
    return out


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
    folded: int = 0                     # ranks drawn only in the folded lanes
    kept: dict[int, list[str]] = field(default_factory=dict)   # folded: rank -> why it is kept
    desyncs: list[str] = field(default_factory=list)


def display_pgs(pgs: dict[str, PgInfo]) -> dict[str, PgInfo]:
    """The groups as lane names show them: a large group's ranks as runs, not a list (a
    16,384-rank list is 100 kB in every lane descriptor naming it)."""
    out = {}
    for pg, info in pgs.items():
        ranks = md.group_ranks(info.ranks) if info.ranks is not None else ()
        if len(ranks) > LIST_RANKS_MAX:
            info = PgInfo(info.desc, f"{md.ranks_text(ranks)} ({len(ranks)} ranks)")
        out[pg] = info
    return out


def _label(pg: str, info: PgInfo | None) -> str:
    """A group's lane label without its ranks ("PG tp")."""
    return lane_name(pg, PgInfo(info.desc if info else None, None))


def _nodes(piece: Piece, parent: int, groups: list[str], pgs: dict[str, PgInfo],
           suffix: str = "") -> dict[str, int]:
    """Per group, the track its tracks hang from: ``parent``, or a node per description that
    more than ``NEST_ABOVE`` groups share."""
    by_desc: dict[str, list[str]] = defaultdict(list)
    for pg in groups:
        info = pgs.get(pg)
        if info is not None and info.desc and info.desc != "undefined":
            by_desc[info.desc].append(pg)
    out = {pg: parent for pg in groups}
    for desc, members in sorted(by_desc.items()):
        if len(members) > NEST_ABOVE:
            node = piece.new_uuid()
            piece.descriptor(track_descriptor(
                node, name=f"PG {desc} · {len(members)} groups{suffix}", parent=parent,
                explicit_children=True, order_rank=2 * min(lane_order(pg) for pg in members)))
            out.update((pg, node) for pg in members)
    return out


def _write_cross(f: BinaryIO, fold: Fold, pgs: dict[str, PgInfo], shown: np.ndarray,
                 folding: bool) -> None:
    """Piece 0: the root, the summary, stragglers and desyncs tracks, and the folded ranks."""
    piece = Piece(f, 0)
    piece.descriptor(track_descriptor(0, explicit_children=True, explicit_processes=True))
    group = piece.new_uuid()
    piece.descriptor(track_descriptor(group, name="collectives · all ranks",
                                      explicit_children=True, order_rank=ORDER_SUMMARY))
    stats = {"summary_slices": 0, "bandwidth_samples": 0}
    ordered = sorted(fold.by_pg, key=lambda g: (lane_order(g), g))
    nodes = _nodes(piece, group, ordered, pgs)
    classes = fold_groups(fold, pgs, NEST_ABOVE) if folding else []
    alone = set(fold.by_pg) - {pg for c in classes for pg in c.groups}
    for pg in sorted(alone):        # one group's slices at a time: memory of a group, not the run
        write_summary(piece, nodes[pg], summary_of(seen_of(fold, fold.by_pg[pg])), pgs, stats)
        piece.flush()       # not at 4 MiB (FLUSH_BYTES): the run's summary would fill that
    for c in classes:
        write_summary(piece, nodes[c.groups[0]], tracks_for(_alike_seen(fold, c), _alike_args),
                      pgs, stats, {c.name: (f"PG {c.desc} · {len(c.groups):,} alike groups",
                                            c.describe())})
        piece.flush()
    _write_stragglers(piece, group, fold, pgs)
    _write_desyncs(piece, group, fold, pgs)
    if folding and fold.folded:
        _write_folded(piece, fold, pgs, shown, [pg for pg in ordered if pg in alone], classes)
    piece.flush()


def _place_key(fold: Fold, c: AlikeGroups, i: int) -> InstanceKey:
    """Instance ``i`` of a class's first group as the class's place: the class's name for its
    group, a transfer's ranks as places in its group ("send 0->1 #3")."""
    key = fold.keys.key(i)._replace(pg=c.name)
    if key.src is not None and key.dst is not None:
        ranks = list(md.group_ranks(fold.pgs[c.groups[0]].ranks))
        key = key._replace(src=ranks.index(key.src), dst=ranks.index(key.dst))
    return key


@dataclass(slots=True)
class AlikeSeen(Seen):
    """One place of a class of alike groups, as a summary slice needs it."""

    groups: AlikeGroups | None = None
    skew_max_ns: int = 0            # the largest skew of its groups' instances there


def _alike_seen(fold: Fold, c: AlikeGroups) -> list[AlikeSeen]:
    """A class's places as instances: the median group's first start, last start and last end;
    ``count`` and ``expected``: over all its groups."""
    first, last, end = (lower_median(col[c.idx]) for col in
                        (fold.first_start, fold.last_start, fold.last_end))
    held = fold.count[c.idx].sum(axis=0)
    skew = (fold.last_start[c.idx] - fold.first_start[c.idx]).max(axis=0)
    out = []
    for seen, i, a, b, e, n, top in zip(seen_of(fold, c.idx[0]), c.idx[0].tolist(), first.tolist(),
                                        last.tolist(), end.tolist(), held.tolist(), skew.tolist()):
        place = AlikeSeen(*(getattr(seen, f.name) for f in fields(Seen)), groups=c,
                          skew_max_ns=top)
        place.key, place.pg = _place_key(fold, c, i), c.name
        place.first_start_ns, place.last_start_ns, place.last_end_ns = a, b, e
        place.count, place.expected = n, seen.expected * len(c.groups)
        place.bandwidth = bw.bandwidth(place.ctype, place.size_bytes, place.comm_ns,
                                       bandwidth_ranks(fold.keys.key(i), seen.expected))
        out.append(place)
    return out


def _alike_args(place: AlikeSeen) -> dict[str, Any]:
    """A folded groups' slice: the median group's figures, how many groups it stands for and
    which of the family's groups are drawn on their own."""
    args = slice_args(place)
    del args["commviz.late_rank"]
    c = place.groups
    assert c is not None
    args["commviz.skew_max_ns"] = place.skew_max_ns
    args["commviz.alike_groups"] = len(c.groups)
    args["commviz.folded_groups"] = c.text
    if c.exceptions:
        args["commviz.exception_groups"] = c.exceptions_text
    return args


def _write_stragglers(piece: Piece, group: int, fold: Fold, pgs: dict[str, PgInfo]) -> None:
    late = seen_of(fold, np.flatnonzero(fold.straggler >= 0))
    late.sort(key=lambda s: (s.first_start_ns, s.pg))
    if not late:
        return
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


def _write_desyncs(piece: Piece, group: int, fold: Fold, pgs: dict[str, PgInfo]) -> None:
    """One instant per group whose ranks disagree, at the instance's first start."""
    if not fold.desyncs:
        return
    events = [{"name": f"{_label(d.pg, pgs.get(d.pg))} #{d.seq}: {d.kind} · ranks "
                       f"{md.ranks_text(d.odd)}",
               "cat": "commviz.desync",
               "args": {md.PG_NAME: d.pg, md.SEQ: d.seq, "commviz.desync": str(d.kind),
                        "commviz.desync_ranks": md.ranks_text(d.odd),
                        "commviz.sides": d.message}}
              for d in fold.desyncs]
    uuid = piece.new_uuid()
    piece.descriptor(track_descriptor(uuid, name=DESYNCS_TRACK, parent=group, order_rank=-1))
    items = sorted((d.ts_ns, -d.ts_ns, i) for i, d in enumerate(fold.desyncs))
    seq = piece.sequence(uuid)
    piece.buf += seq.start(items[0][0])
    emit_slices(seq, piece.buf, items, events)


def _write_folded(piece: Piece, fold: Fold, pgs: dict[str, PgInfo], shown: np.ndarray,
                  ordered: list[str], classes: list[AlikeGroups]) -> None:
    """The alike ranks: per group (``ordered``) one lane, per instance the alike ranks' median
    start to median end, their count and min/median/max times as args; per class of alike
    groups one lane, per place the same over all its groups' ranks (medians of the groups')."""
    proc = piece.new_uuid()
    name = f"{FOLDED_PROCESS} · {fold.folded:,} of {len(fold.hosts):,} ranks"
    piece.descriptor(track_descriptor(proc, name=name, pid=FOLDED_PID, process_name=name,
                                      explicit_children=True, order_rank=ORDER_FOLDED))
    alike = {pg: [r for r in fold.group_ranks.get(pg, ()) if r not in fold.kept]
             for pg in ordered}
    groups = [pg for pg in ordered if alike[pg]]
    nodes = _nodes(piece, proc, groups + [c.groups[0] for c in classes], pgs, " (alike)")
    for pg in groups:
        ranks = md.ranks_text(alike[pg])
        idx = fold.by_pg[pg]
        idx = idx[fold.alike_count[idx] > 0]
        cols = [c[idx] for c in (fold.a_start, fold.a_end, fold.a_start_early,
                                 fold.a_start_late, fold.a_end_early, fold.a_end_late,
                                 fold.a_wait, fold.a_wait_max, fold.alike_count)]
        _write_alike_lane(piece, fold, idx, [fold.keys.key(i) for i in idx.tolist()], cols,
                          shown[idx], nodes[pg], pg, {"commviz.folded_ranks": ranks},
                          f"{_label(pg, pgs.get(pg))} · ranks {ranks} (alike)",
                          FOLDED_LANE.format(n=len(alike[pg]), ranks=ranks))
    for c in classes:
        idx = c.idx
        start, end = lower_median(fold.a_start[idx]), lower_median(fold.a_end[idx])
        cols = [start, end, start - (fold.a_start - fold.a_start_early)[idx].min(axis=0),
                (fold.a_start + fold.a_start_late)[idx].max(axis=0) - start,
                end - (fold.a_end - fold.a_end_early)[idx].min(axis=0),
                (fold.a_end + fold.a_end_late)[idx].max(axis=0) - end,
                lower_median(fold.a_wait[idx]), fold.a_wait_max[idx].max(axis=0),
                fold.alike_count[idx].sum(axis=0)]
        n = sum(len(fold.group_ranks[pg]) for pg in c.groups)       # all alike: none kept
        _write_alike_lane(piece, fold, idx[0], [_place_key(fold, c, i) for i in idx[0].tolist()],
                          cols, np.zeros(len(idx[0]), np.int64), nodes[c.groups[0]], c.name,
                          {"commviz.alike_groups": len(c.groups),
                           "commviz.folded_groups": c.text,
                           **({"commviz.exception_groups": c.exceptions_text}
                              if c.exceptions else {})},
                          f"PG {c.desc} · {len(c.groups):,} alike groups, {n:,} ranks (alike)",
                          f"{FOLDED_LANE.format(n=n, ranks=f'of {len(c.groups):,} groups')} "
                          f"Each slice's times are the median group's. {c.describe()}")


def _write_alike_lane(piece: Piece, fold: Fold, idx: np.ndarray, keys: list[InstanceKey],
                      cols: list[np.ndarray], drawn: np.ndarray, parent: int, pg: str,
                      extra: dict[str, Any], name: str, description: str) -> None:
    """One folded lane: per instance ``idx`` (op, flags, size, origin from it) with its
    ``keys`` the alike ranks' times ``cols`` (start, end, start early/late, end early/late,
    median and longest wait, count); a flow where the instance is ``drawn`` more than once."""
    events, flows, items = [], {}, []
    rows = zip(idx.tolist(), keys, *(c.tolist() for c in cols), fold.flags[idx].tolist(),
               fold.size[idx].tolist(), drawn.tolist())
    for n, (i, key, start, end, s_early, s_late, e_early, e_late, wait, wait_max, count, flags,
            size, shown) in enumerate(rows):
        args: dict[str, Any] = {md.SEQ: key.seq} if key.kind is KeyKind.COLLECTIVE else {}
        args[md.PG_NAME] = pg
        args["commviz.instance"] = instance_text(key)
        args.update(extra)
        args["commviz.alike_ranks"] = count
        args.update({"commviz.start_early_ns": s_early, "commviz.start_late_ns": s_late,
                     "commviz.end_early_ns": e_early, "commviz.end_late_ns": e_late})
        if not flags & LAUNCH_ONLY:
            args["commviz.wait_median_ns"] = wait
            args["commviz.wait_max_ns"] = wait_max
        if fold.origin[i] >= 0:
            args[md.ORIGIN] = fold.names.names[fold.origin[i]]
        if size >= 0:
            args["commviz.size_bytes"] = size
        if shown > 1:
            flows[n] = flow_field(cross_flow_id(key))
        items.append((start, -end, n))
        events.append({"name": fold.names.names[fold.op[i]], "cat": LANE_CAT, "args": args})
    items.sort()
    for back in split(items):
        uuid = piece.new_uuid()
        piece.descriptor(track_descriptor(
            uuid, name=name, parent=parent, order_rank=ORDER_LANE + lane_order(pg),
            merge_key=f"{LANE_KEY}{pg}", description=description))
        seq = piece.sequence(uuid)
        piece.buf += seq.start(back[0][0])
        emit_slices(seq, piece.buf, back, events, None, flows)
        piece.maybe_flush()


def _write_rank(f: BinaryIO, table: CommTable, fold: Fold, pgs: dict[str, PgInfo],
                shown: np.ndarray, labels: list[str]) -> None:
    """One rank's process: its comm lanes, each slice with its wait and lateness."""
    rank = table.rank
    piece = Piece(f, rank + 1)
    proc = piece.new_uuid()
    name = f"rank {rank} · {table.host or '?'}"
    piece.descriptor(track_descriptor(proc, name=name, pid=PID_BASE + rank, process_name=name,
                                      labels=labels, explicit_children=True, order_rank=rank))
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
        if not fold.flags[i] & LAUNCH_ONLY:
            args["commviz.wait_ns"] = max(0, min(int(fold.last_start[i]), row.end_ns)
                                          - row.start_ns)
        if fold.late_rank[i] == rank and count > 1:
            args["commviz.late"] = True
        if fold.straggler[i] == rank:
            args["commviz.straggler"] = rank
        if shown[i] > 1:                   # an instance drawn once has no other end
            flows[len(events)] = flow_field(cross_flow_id(row.key))
        items[row.pg].append((row.start_ns, -row.end_ns, len(events)))
        events.append({"name": row.op, "cat": LANE_CAT, "args": args})
    for pg in sorted(items, key=lambda g: (lane_order(g), g)):
        for back in split(sorted(items[pg])):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=lane_name(pg, pgs.get(pg)),
                                              parent=proc, order_rank=ORDER_LANE + lane_order(pg),
                                              merge_key=f"{LANE_KEY}{pg}"))
            seq = piece.sequence(uuid)
            piece.buf += seq.start(back[0][0])
            emit_slices(seq, piece.buf, back, events, None, flows)
            piece.maybe_flush()
    piece.flush()


def write_overview(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                   *, progress: bool = True, fold: bool | None = None) -> OverviewResult:
    """Write the overview of every rank with a comm table (or a matched run to make one).
    ``fold``: fold alike ranks (default: above ``FOLD_ABOVE`` ranks)."""
    started = time.perf_counter()
    run = Path(run_dir)
    if not run.is_dir():
        raise SourceError(str(run), "not a directory")
    ranks = table_ranks(run)
    if not ranks:
        raise SourceError(str(run), "no comm tables (comm_rank*.json) and no matched runs "
                                    "(matched_rank*.json): run `commviz merge` or a launch first")
    folding = len(ranks) > FOLD_ABOVE if fold is None else fold
    target = Path(out) if out is not None else run / OVERVIEW_NAME
    data, problems = _read(run, ranks, progress)
    data.finish(alike=folding)
    kept = sorted(data.kept) if folding else data.ranks
    # slices each instance has in the output: its kept ranks', and the folded lane's
    shown = data.count - data.alike_count + (data.alike_count > 0) if folding else data.count
    pgs = display_pgs(data.pgs)
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as f:
            _write_cross(f, data, pgs, shown, folding)
            for table in _tables(run, kept, [], progress, "overview: writing"):
                labels = data.kept[table.rank].labels() if folding else []
                _write_rank(f, table, data, pgs, shown, labels)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    stragglers: dict[int, int] = defaultdict(int)
    for rank in data.straggler[data.straggler >= 0].tolist():
        stragglers[rank] += 1
    return OverviewResult(
        out=target, ranks=len(data.hosts), instances=len(data), rows=data.rows,
        stragglers=dict(stragglers), problems=problems, bytes=target.stat().st_size,
        seconds=round(time.perf_counter() - started, 3),
        folded=data.folded if folding else 0,
        kept={r: k.labels() for r, k in data.kept.items()} if folding else {},
        desyncs=[d.message for d in data.desyncs])


def _read(run: Path, ranks: list[int], progress: bool) -> tuple[Fold, list[str]]:
    """Every table once, into one fold. From ``READ_IN_TWO`` ranks on, on a machine of two
    cores or more, a second process reads the upper half of the ranks meanwhile (parsing and
    checking the tables is most of the overview's time) and its fold joins this one."""
    if len(ranks) < READ_IN_TWO or len(os.sched_getaffinity(0)) < 2:
        return _read_part(run, ranks, progress)
    half = len(ranks) // 2
    ctx = multiprocessing.get_context(      # as the merge's workers (``merge.core``)
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with tempfile.TemporaryDirectory(prefix="commviz-overview-") as spill, \
            ProcessPoolExecutor(1, mp_context=ctx) as pool:
        other = pool.submit(_read_other, run, ranks[half:], Path(spill))
        data, problems = _read_part(run, ranks[:half], progress)
        got = other.result()
        if isinstance(got[0], str):
            raise SourceError(*got)
        part, more = got
        data.join(part)
    return data, problems + more


def _read_other(run: Path, ranks: list[int], spill: Path
                ) -> tuple[Fold, list[str]] | tuple[str, str]:
    """``_read_part`` in the second process, its rows' columns spilled to ``spill``
    (``Fold.spill``); a ``SourceError`` comes back as its source and message (it does not
    pickle as itself)."""
    try:
        data, problems = _read_part(run, ranks)
    except SourceError as exc:
        return exc.source, exc.message
    data.spill(spill)
    return data, problems


def _read_part(run: Path, ranks: list[int], progress: bool = False) -> tuple[Fold, list[str]]:
    problems: list[str] = []
    data = Fold()
    for table in _tables(run, ranks, problems, progress, "overview: reading tables", False):
        data.add(table)
        problems.extend(f"rank {table.rank}: {p}" for p in table.problems)
    return data, problems


def _tables(run: Path, ranks: list[int], problems: list[str], progress: bool, label: str,
            named: bool = True) -> Iterator[CommTable]:
    bar = progress_bar(label, len(ranks)) if progress else None
    try:
        for table in iter_tables(run, ranks, problems, named):
            yield table
            if bar:
                bar.advance()
    finally:
        if bar:
            bar.close()


# -- the command -------------------------------------------------------------------------------

def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Every rank's comm lanes, the per-group summary and bandwidth tracks, the "
                     "stragglers and desyncs, from the ranks' comm tables only (no trace is "
                     f"read). Above {FOLD_ABOVE} ranks, ranks that behave alike fold into one "
                     "lane per process group; stragglers, ranks off their group's typical "
                     "timing, failed calls and desynced ranks keep their own lanes. Then merge "
                     "the ranks that matter: commviz merge RUN_DIR --ranks ...")
    p.add_argument("run_dir", help="run dir with comm_rank*.json (or matched_rank*.json)")
    p.add_argument("-o", "--out", help=f"output file (default RUN_DIR/{OVERVIEW_NAME})")
    p.add_argument("--fold", action=argparse.BooleanOptionalAction, default=None,
                   help=f"fold alike ranks (default: above {FOLD_ABOVE} ranks)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    result = write_overview(args.run_dir, args.out, progress=True, fold=args.fold)
    for problem in result.problems:
        print(f"commviz overview: problem: {problem}", file=sys.stderr)
    print(f"overview of {result.ranks} ranks: {result.instances} collective instances, "
          f"{result.rows} rank slices, in {result.seconds} s")
    if result.stragglers:
        worst = sorted(result.stragglers.items(), key=lambda kv: (-kv[1], kv[0]))[:8]
        print("stragglers (rank: instances): " + ", ".join(f"{r}: {n}" for r, n in worst))
    for desync in result.desyncs:
        print(f"desync: {desync}")
    if result.folded:
        print(f"{result.folded} alike ranks folded; {len(result.kept)} kept at full detail")
        for rank, why in list(result.kept.items())[:8]:
            print(f"  rank {rank}: {', '.join(why)}")
        if result.kept:
            print(f"detail: commviz merge {args.run_dir} --ranks "
                  f"{format_ranks(list(result.kept)[:64])}")
    print(f"wrote {result.out} ({result.bytes} bytes)")
    return 0
