"""``commviz diff RUN_A RUN_B``: what changed between two runs, per origin, from the comm tables.

"This run is slower than last week's: why?" Each run's comm tables (``merge.table``: every
collective of every rank, with its origin and profiler step) are read into the overview's
columns (``review.fold``: per instance its comm time, waits, skew, late rank, step), and
summed up per key (``BY``: the origin, the unit it serves, the process group, the op), per
rank and per step, so runs of other rank and step counts compare, and read off the median
step (a step the machine stalled moves it little):

- *comm*: each rank's time in the key's collectives once every rank had arrived (the
  review's ``comm``, ``merge.instances``); *wait*: its time waiting for the last rank;
- both per rank (summed over the ranks, divided by the run's ranks) and per profiler step
  (the ``ProfilerStep#N`` ranges each table holds; a run without any is one step, whole);
- bus bandwidth (nccl-tests' factors, ``merge.bandwidth``), the arrival skew's p50 and p99,
  and the late ranks: whose late arrival the waits were spent on.

Groups are matched across runs by what they are, not by torch's numbers (which follow the
order groups were made in): their description ("tp"), the world, or for a group made without
one its rank pattern ("8-rank groups" of contiguous ranks, "groups of stride 8"). A group's
first collective (its warm-up: the ranks' start-up, ``merge.instances.WARMUP``) is left out
of a run compared whole (one without profiler steps).
A key's change is a regression only outside the noise (``NoiseRule``): the spread of its
per-step times within each run (standard errors of the two means), a share of its time in A,
and a floor; each regression is split into more transfer time and more waiting, naming the
late rank(s) the new waiting was for.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from commviz import metadata as md
from commviz.errors import CommvizError, SourceError
from commviz.live.cause import Straggler
from commviz.match.artifact import PgInfo
from commviz.match.matched import matched_run
from commviz.merge import bandwidth as bw
from commviz.merge.instances import STRAGGLER_MIN_NS, bandwidth_ranks
from commviz.merge.table import CommTable, Flag, from_artifact, iter_tables, table_ranks
from commviz.review import roots
from commviz.review.fold import Fold

ORIGIN, UNIT, GROUP, OP = "origin", "unit", "group", "op"
BY = (ORIGIN, UNIT, GROUP, OP)
NONE = "-"                      # instances whose ranks recorded no origin
WORLD = "world"
DEFAULT_PG = "default_pg"       # torch's description of the world group
LATE_SHARE = 0.25               # a late rank named for a wait is behind this share of its growth
LATE_RANKS_SHOWN = 8
SHOWN = 3                       # groups, ops and sizes listed per key


# A median's standard error is this times sigma / sqrt(n) (normal data); sigma is this times
# the median absolute deviation.
MEDIAN_SE, MAD_SIGMA = math.sqrt(math.pi / 2), 1.4826


@dataclass(frozen=True, slots=True)
class NoiseRule:
    """When a key's change counts: its median step (per rank) moved by more than ``se``
    standard errors of the two medians (from each run's step-to-step spread, robustly: a step
    a busy machine stalled moves a median little), more than ``rel`` of its time in A, and at
    least ``min_ns`` (the review's straggler floor: shorter is jitter)."""

    se: float = 3.0
    rel: float = 0.10
    min_ns: int = STRAGGLER_MIN_NS

    def bar(self, a: Side, b: Side) -> float:
        spread = MEDIAN_SE * math.sqrt(a.spread_ns ** 2 / a.steps + b.spread_ns ** 2 / b.steps)
        return max(self.se * spread, self.rel * a.time_ns, float(self.min_ns))

    @property
    def text(self) -> str:
        return (f"a key's median step counts as changed when it moved by more than {self.se:g} "
                f"standard errors (from each run's step-to-step spread), {self.rel:.0%} of A and "
                f"{self.min_ns / 1e6:g} ms")


@dataclass(slots=True)
class Side:
    """One key in one run, per rank in its median step (times in ns)."""

    calls_per_step: float               # per rank, the mean
    time_ns: float                      # comm + wait, the median step's
    comm_ns: float                      # the median step's comm
    wait_ns: float                      # the median step's wait
    steps: int
    spread_ns: float                    # sigma of time over the steps, from their MAD (0: one)
    busbw_gbps: float | None
    skew_p50_ns: int | None
    skew_p99_ns: int | None
    late: dict[int, float]              # late rank -> wait spent on it, per rank and step
    groups: list[str]
    ops: list[str]
    sizes: list[int]


@dataclass(slots=True)
class RunSide:
    """One run summed up per key."""

    run_dir: Path
    ranks: int
    steps: list[int]                    # the profiler steps compared (empty: the whole run)
    instances: int                      # instances compared
    outside: int                        # instances left out: outside the steps, or warm-ups
    keys: dict[str, Side]
    problems: list[str] = field(default_factory=list)
    named: dict[str, list[Straggler]] = field(default_factory=dict)   # key -> its roots


class Change(md.StrEnum):
    """What happened to a key between A and B."""

    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    UNCHANGED = "unchanged"
    ONLY_A = "only in A"
    ONLY_B = "only in B"


@dataclass(slots=True)
class Row:
    """One key compared."""

    key: str
    a: Side | None
    b: Side | None
    change: Change
    noise_ns: float | None = None
    late_ranks: list[int] = field(default_factory=list)   # whom B's added waiting was for
    named: list[Straggler] = field(default_factory=list)  # B's roots there (``review.roots``)

    @property
    def delta_ns(self) -> float:
        return (self.b.time_ns if self.b else 0.0) - (self.a.time_ns if self.a else 0.0)

    @property
    def delta_comm_ns(self) -> float:
        return (self.b.comm_ns if self.b else 0.0) - (self.a.comm_ns if self.a else 0.0)

    @property
    def delta_wait_ns(self) -> float:
        return (self.b.wait_ns if self.b else 0.0) - (self.a.wait_ns if self.a else 0.0)

    @property
    def cause(self) -> str:
        """The cause of B's costliest root there ("late", "transfer", "pause"); with none named,
        what most of the change is: "transfer" (comm time) or "waiting" (for late ranks)."""
        if self.named:
            return str(self.named[0].cause)
        return "waiting" if abs(self.delta_wait_ns) > abs(self.delta_comm_ns) else "transfer"


@dataclass(slots=True)
class Diff:
    a: RunSide
    b: RunSide
    by: str
    rule: NoiseRule
    rows: list[Row]                     # regressions worst first, then the others (``ORDER``)

    def of(self, change: Change) -> list[Row]:
        return [r for r in self.rows if r.change is change]


ORDER = (Change.REGRESSION, Change.IMPROVEMENT, Change.ONLY_B, Change.ONLY_A, Change.UNCHANGED)


# -- one run -----------------------------------------------------------------------------------

def read_fold(run_dir: str | os.PathLike[str]) -> tuple[Fold, list[str], list[Straggler]]:
    """Every rank's comm table of a run, folded, and the run's roots; a table that cannot be
    read is an error naming it (a comparison missing ranks would mislead), the tables' own
    problems notes. Without tables, each rank's from its record (``commviz report``'s way)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise SourceError(str(run), "not a run dir (no such directory)")
    ranks = table_ranks(run)
    unreadable: list[str] = []
    notes: list[str] = []
    tables = iter_tables(run, ranks, unreadable) if ranks else _from_records(run, notes)
    fold = Fold()
    for table in tables:
        fold.add(table)
        notes += [f"rank {table.rank}: {p}" for p in table.problems]
    if unreadable:
        raise SourceError(str(run), f"{len(unreadable)} of {len(ranks)} ranks cannot be "
                                    f"compared: {unreadable[0]}")
    calls = fold.calls()
    fold.finish(alike=False)
    return fold, notes, roots.name(fold, calls)


def _from_records(run: Path, notes: list[str]) -> list[CommTable]:
    """Each rank's table made from its records (a run dir no merge or launch left tables in)."""
    matched = matched_run(run)
    if not matched.ranks:
        why = "; ".join(matched.problems) or "no commviz records and no profiler traces"
        raise SourceError(str(run), f"nothing to compare: {why}")
    notes += matched.problems
    return [from_artifact(art) for _, art in sorted(matched.ranks.items())]


def group_kind(pg: str, info: PgInfo | None) -> str:
    """A group as it is matched across runs: its description, "world", or for a group made
    without one its rank pattern: "8-rank groups" (contiguous), "groups of stride 8"."""
    desc = info.desc if info is not None else None
    if desc == DEFAULT_PG or pg == "0" and not desc:
        return WORLD
    if desc and desc != md.UNDESCRIBED:
        return str(desc)
    ranks = md.group_ranks(info.ranks if info is not None else None)
    if not ranks:
        return f"group {md.pg_shown(pg)}"
    gaps = set(np.diff(ranks).tolist())
    if gaps <= {1}:                    # contiguous: its size says what it is (a TP group)
        return f"{len(ranks)}-rank groups"
    if len(gaps) == 1:                 # strided: its stride does (DP across TP), whatever the size
        return f"groups of stride {gaps.pop()}"
    return f"{len(ranks)}-rank groups, ranks {md.ranks_text(ranks)}"


def _labels(fold: Fold, by: str) -> tuple[np.ndarray, list[str]]:
    """Per instance the index of its key, and the keys."""
    names = fold.names.names
    if by in (ORIGIN, UNIT):
        raw = np.asarray(fold.origin, dtype=np.int64)

        def label(i: int) -> str:
            origin = names[i] if i >= 0 else NONE
            return fold.units.get(origin, origin) if by == UNIT else origin
    elif by == GROUP:
        raw = np.asarray(fold.pg, dtype=np.int64)

        def label(i: int) -> str:
            return group_kind(names[i], fold.pgs.get(names[i]))
    elif by == OP:
        raw = np.asarray(fold.op, dtype=np.int64)

        def label(i: int) -> str:
            return names[i]
    else:
        raise ValueError(f"unknown --by {by!r} (one of {', '.join(BY)})")
    uniq, inv = np.unique(raw, return_inverse=True)
    keys: dict[str, int] = {}
    lut = np.array([keys.setdefault(label(int(u)), len(keys)) for u in uniq], dtype=np.int64)
    return lut[inv].reshape(-1), list(keys)


def _group_sizes(fold: Fold, count: np.ndarray) -> np.ndarray:
    """Per instance the ranks in its bus bandwidth factor (``instances.bandwidth_ranks``)."""
    names = fold.names.names
    size = np.array([len(md.group_ranks(fold.pgs[n].ranks)) if n in fold.pgs else 0
                     for n in names], dtype=np.int64)
    key_pg, _ = fold.keys.numbered()
    out = np.where(key_pg >= 0, size[np.maximum(key_pg, 0)], 0)
    for i in np.flatnonzero(key_pg < 0).tolist():
        out[i] = bandwidth_ranks(fold.keys.key(i), int(size[fold.pg[i]]))
    return np.where(out > 0, out, count)


def _factors(fold: Fold, n: np.ndarray) -> np.ndarray:
    """Per instance nccl-tests' bus factor (NaN: none)."""
    names = fold.names.names
    ctype = np.asarray(fold.ctype, dtype=np.int64)
    pairs, inv = np.unique(ctype * (1 << 32) + n, return_inverse=True)
    f = [bw.bus_factor(names[int(p >> 32)], int(p & 0xFFFFFFFF)) for p in pairs.tolist()]
    return np.array([np.nan if x is None else x for x in f])[inv.reshape(-1)]


def summarise(fold: Fold, by: str, run_dir: Path, problems: list[str],
              named: list[Straggler] | None = None) -> RunSide:
    """The run's keys, per rank and step, over the instances inside its profiler steps."""
    ranks = max(len(fold.hosts), 1)
    numbers = sorted({s.n for steps in fold.steps.values() for s in steps})
    key, labels = _labels(fold, by)
    count = fold.count.astype(np.int64)
    if numbers:
        keep = np.flatnonzero(fold.step >= 0)
        step = np.searchsorted(np.asarray(numbers), fold.step[keep])
    else:        # less each group's first collective, its warm-up: its waits are start-up
        keep = np.flatnonzero(~fold.warmup)
        step = np.zeros(len(keep), dtype=np.int64)
    n_steps = max(len(numbers), 1)
    untimed = (fold.flags[keep] & int(Flag.LAUNCH_ONLY | Flag.FAILED)) != 0
    comm = np.where(untimed, 0, fold.last_end[keep] - fold.last_start[keep]).clip(0)
    comm_ranks = comm * count[keep]                           # each of its ranks spent it
    wait = fold.wait[keep]
    k = key[keep]
    K = len(labels)
    comm_s, wait_s = (np.bincount(k * n_steps + step, weights=w, minlength=K * n_steps)
                      .reshape(K, n_steps) / ranks for w in (comm_ranks, wait))
    total = np.median(comm_s + wait_s, axis=1)
    spread = MAD_SIGMA * np.median(np.abs(comm_s + wait_s - total[:, None]), axis=1)
    comm_k, wait_k = np.median(comm_s, axis=1), np.median(wait_s, axis=1)
    rows_k = np.bincount(k, weights=count[keep], minlength=K)
    bus = (fold.size * _factors(fold, _group_sizes(fold, count)))[keep]
    timed = (comm > 0) & (fold.size[keep] > 0) & ~np.isnan(bus)
    bus_k = np.bincount(k[timed], weights=bus[timed], minlength=K)
    bus_t = np.bincount(k[timed], weights=comm[timed], minlength=K)
    skews = _percentiles(k, fold.last_start[keep] - fold.first_start[keep], count[keep] > 1, K)
    late = _late(k, fold.late_rank[keep], wait, ranks * n_steps)
    names = fold.names.names
    groups = _shown(k, np.asarray(fold.pg)[keep], K,
                    lambda g: group_kind(names[g], fold.pgs.get(names[g])))
    ops = _shown(k, np.asarray(fold.op)[keep], K, lambda o: names[o])
    sizes = _shown(k, fold.size[keep], K, int, skip=-1)
    keys = {}
    for i, label in enumerate(labels):
        if not rows_k[i]:
            continue                              # only outside the steps
        keys[label] = Side(
            calls_per_step=float(rows_k[i]) / ranks / n_steps, time_ns=float(total[i]),
            comm_ns=float(comm_k[i]), wait_ns=float(wait_k[i]), steps=n_steps,
            spread_ns=float(spread[i]),
            busbw_gbps=float(bus_k[i] / bus_t[i]) if bus_t[i] else None,
            skew_p50_ns=skews[i][0], skew_p99_ns=skews[i][1], late=late.get(i, {}),
            groups=groups[i], ops=ops[i], sizes=sizes[i])
    return RunSide(run_dir=run_dir, ranks=len(fold.hosts), steps=numbers,
                   instances=len(keep), outside=len(fold) - len(keep), keys=keys,
                   problems=problems, named=_named_by_key(fold, by, named or []))


def _named_by_key(fold: Fold, by: str, named: list[Straggler]) -> dict[str, list[Straggler]]:
    """The roots under the key their origin and group fall in (``by``)."""
    names = fold.names.names
    ops: dict[tuple[str, str], str] = {}
    if by == OP and named:
        for pg, origin, op in set(zip(fold.pg, fold.origin, fold.op)):
            ops[names[pg], names[origin] if origin >= 0 else NONE] = names[op]
    out: dict[str, list[Straggler]] = {}
    for s in named:
        key = {ORIGIN: s.origin, UNIT: fold.units.get(s.origin, s.origin),
               GROUP: group_kind(s.group, fold.pgs.get(s.group)),
               OP: ops.get((s.group, s.origin), NONE)}[by]
        out.setdefault(key, []).append(s)
    return out


def _percentiles(k: np.ndarray, skew: np.ndarray, multi: np.ndarray, K: int
                 ) -> list[tuple[int | None, int | None]]:
    """Per key the p50 and p99 of its instances' skews (nearest rank; None: no instance of
    more than one rank)."""
    out: list[tuple[int | None, int | None]] = [(None, None)] * K
    k, skew = k[multi], skew[multi]
    order = np.lexsort((skew, k))
    k, skew = k[order], skew[order]
    bounds = np.flatnonzero(np.diff(k)) + 1
    for part_k, part in zip(np.split(k, bounds), np.split(skew, bounds)):
        if len(part):
            n = len(part) - 1
            out[int(part_k[0])] = (int(part[round(0.5 * n)]), int(part[math.ceil(0.99 * n)]))
    return out


def _late(k: np.ndarray, late: np.ndarray, wait: np.ndarray, per: int
          ) -> dict[int, dict[int, float]]:
    """Per key: late rank -> the wait spent on it, per rank and step."""
    m = wait > 0
    width = int(late.max()) + 1 if len(late) else 1
    pairs, inv = np.unique(k[m] * width + late[m], return_inverse=True)
    sums = np.bincount(inv.reshape(-1), weights=wait[m], minlength=len(pairs))
    out: dict[int, dict[int, float]] = {}
    for p, s in zip(pairs.tolist(), sums.tolist()):
        out.setdefault(p // width, {})[p % width] = s / per
    return out


def _shown(k: np.ndarray, values: np.ndarray, K: int, show: Callable[[int], object],
           skip: int | None = None) -> list[list]:
    """Per key its most frequent values (at most ``SHOWN``), as ``show`` names them."""
    values = np.asarray(values, dtype=np.int64)
    m = values != skip if skip is not None else np.ones(len(values), bool)
    width = int(values[m].max()) + 1 if m.any() else 1
    pairs, counts = np.unique(k[m] * width + values[m], return_counts=True)
    out: list[list] = [[] for _ in range(K)]
    for p, c in sorted(zip(pairs.tolist(), counts.tolist()), key=lambda pc: -pc[1]):
        names = out[p // width]
        value = show(p % width)
        if len(names) < SHOWN and value not in names:
            names.append(value)
    return out


def run_side(run_dir: str | os.PathLike[str], by: str) -> RunSide:
    fold, problems, named = read_fold(run_dir)
    return summarise(fold, by, Path(run_dir), problems, named)


def _run_side_other(run_dir: str, by: str) -> RunSide | tuple[str, str]:
    """``run_side`` in the second process; an error comes back as its source and message."""
    try:
        return run_side(run_dir, by)
    except SourceError as exc:
        return exc.source, exc.message


# -- two runs ----------------------------------------------------------------------------------

def compare(a: RunSide, b: RunSide, by: str, rule: NoiseRule = NoiseRule()) -> Diff:
    """Every key of either run, with its change (``Change``) and, for B's added waiting, the
    late ranks behind it."""
    rows: list[Row] = []
    for key in sorted(a.keys.keys() | b.keys.keys()):
        sa, sb = a.keys.get(key), b.keys.get(key)
        if sa is None or sb is None:
            rows.append(Row(key, sa, sb, Change.ONLY_B if sa is None else Change.ONLY_A))
            continue
        row = Row(key, sa, sb, Change.UNCHANGED, noise_ns=rule.bar(sa, sb),
                  named=b.named.get(key, []))
        if row.delta_ns > row.noise_ns:
            row.change = Change.REGRESSION
        elif row.delta_ns < -row.noise_ns:
            row.change = Change.IMPROVEMENT
        if row.delta_wait_ns >= rule.min_ns:      # less added waiting is jitter: no one named
            row.late_ranks = late_ranks(sa, sb, row.delta_wait_ns)
        rows.append(row)

    def order(r: Row) -> tuple:
        size = {Change.REGRESSION: -r.delta_ns, Change.IMPROVEMENT: r.delta_ns,
                Change.ONLY_B: -r.delta_ns, Change.ONLY_A: r.delta_ns}.get(
            r.change, -(r.b.time_ns if r.b else 0.0))
        return ORDER.index(r.change), size, r.key
    rows.sort(key=order)
    return Diff(a=a, b=b, by=by, rule=rule, rows=rows)


def late_ranks(a: Side, b: Side, added_wait_ns: float) -> list[int]:
    """The ranks B's added waiting was spent on: each behind ``LATE_SHARE`` of it or more,
    the most first."""
    if added_wait_ns <= 0:
        return []
    grew = {r: b.late.get(r, 0.0) - a.late.get(r, 0.0) for r in a.late.keys() | b.late.keys()}
    named = sorted((r for r, d in grew.items() if d >= LATE_SHARE * added_wait_ns),
                   key=lambda r: (-grew[r], r))
    return named[:LATE_RANKS_SHOWN]


def diff_runs(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str], by: str = ORIGIN,
              rule: NoiseRule = NoiseRule()) -> Diff:
    """Read both runs (B in a second process where there are two cores: reading the tables
    is most of the time) and compare them."""
    if by not in BY:
        raise CommvizError(f"unknown --by {by!r} (one of {', '.join(BY)})")
    if len(os.sched_getaffinity(0)) < 2:
        return compare(run_side(run_a, by), run_side(run_b, by), by, rule)
    ctx = multiprocessing.get_context(      # as the overview's second reader
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        other = pool.submit(_run_side_other, str(run_b), by)
        a = run_side(run_a, by)
        b = other.result()
    if isinstance(b, tuple):
        raise SourceError(*b)
    return compare(a, b, by, rule)
