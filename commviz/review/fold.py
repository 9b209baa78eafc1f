"""The overview's fold: every rank's comm table read once into columns, each collective
instance's spread over its ranks, and which ranks behave alike.

An instance is torch's own unit: one process group's collective with one sequence number (or a
p2p transfer's key, ``match.model.InstanceKey``). Per instance, over the ranks that hold it:

- the *typical* rank starts at the median start and ends at the median end (the lower median:
  a time some rank really had);
- the *tolerance* is the instance's straggler threshold, the review's rule
  (``merge.instances.straggler_thresholds``): 5 x the median skew of its group's other
  instances, at least 1 ms; the group's own jitter sets what counts as alike.

A rank is *kept* (the overview draws its own lanes, every slice) when, in any instance, it is
the straggler, starts or ends a tolerance or more away from the typical rank, its call failed,
or it stands on a minority side of its group's first desync. Every other rank is *alike*: the
overview folds a group's alike ranks into one lane with their count and min/median/max
times. The fold depends only on the tables, never on the order they were read in.

Desyncs, from tables: each group's collectives lined up by sequence number over the stretch
every rank recorded, as ``review.analyses.desync`` does with the full records; a table holds each
call's op, bytes and nccl-tests type (not its dtype, root or reduction), so those must agree,
and every member of the group present in the run must hold the number.

Steps and waits, for ``commviz diff``: each row's profiler step (its table's ``steps``), and per
instance the step its ranks place it in and the time its ranks waited for the last one (the
review's wait, ``merge.instances``: from a rank's start until the last rank arrived or it left).

Memory: five columns per row (25 bytes: 53 MB for the 2.1M rows of 16,384 ranks x 130
collectives; the rows' steps are found once all are read, from each rank's few step ranges) and
a few per instance; the numbers are worked out with numpy, once.
"""

from __future__ import annotations

from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from commviz import metadata as md
from commviz.match.artifact import PgInfo
from commviz.match.model import InstanceKey, KeyKind
from commviz.merge.instances import WARMUP, straggler_thresholds
from commviz.merge.table import CommTable, Flag
from commviz.trace.steps import Step
from commviz.review.analyses.desync import DesyncKind


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
    """One group's collectives (or one pair's transfers) by sequence number from ``base``:
    each one's index, or -1."""

    base: int
    slots: array
    id: int             # its place among its table's groups (``KeyIndex._pair_keys``)


class KeyIndex:
    """Instance key -> index 0, 1, ...: about 16 bytes an instance where a dict of key objects
    costs about 200. A group numbers its collectives densely, and a pipeline numbers each
    (group, src, dst) pair's transfers densely, so each keeps an array from sequence number to
    index; other keys (batches, annotations, graph replays, a sequence number far from its
    group's others) are few and keep a dict."""

    MAX_GAP = 1 << 16       # a sequence number this far outside its group's array: the dict
    COLLECTIVE, P2P, OTHER = 0, 1, -1       # ``_kind``: how an index's key is held

    def __init__(self, names: Names) -> None:
        self._names = names
        self._groups: dict[str, _Seqs] = {}
        self._pairs: dict[tuple[str, int, int], _Seqs] = {}     # p2p: (group, src, dst)
        self._pair_keys: list[tuple[str, int, int]] = []
        self._kind = array("b")
        self._pg = array("i")           # per index: its group (a ``Names`` id) or pair (index)
        self._seq = array("q")          # per index: its sequence number (dense keys)
        self._other: dict[InstanceKey, int] = {}
        self._other_keys: dict[int, InstanceKey] = {}
        self._far: list[int] = []       # dense keys in the dict: far from their group's others

    def __len__(self) -> int:
        return len(self._seq)

    @staticmethod
    def _dense(key: InstanceKey) -> bool:
        """A group's collective (its sequence number and group are the whole key)."""
        return (key.kind is KeyKind.COLLECTIVE and key[3:] == _PLAIN and type(key.seq) is int
                and abs(key.seq) < 1 << 62)

    @staticmethod
    def _pair(key: InstanceKey) -> tuple[str, int, int] | None:
        """A plain p2p transfer's (group, src, dst); None for any other key."""
        if (key.kind is KeyKind.P2P and key[5:] == _PLAIN[2:] and type(key.seq) is int
                and type(key.src) is int and type(key.dst) is int and abs(key.seq) < 1 << 62):
            return key.pg, key.src, key.dst
        return None

    def find(self, key: InstanceKey) -> int | None:
        # ``_dense`` inlined (one call per row); its range check is ``_place``'s
        if key.kind is KeyKind.COLLECTIVE and key[3:] == _PLAIN and type(key.seq) is int:
            group = self._groups.get(key.pg)
        elif key.kind is KeyKind.P2P:
            group = self._pairs.get((key.pg, key.src, key.dst))
        else:
            group = None
        if group is not None and type(key.seq) is int:
            off = key.seq - group.base
            if 0 <= off < len(group.slots) and group.slots[off] >= 0:
                return group.slots[off]
        return self._other.get(key)

    def add(self, key: InstanceKey) -> int:
        """The index of a key ``find`` does not know."""
        i = len(self)
        dense, pair = self._dense(key), self._pair(key)
        if dense and self._place(self._groups, key.pg, key.seq, i):
            self._kind.append(self.COLLECTIVE)
            self._pg.append(self._names.id(key.pg))
            self._seq.append(key.seq)
        elif pair is not None and self._place(self._pairs, pair, key.seq, i):
            if len(self._pairs) > len(self._pair_keys):
                self._pair_keys.append(pair)
            self._kind.append(self.P2P)
            self._pg.append(self._pairs[pair].id)
            self._seq.append(key.seq)
        else:
            if dense:
                self._far.append(i)
            self._other[key] = i
            self._other_keys[i] = key
            self._kind.append(self.OTHER)
            self._pg.append(-1)
            self._seq.append(0)
        return i

    def _place(self, table: dict, name: object, seq: int, i: int) -> bool:
        group = table.get(name)
        if group is None:
            table[name] = _Seqs(seq, array("i", [i]), len(table))
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
        kind = self._kind[i]
        if kind == self.COLLECTIVE:
            return InstanceKey(KeyKind.COLLECTIVE, self._names.names[self._pg[i]], self._seq[i])
        if kind == self.P2P:
            pg, src, dst = self._pair_keys[self._pg[i]]
            return InstanceKey(KeyKind.P2P, pg, self._seq[i], src, dst)
        return self._other_keys[i]

    def transfers(self) -> np.ndarray:
        """Per index: whether it is a plain p2p transfer held densely (most of a pipeline's)."""
        return np.array(self._kind, dtype=np.int8) == self.P2P

    def numbered(self) -> tuple[np.ndarray, np.ndarray]:
        """Per index: the group (a ``Names`` id; -1: not a group's numbered collective) and
        the sequence number; a number kept in the dict, far from its group's others, too."""
        pg = np.where(np.array(self._kind, dtype=np.int8) == self.COLLECTIVE,
                      np.array(self._pg, dtype=np.int32), -1).astype(np.int32)
        seq = np.array(self._seq, dtype=np.int64)
        for i in self._far:
            key = self._other_keys[i]
            pg[i], seq[i] = self._names.id(key.pg), key.seq
        return pg, seq


@dataclass(frozen=True, slots=True)
class Side:
    ranks: tuple[int, ...]
    call: str | None                # "all_reduce 8 MiB"; None: no call with that number


@dataclass(frozen=True, slots=True)
class TableDesync:
    """A group's first sequence number where its ranks disagree (from comm tables)."""

    pg: str
    seq: int
    kind: DesyncKind
    sides: tuple[Side, ...]         # largest first
    odd: tuple[int, ...]            # the ranks the overview keeps: every side but the largest
    ts_ns: int                      # the instance's first start

    @property
    def message(self) -> str:
        sides = "; ".join(f"ranks {md.ranks_text(s.ranks)}: {s.call or 'nothing'}"
                          for s in self.sides)
        return f"process group {md.pg_shown(self.pg)} first differs at seq {self.seq} [{self.kind}]: {sides}"


REASONS = ("straggler", "late", "early", "end", "failed")
_ROW_COLUMNS = ("_inst", "_start", "_end", "_flags", "_call")      # ``Fold``'s, per row
CHUNK = 1 << 18                 # rows at a time where a step needs temporaries per row


@dataclass
class Kept:
    """Why a rank keeps its own lanes: instances per reason (``REASONS``), its desyncs."""

    counts: Counter = field(default_factory=Counter)
    desyncs: list[str] = field(default_factory=list)

    def labels(self) -> list[str]:
        words = {"straggler": "straggler", "late": "late", "early": "early",
                 "end": "ends apart", "failed": "failed"}
        return ([f"{words[r]} x{self.counts[r]}" for r in REASONS if self.counts[r]]
                + [f"desync {d}" for d in self.desyncs])


class Fold:
    """Every row of every table as columns (``add``, one table at a time), then per instance
    its spread, stragglers, desyncs and the kept ranks (``finish``)."""

    def __init__(self) -> None:
        self.names = Names()
        self.keys = KeyIndex(self.names)
        # per instance, as its first rank saw it (``names`` ids; origin -1: none)
        self.pg, self.op, self.ctype, self.origin = array("i"), array("i"), array("i"), array("i")
        # per row, rank after rank
        self._inst, self._start, self._end = array("i"), array("q"), array("q")
        self._flags, self._call = array("B"), array("i")
        self._calls: dict[tuple[str, int | None, str], int] = {}    # what must agree across ranks
        self._table_rank, self._table_rows = array("i"), array("q")
        self.pgs: dict[str, PgInfo] = {}
        self.hosts: dict[int, str | None] = {}
        self.steps: dict[int, list[Step]] = {}      # rank -> its profiler steps, where known
        self.units: dict[str, str] = {}             # origin -> unit, where they differ
        self.rows = 0
        self.spilled: Path | None = None        # where ``spill`` wrote the rows' columns

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.hosts)

    def add(self, table: CommTable) -> None:
        """Fold in one rank's table; ranks come in increasing order (``finish`` relies on
        rows being rank after rank)."""
        rank = table.rank
        if self._table_rank and rank <= self._table_rank[-1]:
            raise ValueError(f"rank {rank} after rank {self._table_rank[-1]}: tables in rank order")
        self.hosts[rank] = table.host
        for pg, info in table.pgs.items():
            self.pgs.setdefault(pg, info)
        rows = table.rows
        if rows:            # column by column: a table's rows transposed once
            pgs, ops, keys, starts, ends, sizes, ctypes, flags, origins = zip(*rows)
            find, calls = self.keys.find, self._calls
            inst = [find(key) for key in keys]
            for n in [n for n, i in enumerate(inst) if i is None]:
                inst[n] = find(keys[n])         # a key twice in one table: known by now
                if inst[n] is None:
                    inst[n] = self._new(keys[n], pgs[n], ops[n], ctypes[n], origins[n])
            sigs = list(zip(ops, sizes, ctypes))
            call = [calls.get(sig) for sig in sigs]
            for n in [n for n, c in enumerate(call) if c is None]:
                call[n] = calls.setdefault(sigs[n], len(calls))
            self._inst.extend(inst)
            self._call.extend(call)
            self._start.extend(starts)
            self._end.extend(ends)
            self._flags.extend(flags)
        if table.steps:
            self.steps[rank] = table.steps
        self.units.update(table.units)
        self._table_rank.append(rank)
        self._table_rows.append(len(rows))
        self.rows += len(rows)

    def join(self, part: Fold) -> None:
        """Fold in what another fold read (the tables of higher ranks, read in parallel)."""
        if part._table_rank and self._table_rank and part._table_rank[0] <= self._table_rank[-1]:
            raise ValueError("a joined fold holds the ranks after this one's")
        names = part.names.names
        inst = np.empty(len(part), dtype=np.int32)
        for j in range(len(part)):
            key = part.keys.key(j)
            i = self.keys.find(key)
            if i is None:
                origin = part.origin[j]
                i = self._new(key, names[part.pg[j]], names[part.op[j]], names[part.ctype[j]],
                              names[origin] if origin >= 0 else None)
            inst[j] = i
        call = np.empty(len(part._calls), dtype=np.int32)
        for sig, c in part._calls.items():
            call[c] = self._calls.setdefault(sig, len(self._calls))
        self._inst.frombytes(inst[part._rows_column("_inst")].tobytes())
        self._call.frombytes(call[part._rows_column("_call")].tobytes())
        for name in ("_start", "_end", "_flags"):
            mine = getattr(self, name)
            if part.spilled is None:
                mine.extend(getattr(part, name))
            else:
                with open(part.spilled / name, "rb") as f:
                    mine.fromfile(f, part.rows)
        self._table_rank.extend(part._table_rank)
        self._table_rows.extend(part._table_rows)
        for pg, info in part.pgs.items():
            self.pgs.setdefault(pg, info)
        self.hosts.update(part.hosts)
        self.steps.update(part.steps)
        self.units.update(part.units)
        self.rows += part.rows

    def spill(self, directory: Path) -> None:
        """Write the rows' columns to files in ``directory`` and let them go. A fold sent to
        another process whole is pickled: the receiver would hold its rows twice at once,
        and its own besides; ``join`` reads them from the files, a column at a time."""
        for name in _ROW_COLUMNS:
            column = getattr(self, name)
            with open(directory / name, "wb") as f:
                column.tofile(f)
            setattr(self, name, array(column.typecode))
        self.spilled = directory

    def _rows_column(self, name: str) -> np.ndarray:
        column = getattr(self, name)
        dtype = np.dtype(column.typecode)
        return np.fromfile(self.spilled / name, dtype) if self.spilled else _column(column, dtype)

    def _new(self, key: InstanceKey, pg: str, op: str, ctype: str, origin: str | None) -> int:
        i = self.keys.add(key)
        name = self.names.id
        self.pg.append(name(pg))
        self.op.append(name(op))
        self.ctype.append(name(ctype))
        self.origin.append(-1 if origin is None else name(origin))
        return i

    def calls(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Before ``finish`` (which lets the rows go): every row's rank, instance, start and
        end, as views (``commviz diff`` reads the causes off them, ``live.cause``)."""
        per_table = np.asarray(self._table_rows, dtype=np.int64)
        return (np.repeat(np.asarray(self._table_rank, dtype=np.int32), per_table),
                _column(self._inst, np.int32), _column(self._start, np.int64),
                _column(self._end, np.int64))

    # -- after the last table -------------------------------------------------------------------
    def finish(self, *, alike: bool) -> None:
        """Per instance: count, first/last start, last end, late rank, flags, size, step (-1:
        outside every step), wait, warm-up, straggler, the typical rank's start and end, the tolerance;
        the desyncs and the kept ranks; with
        ``alike``, the folded (alike) ranks' times per instance. The rows are let go.

        Every step runs over a chunk of rows (``CHUNK``) at a time, so memory is the rows'
        columns, one row permutation and a few MB."""
        rows = _Rows(self)
        n = len(self)
        self.count = np.bincount(rows.inst, minlength=n)
        self.first_start, self.last_start, self.med_start, self.last_end, self.med_end = (
            np.zeros(n, np.int64) for _ in range(5))
        self.late_rank = np.zeros(n, np.int32)
        self.flags = np.zeros(n, np.uint8)
        self.size = np.full(n, -1, np.int64)
        self.step, self.wait = np.full(n, -1, np.int32), np.zeros(n, np.int64)
        sizes = np.array([-1 if size is None else max(size, 0) for _, size, _ in self._calls],
                         dtype=np.int64)
        lo = _segments(self.count)
        # each instance's rows by arrival: ties stay in rank order (rows come rank after rank)
        by_start = _by_instance(rows, lo)
        for i0, i1, a, b in _instance_chunks(lo, self.count):
            part = by_start[a:b]
            part[:] = part[np.lexsort((rows.start[part], rows.inst[part]))]
            local = rows.inst[part]
            at = lo[i0:i1] - a
            last = at + self.count[i0:i1] - 1
            mid = at + (self.count[i0:i1] - 1) // 2
            s = rows.start[part]
            self.first_start[i0:i1], self.last_start[i0:i1] = s[at], s[last]
            self.med_start[i0:i1], self.late_rank[i0:i1] = s[mid], rows.rank(part[last])
            e = rows.end[part][np.lexsort((rows.end[part], local))]
            self.last_end[i0:i1], self.med_end[i0:i1] = e[last], e[mid]
            self.flags[i0:i1] = np.bitwise_or.reduceat(rows.flags[part], at)
            self.size[i0:i1] = np.maximum.reduceat(sizes[rows.call[part]], at)
            if rows.step is not None:
                self.step[i0:i1] = np.maximum.reduceat(rows.step[part], at)
            wait = np.minimum(self.last_start[local], rows.end[part]) - s
            self.wait[i0:i1] = np.add.reduceat(np.maximum(wait, 0, out=wait), at)
        self.wait[(self.flags & int(Flag.LAUNCH_ONLY)) != 0] = 0    # nobody measured waiting
        self._stragglers()
        self.kept: dict[int, Kept] = defaultdict(Kept)
        self._odd_rows(rows)
        for r, c in zip(*np.unique(self.straggler[self.straggler >= 0], return_counts=True)):
            self.kept[int(r)].counts["straggler"] += int(c)
        self.desyncs = self._desyncs(rows, by_start, lo)
        for d in self.desyncs:
            for r in d.odd:
                self.kept[r].desyncs.append(f"{d.pg} #{d.seq} ({d.kind})")
        self.kept = dict(sorted(self.kept.items()))
        self.group_ranks = self._group_ranks(rows)
        # the odd rows, desyncs and steps are found: let go of what only they read
        del self.med_start, self.med_end, self.threshold
        rows.flags = rows.call = rows.step = None  # type: ignore[assignment]
        self._flags = self._call = None  # type: ignore[assignment]
        if alike:
            self._alike(rows, by_start, lo)
        del rows, by_start
        self._inst = self._start = self._end = None  # type: ignore

    def _odd_rows(self, rows: _Rows) -> None:
        """Count, per rank, the instances where it starts late or early or ends apart from the
        typical rank by the tolerance or more, and its failed calls."""
        found: dict[str, list[np.ndarray]] = defaultdict(list)
        for a, b in rows.chunks():
            i, rank = rows.inst[a:b], rows.ranks(a, b)
            thr = self.threshold[i]                         # NaN: not timed, never odd
            off = rows.start[a:b] - self.med_start[i]
            found["late"].append(rank[off >= thr])
            found["early"].append(rank[-off >= thr])
            found["end"].append(rank[np.abs(rows.end[a:b] - self.med_end[i]) >= thr])
            found["failed"].append(rank[(rows.flags[a:b] & int(Flag.FAILED)) != 0])
        for reason, ranks in found.items():
            for r, c in zip(*np.unique(np.concatenate(ranks), return_counts=True)):
                self.kept[int(r)].counts[reason] += int(c)

    def _stragglers(self) -> None:
        """The review's rule per group (``merge.instances.mark_stragglers``): a late rank whose
        skew stands out, among the instances of more than one rank that are neither launches
        only, a pipeline's transfers (bubbles) nor the group's first ``WARMUP`` numbered
        collectives (start-up); ``threshold`` keeps each timed instance's bar (NaN: not
        timed). ``by_pg``: each group's instances by first start (ties in fold order)."""
        n = len(self)
        self.straggler = np.full(n, -1, dtype=np.int32)
        self.threshold = np.full(n, np.nan)
        pg = _column(self.pg, np.int32)
        order = _sort(np.arange(n), self.first_start, pg)
        untimed = int(Flag.LAUNCH_ONLY | Flag.PIPELINE)
        self.warmup = self._warmup()
        timed_all = (self.count > 1) & ((self.flags & untimed) == 0) & ~self.warmup
        skew_all = self.last_start - self.first_start
        self.by_pg: dict[str, np.ndarray] = {}
        for idx in _runs(order, pg[order]):
            self.by_pg[self.names.names[int(pg[idx[0]])]] = idx
            timed = idx[timed_all[idx]]
            if len(timed):
                skews = skew_all[timed]
                bars = np.asarray(straggler_thresholds(skews.tolist()), dtype=np.float64)
                self.threshold[timed] = bars
                out = timed[skews >= bars]
                self.straggler[out] = self.late_rank[out]

    def _warmup(self) -> np.ndarray:
        """Per instance: among its group's first ``WARMUP`` numbered collectives (by number)."""
        key_pg, key_seq = self.keys.numbered()
        warm = np.zeros(len(self), dtype=bool)
        idx = np.flatnonzero(key_pg >= 0)
        if len(idx):
            idx = idx[np.lexsort((key_seq[idx], key_pg[idx]))]
            starts = np.flatnonzero(np.r_[True, key_pg[idx][1:] != key_pg[idx][:-1]])
            place = np.arange(len(idx)) - np.repeat(starts, np.diff(np.r_[starts, len(idx)]))
            warm[idx[place < WARMUP]] = True
        return warm

    def _group_ranks(self, rows: _Rows) -> dict[str, np.ndarray]:
        """Per group, the ranks holding any of its rows (sorted)."""
        pg = _column(self.pg, np.int32)
        pairs = _unique_pairs(rows, pg, lambda a, b: np.ones(b - a, bool))[0]
        width = rows.width
        return {self.names.names[int(p[0] // width)]: (p % width).astype(np.int32)
                for p in _runs(pairs, pairs // width)}

    def _desyncs(self, rows: _Rows, by_start: np.ndarray, lo: np.ndarray) -> list[TableDesync]:
        """Each group's first disagreement (module docstring), over its numbered collectives."""
        key_pg, key_seq = self.keys.numbered()
        width = rows.width
        pairs, first, last = _unique_pairs(rows, key_pg, lambda a, b: key_pg[rows.inst[a:b]] >= 0,
                                           key_seq)
        if not len(pairs):
            return []
        present = set(self.hosts)
        numbered_ranks = set(np.unique(pairs % width).tolist())
        groups = len(self.names.names)
        # per group: the stretch every rank recorded [lo, hi], and its members' count
        g_lo, g_hi = np.full(groups, 1, np.int64), np.zeros(groups, np.int64)
        g_size = np.zeros(groups, np.int64)
        seen: dict[int, set[int]] = defaultdict(set)
        for p, a, b in zip(pairs.tolist(), first.tolist(), last.tolist()):
            g, r = divmod(p, width)
            g_lo[g] = a if g not in seen else max(int(g_lo[g]), a)
            g_hi[g] = b if g not in seen else max(int(g_hi[g]), b)
            seen[g].add(r)
        members: dict[int, set[int]] = {}
        for g, ranks in seen.items():
            info = self.pgs.get(self.names.names[g])
            listed = set(md.group_ranks(info.ranks)) if info is not None else set()
            members[g] = {r for r in listed | ranks if r in present and r in numbered_ranks}
            if len(members[g]) >= 2:
                g_size[g] = len(members[g])
            else:
                g_lo[g], g_hi[g] = 1, 0                  # nothing to line up
        ok = key_pg >= 0
        g = np.where(ok, key_pg, 0)
        uniform = np.ones(len(self), dtype=bool)
        for i0, i1, a, b in _instance_chunks(lo, self.count):
            calls, at = rows.call[by_start[a:b]], lo[i0:i1] - a
            uniform[i0:i1] = np.minimum.reduceat(calls, at) == np.maximum.reduceat(calls, at)
        bad = ok & (key_seq >= g_lo[g]) & (key_seq <= g_hi[g]) & (
            (self.count != g_size[g]) | ~uniform)
        found: dict[int, int] = {}
        for i, gi, si in zip(*(c.tolist() for c in (np.flatnonzero(bad), g[bad], key_seq[bad]))):
            if gi not in found or si < key_seq[found[gi]]:
                found[gi] = i
        return [self._desync(self.names.names[gi], members[gi], i, rows, by_start, lo)
                for gi, i in sorted(found.items(), key=lambda gi: self.names.names[gi[0]])]

    def _desync(self, pg: str, members: set[int], i: int, rows: _Rows, by_start: np.ndarray,
                lo: np.ndarray) -> TableDesync:
        """Instance ``i``'s sides: its members by call, and those with none."""
        mine = by_start[lo[i]:lo[i] + self.count[i]]
        by_call: dict[int | None, list[int]] = defaultdict(list)
        for r, c in zip(rows.rank(mine).tolist(), rows.call[mine].tolist()):
            by_call[c].append(r)
        lacking = members - {r for rs in by_call.values() for r in rs}
        if lacking:
            by_call[None] = sorted(lacking)
        sides = sorted(((tuple(sorted(rs)), c) for c, rs in by_call.items()),
                       key=lambda side: (-len(side[0]), side[1] is None, side[0]))
        calls = {c: (op, size) for (op, size, _), c in self._calls.items()}
        (a_ranks, a), (b_ranks, b) = sides[0], sides[1]
        if a is None or b is None:
            kind = DesyncKind.MISSING
        elif calls[a][0] != calls[b][0]:
            kind = DesyncKind.TYPE
        elif calls[a][1] != calls[b][1]:
            kind = DesyncKind.SIZE
        else:
            kind = DesyncKind.ARGS
        tied = len(b_ranks) == len(a_ranks)             # no majority: every side is odd
        odd = sorted(r for rs, _ in sides[0 if tied else 1:] for r in rs)
        return TableDesync(
            pg=pg, seq=self.keys.key(i).seq, kind=kind,
            sides=tuple(Side(rs, None if c is None else f"{calls[c][0]} {md.fmt_bytes(calls[c][1])}")
                        for rs, c in sides),
            odd=tuple(odd), ts_ns=int(self.first_start[i]))

    def _alike(self, rows: _Rows, by_start: np.ndarray, lo: np.ndarray) -> None:
        """Per instance, over its alike (not kept) ranks: how many; the median start and end
        (``a_start``, ``a_end``) and how far the earliest and latest are from them
        (``a_start_early``, ``a_start_late``, ``a_end_early``, ``a_end_late``); the median and
        longest wait (a rank waits from its start until the last rank arrives, or it leaves)."""
        n = len(self)
        kept = np.zeros(rows.width, dtype=bool)
        kept[list(self.kept)] = True
        self.folded = len(self.hosts) - len(self.kept)
        self.alike_count = np.zeros(n, np.int64)
        cols = [np.zeros(n, np.int64) for _ in range(8)]
        for i0, i1, a, b in _instance_chunks(lo, self.count):
            part = by_start[a:b]
            part = part[~kept[rows.rank(part)]]         # alike rows, by instance, then start
            local = rows.inst[part]
            count = np.bincount(local - i0, minlength=i1 - i0)
            self.alike_count[i0:i1] = count
            has = np.flatnonzero(count)
            at = _segments(count)[has]
            ends = at + count[has] - 1
            mid = at + (count[has] - 1) // 2
            start, end = rows.start[part], rows.end[part]
            wait = np.minimum(self.last_start[local], end) - start
            np.maximum(wait, 0, out=wait)
            end = end[np.lexsort((end, local))]
            wait = wait[np.lexsort((wait, local))]
            for col, values, pick in zip(cols, (start, start, start, end, end, end, wait, wait),
                                         (at, mid, ends) * 2 + (mid, ends)):
                col[i0 + has] = values[pick]
        first, self.a_start, last, e_first, self.a_end, e_last, self.a_wait, self.a_wait_max = cols
        # in place: each spread where its bound was (no second set of columns)
        self.a_start_early = np.subtract(self.a_start, first, out=first)
        self.a_start_late = np.subtract(last, self.a_start, out=last)
        self.a_end_early = np.subtract(self.a_end, e_first, out=e_first)
        self.a_end_late = np.subtract(e_last, self.a_end, out=e_last)


class _Rows:
    """The fold's rows as numpy columns (no copies), with the rank of each row."""

    def __init__(self, fold: Fold) -> None:
        self.inst = _column(fold._inst, np.int32)
        self.start, self.end = _column(fold._start, np.int64), _column(fold._end, np.int64)
        self.flags, self.call = _column(fold._flags, np.uint8), _column(fold._call, np.int32)
        per_table = np.asarray(fold._table_rows, dtype=np.int64)
        self._table_rank = np.asarray(fold._table_rank, dtype=np.int32)
        self.width = int(self._table_rank.max()) + 1 if len(self._table_rank) else 0
        self._tables = np.concatenate(([0], np.cumsum(per_table)))
        # after the ranks: it reads them; None: no rank has steps (every row outside them)
        self.step = _row_steps(fold.steps, self) if fold.steps else None

    def rank(self, rows: np.ndarray) -> np.ndarray:
        """The rank of each of ``rows`` (row numbers): its table's (a column of every row's
        rank would be 76 MB at 131,072 ranks)."""
        return self._table_rank[np.searchsorted(self._tables, rows, side="right") - 1]

    def ranks(self, a: int, b: int) -> np.ndarray:
        """The rank of each row in [a, b)."""
        first, last = (int(np.searchsorted(self._tables, x, side="right")) - 1 for x in (a, b - 1))
        return np.repeat(self._table_rank[first:last + 1],
                         np.diff(np.clip(self._tables[first:last + 2], a, b)))

    def chunks(self) -> Iterator[tuple[int, int]]:
        """Row ranges of about ``CHUNK`` rows, each holding whole tables."""
        a, total = 0, int(self._tables[-1])
        while a < total:
            k = int(np.searchsorted(self._tables, a + CHUNK, side="right")) - 1
            b = int(self._tables[k])
            if b <= a:                                  # one table of more than CHUNK rows
                b = int(self._tables[np.searchsorted(self._tables, a, side="right")])
            yield a, b
            a = b


def _row_steps(steps: dict[int, list[Step]], rows: _Rows) -> np.ndarray:
    """Each row's profiler step number (-1: outside every step of its rank), for every row at
    once: a row and its rank's steps share one sort key, rank * span + time from the rank's
    first step."""
    out = np.full(len(rows.inst), -1, np.int32)
    ranks = np.array([r for r in steps for _ in steps[r]], dtype=np.int64)
    n, lo, hi = (np.array([getattr(s, f) for r in steps for s in steps[r]], dtype=np.int64)
                 for f in ("n", "start_ns", "end_ns"))
    base = np.zeros(rows.width, np.int64)
    has = np.zeros(rows.width, bool)
    for r, mine in steps.items():
        if r < rows.width:
            base[r], has[r] = min(s.start_ns for s in mine), True
    keep = ranks < rows.width
    ranks, n, lo, hi = ranks[keep], n[keep], lo[keep], hi[keep]
    span = int((hi - base[ranks]).max()) + 1 if len(hi) else 1
    key = ranks * span + (lo - base[ranks])
    order = np.argsort(key, kind="stable")
    key, n, hi, ranks = key[order], n[order], hi[order], ranks[order]
    for a, b in rows.chunks():
        rank, start = rows.ranks(a, b).astype(np.int64), rows.start[a:b]
        rel = start - base[rank]
        at = np.searchsorted(key, rank * span + np.clip(rel, 0, span - 1), side="right") - 1
        at = np.maximum(at, 0)
        inside = has[rank] & (rel >= 0) & (rel < span) & (ranks[at] == rank) & (start < hi[at])
        out[a:b] = np.where(inside, n[at], -1)
    return out


def _by_instance(rows: _Rows, lo: np.ndarray) -> np.ndarray:
    """The rows ordered by instance, in row order within one (a stable sort), as int32 and a
    chunk of rows at a time (a whole-run argsort holds an int64 permutation besides)."""
    out = np.empty(len(rows.inst), np.int32)
    fill = lo.copy()
    for a, b in rows.chunks():
        inst = rows.inst[a:b]
        order = np.argsort(inst, kind="stable")
        ordered = inst[order]
        new = np.r_[True, ordered[1:] != ordered[:-1]]
        heads = np.flatnonzero(new)
        within = np.arange(len(order)) - heads[np.cumsum(new) - 1]
        out[fill[ordered] + within] = order + a
        fill[ordered[heads]] += np.diff(np.r_[heads, len(order)])
    return out


def _instance_chunks(lo: np.ndarray, count: np.ndarray) -> Iterator[tuple[int, int, int, int]]:
    """Instance ranges [i0, i1) of about ``CHUNK`` rows once sorted by instance, with their
    rows' range [a, b) there."""
    n = len(count)
    bounds = np.append(lo, lo[-1] + count[-1]) if n else np.zeros(1, np.int64)
    i0 = 0
    while i0 < n:
        i1 = int(np.searchsorted(bounds, bounds[i0] + CHUNK, side="right")) - 1
        i1 = max(i0 + 1, min(i1, n))
        yield i0, i1, int(bounds[i0]), int(bounds[i1])
        i0 = i1


def _unique_pairs(rows: _Rows, group: np.ndarray, pick: Callable[[int, int], np.ndarray],
                  seq: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The (group, rank) pairs of the picked rows, as group * width + rank, sorted; with
    ``seq`` (per instance), each pair's lowest and highest sequence number. A table holds one
    rank, so a pair never spans two chunks."""
    keys, firsts, lasts = [], [], []
    for a, b in rows.chunks():
        m = pick(a, b)
        inst = rows.inst[a:b][m]
        pair = group[inst].astype(np.int64) * rows.width + rows.ranks(a, b)[m]
        if seq is None:
            keys.append(np.unique(pair))
            continue
        s = seq[inst]
        order = np.lexsort((s, pair))
        pair, s = pair[order], s[order]
        cut = np.flatnonzero(np.diff(pair)) + 1
        head = np.concatenate(([0], cut)).astype(np.int64)
        tail = np.concatenate((cut - 1, [len(pair) - 1])).astype(np.int64)
        keys.append(pair[head] if len(pair) else pair)
        firsts.append(s[head] if len(pair) else s)
        lasts.append(s[tail] if len(pair) else s)
    if seq is None:
        return (np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64),)
    if not keys:
        return tuple(np.zeros(0, np.int64) for _ in range(3))
    return np.concatenate(keys), np.concatenate(firsts), np.concatenate(lasts)


def _column(values: array, dtype: type) -> np.ndarray:
    """An ``array`` column as numpy, without a copy."""
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype)


def _sort(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort`` (last key first), as int32: half the memory of a row permutation."""
    return np.lexsort(keys).astype(np.int32)


def _runs(values: np.ndarray, by: np.ndarray) -> list[np.ndarray]:
    """``values`` cut where the (sorted) ``by`` changes."""
    if not len(values):
        return []
    return np.split(values, np.flatnonzero(np.diff(by)) + 1)


def _segments(count: np.ndarray) -> np.ndarray:
    """Where each instance's rows begin once sorted by instance (``count`` rows each)."""
    lo = np.zeros(len(count), dtype=np.int64)
    np.cumsum(count[:-1], out=lo[1:])
    return lo
