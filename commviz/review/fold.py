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
every rank recorded, as ``review.desync`` does with the full records; a table holds each
call's op, bytes and nccl-tests type (not its dtype, root or reduction), so those must agree,
and every member of the group present in the run must hold the number.

Memory: five columns per row (25 bytes: 53 MB for the 2.1M rows of 16,384 ranks x 130
collectives) and a few per instance; the numbers are worked out with numpy, once.
"""

from __future__ import annotations

from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from commviz import metadata as md
from commviz.match.artifact import PgInfo
from commviz.match.model import InstanceKey, KeyKind
from commviz.merge.instances import parse_ranks, straggler_thresholds
from commviz.merge.table import CommTable, Flag
from commviz.review.desync import DesyncKind


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
        self._pg = array("i")           # per index: the key's group (dense keys), else -1
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
        # ``_dense`` inlined (one call per row); its range check is ``_place``'s
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

    def numbered(self) -> tuple[np.ndarray, np.ndarray]:
        """Per index: the group (a ``Names`` id; -1: not a group's numbered collective) and
        the sequence number."""
        return (np.frombuffer(self._pg, dtype=np.int32) if self._pg else np.zeros(0, np.int32),
                np.frombuffer(self._seq, dtype=np.int64) if self._seq else np.zeros(0, np.int64))


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
        sides = "; ".join(f"ranks {ranks_text(s.ranks)}: {s.call or 'nothing'}"
                          for s in self.sides)
        return f"process group {self.pg} first differs at seq {self.seq} [{self.kind}]: {sides}"


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as runs, the way a person reads a large group: ``0-4095``, ``13-16381 step 8``,
    ``0-4, 6-16381, 16383`` (a run of three or more with one step, as torch's own "global rank
    start" and "stride" describe a group; ``a-b`` has step 1)."""
    t = sorted(set(ranks))
    out, i = [], 0
    while i < len(t):
        if i + 2 < len(t) and t[i + 1] - t[i] == t[i + 2] - t[i + 1]:
            step, j = t[i + 1] - t[i], i + 2
            while j + 1 < len(t) and t[j + 1] - t[j] == step:
                j += 1
            out.append(f"{t[i]}-{t[j]}" + (f" step {step}" if step != 1 else ""))
            i = j + 1
        elif i + 1 < len(t) and t[i + 1] == t[i] + 1:
            out.append(f"{t[i]}-{t[i + 1]}")
            i += 2
        else:
            out.append(str(t[i]))
            i += 1
    return ", ".join(out)


REASONS = ("straggler", "late", "early", "end", "failed")


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
        self.rows = 0

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.hosts)

    def add(self, table: CommTable) -> None:
        rank = table.rank
        self.hosts[rank] = table.host
        for pg, info in table.pgs.items():
            self.pgs.setdefault(pg, info)
        find, calls = self.keys.find, self._calls
        inst, call = [], []
        for pg, op, key, _start, _end, size, ctype, _flags, origin in table.rows:
            i = find(key)
            if i is None:
                i = self._new(key, pg, op, ctype, origin)
            inst.append(i)
            sig = (op, size, ctype)
            c = calls.get(sig)
            if c is None:
                c = calls[sig] = len(calls)
            call.append(c)
        rows = table.rows
        self._inst.extend(inst)
        self._call.extend(call)
        self._start.extend([r[3] for r in rows])
        self._end.extend([r[4] for r in rows])
        self._flags.extend([int(r[7]) for r in rows])
        self._table_rank.append(rank)
        self._table_rows.append(len(rows))
        self.rows += len(rows)

    def _new(self, key: InstanceKey, pg: str, op: str, ctype: str, origin: str | None) -> int:
        i = self.keys.add(key)
        name = self.names.id
        self.pg.append(name(pg))
        self.op.append(name(op))
        self.ctype.append(name(ctype))
        self.origin.append(-1 if origin is None else name(origin))
        return i

    # -- after the last table -------------------------------------------------------------------
    def finish(self, *, alike: bool) -> None:
        """Per instance: count, first/last start, last end, late rank, flags, size, straggler,
        the typical rank's start and end, the tolerance; the desyncs and the kept ranks; with
        ``alike``, the folded (alike) ranks' times per instance. The rows are let go."""
        n = len(self)
        inst = _column(self._inst, np.int32)
        start, end = _column(self._start, np.int64), _column(self._end, np.int64)
        flags, call = _column(self._flags, np.uint8), _column(self._call, np.int32)
        rank = np.repeat(np.asarray(self._table_rank, dtype=np.int32),
                         np.asarray(self._table_rows, dtype=np.int64))
        self.count = np.bincount(inst, minlength=n)
        lo = _segments(self.count)
        hi = lo + self.count - 1
        mid = lo + (self.count - 1) // 2
        by_start = _sort(rank, start, inst)                  # each instance's rows by arrival
        self.first_start, self.last_start = start[by_start[lo]], start[by_start[hi]]
        self.med_start = start[by_start[mid]]
        self.late_rank = rank[by_start[hi]]                  # the last (start, rank)
        by_end = _sort(end, inst)
        self.last_end, self.med_end = end[by_end[hi]], end[by_end[mid]]
        self.flags = np.bitwise_or.reduceat(flags[by_start], lo) if n else flags
        sizes = np.array([-1 if size is None else max(size, 0) for _, size, _ in self._calls],
                         dtype=np.int64)
        self.size = np.maximum.reduceat(sizes[call[by_start]], lo) if n else lo
        self._stragglers()
        self.kept: dict[int, Kept] = defaultdict(Kept)
        self._odd_rows(inst, start, end, flags, rank)
        for r, c in zip(*np.unique(self.straggler[self.straggler >= 0], return_counts=True)):
            self.kept[int(r)].counts["straggler"] += int(c)
        self.desyncs = self._desyncs(inst, rank, call, by_start, lo)
        for d in self.desyncs:
            for r in d.odd:
                self.kept[r].desyncs.append(f"{d.pg} #{d.seq} ({d.kind})")
        self.kept = dict(sorted(self.kept.items()))
        self.group_ranks = self._group_ranks(inst, rank)
        if alike:
            self._alike(inst, start, end, rank, by_start, by_end)
        del inst, start, end, flags, call, by_start, by_end
        self._inst = self._start = self._end = self._flags = self._call = None  # type: ignore

    def _odd_rows(self, inst: np.ndarray, start: np.ndarray, end: np.ndarray,
                  flags: np.ndarray, rank: np.ndarray) -> None:
        """Count, per rank, the instances where it starts late or early or ends apart from the
        typical rank by the tolerance or more, and its failed calls."""
        thr = self.threshold[inst]                          # NaN: not timed, never odd
        off = (start - self.med_start[inst]).astype(np.float64)
        masks = {"late": off >= thr, "early": -off >= thr}
        off = np.abs(end - self.med_end[inst]).astype(np.float64)
        masks["end"] = off >= thr
        del off, thr
        masks["failed"] = (flags & int(Flag.FAILED)) != 0
        for reason, mask in masks.items():
            for r, c in zip(*np.unique(rank[mask], return_counts=True)):
                self.kept[int(r)].counts[reason] += int(c)

    def _stragglers(self) -> None:
        """The review's rule per group (``merge.instances``): a late rank whose skew stands
        out; ``threshold`` keeps each timed instance's bar (NaN: not timed). ``by_pg``: each
        group's instances by first start (ties in fold order)."""
        n = len(self)
        self.straggler = np.full(n, -1, dtype=np.int32)
        self.threshold = np.full(n, np.nan)
        pg = _column(self.pg, np.int32)
        order = _sort(np.arange(n), self.first_start, pg)
        timed_all = (self.count > 1) & ((self.flags & int(Flag.LAUNCH_ONLY)) == 0)
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

    def _group_ranks(self, inst: np.ndarray, rank: np.ndarray) -> dict[str, np.ndarray]:
        """Per group, the ranks holding any of its rows (sorted)."""
        if not len(inst):
            return {}
        width = int(rank.max()) + 1
        pairs = np.unique(_column(self.pg, np.int32)[inst].astype(np.int64) * width + rank)
        return {self.names.names[int(p[0] // width)]: (p % width).astype(np.int32)
                for p in _runs(pairs, pairs // width)}

    def _desyncs(self, inst: np.ndarray, rank: np.ndarray, call: np.ndarray,
                 by_start: np.ndarray, lo: np.ndarray) -> list[TableDesync]:
        """Each group's first disagreement (module docstring), over its numbered collectives."""
        key_pg, key_seq = self.keys.numbered()
        numbered = key_pg[inst] >= 0
        if not numbered.any():
            return []
        present = set(self.hosts)
        numbered_ranks = set(np.unique(rank[numbered]).tolist())
        width = int(rank.max()) + 1
        pair = key_pg[inst[numbered]].astype(np.int64) * width + rank[numbered]
        seq = key_seq[inst[numbered]]
        order = _sort(seq, pair)
        pair, seq = pair[order], seq[order]
        del order
        groups = len(self.names.names)
        # per group: the stretch every rank recorded [lo, hi], and its members' count
        g_lo, g_hi = np.full(groups, 1, np.int64), np.zeros(groups, np.int64)
        g_size = np.zeros(groups, np.int64)
        seen: dict[int, set[int]] = defaultdict(set)
        for run in _runs(np.arange(len(pair)), pair):
            g, r = divmod(int(pair[run[0]]), width)
            first, last = int(seq[run[0]]), int(seq[run[-1]])
            g_lo[g] = first if g not in seen else max(g_lo[g], first)
            g_hi[g] = last if g not in seen else max(g_hi[g], last)
            seen[g].add(r)
        members: dict[int, set[int]] = {}
        for g, ranks in seen.items():
            info = self.pgs.get(self.names.names[g])
            listed = set(parse_ranks(info.ranks)) if info is not None else set()
            members[g] = {r for r in listed | ranks if r in present and r in numbered_ranks}
            if len(members[g]) >= 2:
                g_size[g] = len(members[g])
            else:
                g_lo[g], g_hi[g] = 1, 0                  # nothing to line up
        ok = key_pg >= 0
        g = np.where(ok, key_pg, 0)
        calls = call[by_start]
        uniform = np.minimum.reduceat(calls, lo) == np.maximum.reduceat(calls, lo)
        bad = ok & (key_seq >= g_lo[g]) & (key_seq <= g_hi[g]) & (
            (self.count != g_size[g]) | ~uniform)
        first: dict[int, int] = {}
        for i, gi, si in zip(*(a.tolist() for a in (np.flatnonzero(bad), g[bad], key_seq[bad]))):
            if gi not in first or si < key_seq[first[gi]]:
                first[gi] = i
        return [self._desync(self.names.names[gi], members[gi], i, rank, call, by_start, lo)
                for gi, i in sorted(first.items(), key=lambda gi: self.names.names[gi[0]])]

    def _desync(self, pg: str, members: set[int], i: int, rank: np.ndarray, call: np.ndarray,
                by_start: np.ndarray, lo: np.ndarray) -> TableDesync:
        """Instance ``i``'s sides: its members by call, and those with none."""
        rows = by_start[lo[i]:lo[i] + self.count[i]]
        by_call: dict[int | None, list[int]] = defaultdict(list)
        for r, c in zip(rank[rows].tolist(), call[rows].tolist()):
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

    def _alike(self, inst: np.ndarray, start: np.ndarray, end: np.ndarray, rank: np.ndarray,
               by_start: np.ndarray, by_end: np.ndarray) -> None:
        """Per instance, over its alike (not kept) ranks: how many, and the min, median and
        max of their starts, ends and waits (a rank waits from its start until the last rank
        arrives, or until it leaves)."""
        n = len(self)
        kept = np.zeros(int(rank.max()) + 1 if len(rank) else 0, dtype=bool)
        kept[list(self.kept)] = True
        self.folded = len(self.hosts) - len(self.kept)
        alike_row = ~kept[rank]
        self.alike_count = np.bincount(inst[alike_row], minlength=n)
        has = self.alike_count > 0
        lo = _segments(self.alike_count)[has]
        hi = lo + self.alike_count[has] - 1
        mid = lo + (self.alike_count[has] - 1) // 2

        def spread(order: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, ...]:
            v = values[order[alike_row[order]]]        # alike rows, still in instance order
            cols = tuple(np.zeros(n, dtype=np.int64) for _ in range(3))
            for col, at in zip(cols, (lo, mid, hi)):
                col[has] = v[at]
            return cols

        self.a_start = spread(by_start, start)
        self.a_end = spread(by_end, end)
        wait = np.minimum(self.last_start[inst], end)
        wait -= start
        np.maximum(wait, 0, out=wait)
        self.a_wait = spread(_sort(wait, inst), wait)


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
