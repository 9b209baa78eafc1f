"""One window of calls joined across ranks: per group and per origin, and the late ranks named.

Calls from ``commviz.live.tail`` go into ``Calls`` (compact columns, one row per call, each call
site's ``Shape`` once), and ``join`` makes them *instances*, one per (process group, sequence
number), the definitions of ``commviz.merge.instances`` computed over columns (a window of a
16,384-rank job is two million calls: ``scripts/bench_watch.py``):

- ``skew`` = last start - first start; the *late rank* started last (ties: the higher rank);
- ``wait`` = what the other ranks spent inside the call before the late rank arrived
  (``min(last start, r's end) - r's start`` summed over ranks): what the late rank cost them;
- ``comm`` = last start -> last end, the bus bandwidth over it (``commviz.merge.bandwidth``);
  none where a call covers only its launch (``async_op``, or a CUDA tensor: on NCCL the call
  returns once the kernel is enqueued) or raised.

Only collectives with a sequence number join (p2p transfers are left out here). An instance is
complete when every rank of its group *that this reader sees* made the call (on a node that sees
only its own ranks, a group with ranks elsewhere is joined over those here: ``Row.seen`` says
how many of its ranks that is). Calls of an instance not complete yet are carried to the next
window (``Calls.keep``).

Times are the calls' CPU times (``t_begin``/``t_end`` of the record), except where every call
of an instance has its NCCL ops' GPU times (``Call.gpu_begin_ns``, ``commviz.live.gpujoin``):
then arrivals, ends, skew, wait, comm time and the late rank are the GPU's (a late rank's
kernel starts last; its peers wait inside their own kernels, so the arrival names it, not a
kernel's length). Untimed launch-only instances (the plugin off, or a call it did not sample)
get no comm time, bandwidth, wait or late rank, and their launch skews count only in a row with
no timed instance (``Instances.arrivals``).

A *late rank* (``Straggler``) at an origin of a group is late persistently, not by one-off
jitter: in the window it arrived last in at least ``LATE_SHARE`` of that origin's instances,
at least ``MIN_LATE`` of them, by a median skew of at least ``merge.instances.STRAGGLER_MIN_NS``
and ``STRAGGLER_FACTOR`` times the group's normal skew; a group's first collective (its
warm-up, ``merge.instances.WARMUP``) never counts. Three quarters, not a bare majority: four
ranks sharing two loaded cores made one of them last in 5 of 9 instances of a second, by 4 ms,
with nobody slow (a rank is last by chance in 6 of 8 about once in 250 such tries, and must
then also stand out by its skew).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import numpy as np

from commviz import metadata as md
from commviz.live.tail import Call, Shape
from commviz.merge import bandwidth as bw
from commviz.merge.instances import STRAGGLER_FACTOR, STRAGGLER_MIN_NS, WARMUP

LATE_SHARE = 3 / 4               # late in at least this share of an origin's instances
NORMAL_MIN = 20                 # instances a group's normal skew is read from
MIN_LATE = 4
SHAPES_REMEMBERED = 4096
# skews (ns) run-so-far figures are read from: 20 bins a decade from 1 µs to 100 s
SKEW_BINS = np.geomspace(1e3, 1e11, 161)


class Calls:
    """Calls in columns (``array``: 8 bytes a number, no object per call) and their shapes."""

    def __init__(self) -> None:
        self.shapes: list[Shape] = []
        self._index: dict[Shape, int] = {}
        self._content: dict[tuple, int] = {}
        self.rank, self.shape = array("i"), array("i")
        self.seq, self.begin, self.end = array("q"), array("q"), array("q")
        self.gpu_begin, self.gpu_end = array("q"), array("q")
        self.failed = array("b")

    def __len__(self) -> int:
        return len(self.rank)

    def shape_index(self, shape: Shape) -> int:
        """One index per distinct shape content: every generation of every rank declares its
        shapes anew, and the join needs them once."""
        i = self._index.get(shape)
        if i is None:
            content = (shape.group, shape.group_desc, shape.group_ranks, shape.origin, shape.op,
                       shape.ctype, shape.size_bytes, shape.async_op, shape.device)
            i = self._content.get(content)
            if i is None:
                i = self._content[content] = len(self.shapes)
                self.shapes.append(shape)
            if len(self._index) > SHAPES_REMEMBERED:
                self._index.clear()
            self._index[shape] = i
        return i

    def add(self, calls: Iterable[Call]) -> None:
        """Take calls in, column by column (a p2p call or one without a number is kept too:
        ``join`` leaves it out, in one pass over the columns)."""
        calls = calls if isinstance(calls, list) else list(calls)
        if not calls:
            return
        rank, _, seq, _, begin, end, failed, shapes, gpu_begin, gpu_end = zip(*calls)
        index = list(map(self._index.get, shapes))
        if None in index:
            index = [self.shape_index(s) if i is None else i for i, s in zip(index, shapes)]
        if None in seq:
            seq = tuple(-1 if n is None else n for n in seq)
        self.rank.extend(rank)
        self.shape.extend(index)
        self.seq.extend(seq)
        self.begin.extend(begin)
        self.end.extend(end)
        self.gpu_begin.extend(gpu_begin)
        self.gpu_end.extend(gpu_end)
        self.failed.extend(failed)

    def columns(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(getattr(self, name), dtype=dt) if len(self) else
                np.zeros(0, dt) for name, dt in _COLUMNS}

    def keep(self, rows: np.ndarray) -> Calls:
        """A new ``Calls`` holding ``rows`` of these (the same shapes)."""
        out = Calls()
        out.shapes, out._index, out._content = self.shapes, self._index, self._content
        for name, col in self.columns().items():
            getattr(out, name).frombytes(col[rows].tobytes())
        return out


_COLUMNS = (("rank", np.int32), ("shape", np.int32), ("seq", np.int64), ("begin", np.int64),
            ("end", np.int64), ("gpu_begin", np.int64), ("gpu_end", np.int64), ("failed", np.int8))


class Group(NamedTuple):
    name: str
    desc: str
    ranks: tuple[int, ...]

    @property
    def label(self) -> str:
        return md.group_label(self.desc, self.ranks)


@dataclass(slots=True)
class Instances:
    """Complete instances, one element per instance in each array (``join``)."""

    groups: list[Group]
    origins: list[str]
    group: np.ndarray            # index into ``groups``
    origin: np.ndarray           # index into ``origins`` (the late rank's call's)
    seq: np.ndarray
    n: np.ndarray                # ranks that made the call
    first_start: np.ndarray
    last_start: np.ndarray
    last_end: np.ndarray
    late_rank: np.ndarray
    wait: np.ndarray             # the other ranks' wait for the late one, summed
    comm: np.ndarray             # ns; -1: none (launch only, failed)
    bus_bytes: np.ndarray        # size x bus factor where there is a bandwidth, else 0
    launch_only: np.ndarray
    gpu: np.ndarray              # its times are its calls' GPU times (every call timed)

    @property
    def skew(self) -> np.ndarray:
        return self.last_start - self.first_start

    def arrivals(self) -> np.ndarray:
        """The skews a row's figures are read from: those of instances with real arrivals
        (GPU-timed, or CPU calls that are not launch only); all of them when there are none
        (NCCL without GPU times: the launch skew, said as CPU times)."""
        usable = ~self.launch_only
        return self.skew[usable] if usable.any() else self.skew

    def take(self, mask: np.ndarray) -> Instances:
        return Instances(self.groups, self.origins, **{
            name: getattr(self, name)[mask] for name in _INSTANCE_ARRAYS})

    def __len__(self) -> int:
        return len(self.group)


_INSTANCE_ARRAYS = ("group", "origin", "seq", "n", "first_start", "last_start", "last_end",
                    "late_rank", "wait", "comm", "bus_bytes", "launch_only", "gpu")


@dataclass(slots=True)
class _ShapeTable:
    """Per shape, what the join needs, as arrays indexed by the shape column."""

    group: np.ndarray
    origin: np.ndarray
    size: np.ndarray
    launch_only: np.ndarray
    factor: np.ndarray          # bus factor of its type over its group's rank count; 0: none
    collective: np.ndarray      # a collective (what joins here)
    groups: list[Group]
    origins: list[str]


def _shape_table(shapes: list[Shape]) -> _ShapeTable:
    groups: dict[str, int] = {}
    origins: dict[str, int] = {}
    g_list: list[Group] = []
    cols: dict[str, list[Any]] = {k: [] for k in ("group", "origin", "size", "launch", "factor",
                                                  "collective")}
    for s in shapes:
        if s.group not in groups:
            groups[s.group] = len(g_list)
            g_list.append(Group(s.group, s.group_desc, s.group_ranks))
        origin = s.origin or s.op
        cols["group"].append(groups[s.group])
        cols["origin"].append(origins.setdefault(origin, len(origins)))
        cols["size"].append(s.size_bytes or 0)
        cols["launch"].append(s.async_op or s.device == "cuda")
        cols["factor"].append(bw.bus_factor(s.ctype, len(s.group_ranks)) or 0.0)
        cols["collective"].append(s.kind == "collective")
    return _ShapeTable(np.array(cols["group"], np.int32), np.array(cols["origin"], np.int32),
                       np.array(cols["size"], np.int64), np.array(cols["launch"], bool),
                       np.array(cols["factor"], np.float64), np.array(cols["collective"], bool),
                       g_list, list(origins))


def join(calls: Calls, seen: Iterable[int]) -> tuple[Instances, np.ndarray]:
    """The complete instances among ``calls``, and the rows of those not complete yet.

    ``seen``: the ranks whose calls this reader has; an instance is complete when every rank
    of its group among them made the call."""
    table = _shape_table(calls.shapes)
    c = calls.columns()
    joins = table.collective[c["shape"]] & (c["seq"] >= 0)
    if not joins.all():
        c = {name: col[joins] for name, col in c.items()}
        rows = np.flatnonzero(joins)
    else:
        rows = None
    seen_set = frozenset(seen)
    expected = np.array([max(1, sum(r in seen_set for r in g.ranks)) if g.ranks else 1
                         for g in table.groups], np.int64)
    shape = c["shape"]
    group = table.group[shape] if len(shape) else np.zeros(0, np.int32)
    key = group.astype(np.int64) << 40 | c["seq"]
    gpu = _all_timed(key, c["gpu_begin"] >= 0)
    begin = np.where(gpu, c["gpu_begin"], c["begin"])
    end = np.where(gpu, c["gpu_end"], c["end"])
    order = np.lexsort((c["rank"], begin, key))
    key, group, gpu = key[order], group[order], gpu[order]
    begin, end, rank = begin[order], end[order], c["rank"][order]
    shape = shape[order]
    if not len(key):
        return _empty(table), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    lasts = np.r_[starts[1:], len(key)] - 1
    n = lasts - starts + 1
    igroup = group[starts]
    complete = n >= expected[igroup]
    per_call = np.repeat(complete, n)
    pending = order[~per_call]
    last_start = begin[lasts]
    timed = gpu[starts]
    launch = np.maximum.reduceat(table.launch_only[shape].astype(np.int8), starts).astype(bool)
    launch &= ~timed
    failed = np.maximum.reduceat(c["failed"][order], starts).astype(bool)
    waited = np.clip(np.minimum(np.repeat(last_start, n), end) - begin, 0, None)
    wait = np.where(launch, 0, np.add.reduceat(waited, starts))
    last_end = np.maximum.reduceat(end, starts)
    comm = np.where(launch | failed, -1, np.maximum(0, last_end - last_start))
    size = np.maximum.reduceat(table.size[shape], starts)
    factor = table.factor[shape[lasts]]
    bus = np.where((comm > 0) & (factor > 0), size * factor, 0.0)
    inst = Instances(table.groups, table.origins, group=igroup, origin=table.origin[shape[lasts]],
                     seq=key[starts] & ((1 << 40) - 1), n=n, first_start=begin[starts],
                     last_start=last_start, last_end=last_end, late_rank=rank[lasts], wait=wait,
                     comm=comm, bus_bytes=bus, launch_only=launch, gpu=timed)
    return inst.take(complete), pending if rows is None else rows[pending]


def _all_timed(key: np.ndarray, timed: np.ndarray) -> np.ndarray:
    """Per call: every call of its instance (``key``) has GPU times (one clock per instance)."""
    if not timed.any():
        return timed
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    n = np.diff(np.r_[starts, len(ordered)])
    out = np.empty(len(key), bool)
    out[order] = np.repeat(np.minimum.reduceat(timed[order].astype(np.int8), starts) > 0, n)
    return out


def _empty(table: _ShapeTable) -> Instances:
    z = np.zeros(0, np.int64)
    return Instances(table.groups, table.origins, group=z, origin=z, seq=z, n=z, first_start=z,
                     last_start=z, last_end=z, late_rank=z, wait=z, comm=z,
                     bus_bytes=np.zeros(0), launch_only=np.zeros(0, bool), gpu=np.zeros(0, bool))


# -- what a window says ---------------------------------------------------------------------------

@dataclass(slots=True)
class Totals:
    """One row's sums (a group, or an origin within a group), window or run so far."""

    instances: int = 0
    timed: int = 0                   # of them, with GPU times
    calls: int = 0
    comm_ns: int = 0                 # over instances with a comm time
    bus_bytes: float = 0.0
    bus_ns: int = 0                  # comm time of the instances with a bandwidth
    wait_ns: int = 0
    skews: np.ndarray = field(default_factory=lambda: np.zeros(len(SKEW_BINS) + 1, np.int64))

    def add(self, inst: Instances) -> None:
        has_comm = inst.comm >= 0
        self.instances += len(inst)
        self.timed += int(inst.gpu.sum())
        self.calls += int(inst.n.sum())
        self.comm_ns += int(inst.comm[has_comm].sum())
        self.bus_bytes += float(inst.bus_bytes.sum())
        self.bus_ns += int(inst.comm[inst.bus_bytes > 0].sum())
        self.wait_ns += int(inst.wait.sum())
        self.skews += np.bincount(np.searchsorted(SKEW_BINS, inst.arrivals()),
                                  minlength=len(SKEW_BINS) + 1)

    @property
    def busbw_gbps(self) -> float | None:
        """nccl-tests' bus bandwidth over the row's instances together (bytes x factor over
        their comm time)."""
        return self.bus_bytes / self.bus_ns if self.bus_ns else None

    def skew_ns(self, q: float) -> int | None:
        """The ``q`` quantile of the skews, to within a bin (12 %)."""
        total = int(self.skews.sum())
        if not total:
            return None
        i = int(np.searchsorted(np.cumsum(self.skews), q * total, side="left"))
        lo = SKEW_BINS[i - 1] if i > 0 else 0.0
        hi = SKEW_BINS[min(i, len(SKEW_BINS) - 1)]
        return int((lo * hi) ** 0.5 if lo else hi / 2)


class Straggler(NamedTuple):
    """A rank late persistently to one origin of one group in a window."""

    rank: int
    origin: str
    group: str
    group_label: str
    instances: int                   # the origin's instances in the window
    late_in: int                     # of those, where this rank arrived last
    skew_ns: int                     # median skew of those
    cost_ns: int                     # the other ranks' wait in those, summed


def stragglers(inst: Instances, normal: dict[str, int]) -> list[Straggler]:
    """The persistently late ranks of a window's instances (the module docstring);
    ``normal``: each group's normal skew (``Windows``), which a late rank's median skew must
    exceed ``STRAGGLER_FACTOR`` times (a group's median where it has none)."""
    mask = ~inst.launch_only & (inst.seq > WARMUP) & (inst.n > 1)
    sub = inst.take(mask)
    if not len(sub):
        return []
    row = sub.group.astype(np.int64) * len(sub.origins) + sub.origin
    rows, row_of, row_n = np.unique(row, return_inverse=True, return_counts=True)
    width = int(sub.late_rank.max()) + 1
    pairs, pair_n = np.unique(row_of.astype(np.int64) * width + sub.late_rank,
                              return_counts=True)
    out = []
    for p, k in zip(pairs.tolist(), pair_n.tolist()):
        r_i, rank = divmod(p, width)
        total = int(row_n[r_i])
        if k < MIN_LATE or k < LATE_SHARE * total:
            continue
        these = (row_of == r_i) & (sub.late_rank == rank)
        skew = int(np.median(sub.skew[these]))
        g, o = divmod(int(rows[r_i]), len(sub.origins))
        group = sub.groups[g]
        usual = normal.get(group.name)
        if usual is None:
            usual = int(np.median(sub.skew[sub.group == g]))
        if skew < max(STRAGGLER_MIN_NS, STRAGGLER_FACTOR * usual):
            continue
        out.append(Straggler(rank=int(rank), origin=sub.origins[o], group=group.name,
                             group_label=group.label, instances=total, late_in=k,
                             skew_ns=skew, cost_ns=int(sub.wait[these].sum())))
    out.sort(key=lambda s: -s.cost_ns)
    return out


class Figures(NamedTuple):
    """What a row says of a window, or of the run so far."""

    instances: int
    timed: int                       # instances with GPU times (their figures are the GPU's)
    calls: int
    comm_ns: int
    busbw_gbps: float | None
    skew_p50_ns: int | None
    skew_p99_ns: int | None
    wait_ns: int


def figures(t: Totals, skews: np.ndarray | None = None) -> Figures:
    """``skews``: the window's own, for exact quantiles (else read off the histogram)."""
    if skews is not None and len(skews):
        ordered = np.sort(skews)            # the inverted-CDF quantiles: values that occurred
        p50, p99 = (int(ordered[max(0, int(np.ceil(q * len(ordered))) - 1)]) for q in (0.5, 0.99))
    else:
        p50, p99 = t.skew_ns(0.5), t.skew_ns(0.99)
    return Figures(t.instances, t.timed, t.calls, t.comm_ns, t.busbw_gbps, p50, p99, t.wait_ns)


class Row(NamedTuple):
    """One group (``origin`` None) or one origin of a group: the window and the run so far."""

    group: str
    label: str
    origin: str | None
    seen: int                        # ranks of the group this reader sees
    size: int                        # ranks of the group
    times: str                       # "gpu": the window's figures are GPU times, else "cpu"
    window: Figures
    run: Figures


Key = tuple[int, int]                # (group index, origin index; -1: the group's row)


def _segments(inst: Instances, by_origin: bool) -> Iterable[tuple[Key, np.ndarray]]:
    """The instances' indices per group (``by_origin``: per group and origin)."""
    width = len(inst.origins) if by_origin else 1
    row = inst.group.astype(np.int64) * width + (inst.origin if by_origin else 0)
    order = np.argsort(row, kind="stable")
    ordered = row[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if len(row) else []
    for a, b in zip(starts, np.r_[starts[1:], len(order)] if len(row) else []):
        g, o = divmod(int(ordered[a]), width)
        yield (g, o if by_origin else -1), order[a:b]


@dataclass
class Window:
    """One window: its rows, the late ranks named, and what could not be read."""

    index: int
    start_ns: int
    end_ns: int
    ranks: list[int]
    groups: list[Row]
    origins: list[Row]
    stragglers: list[Straggler]
    incomplete: int                  # instances given up on: some rank's call never came
    missed: dict[int, int]           # rank -> calls that could not be read
    problems: list[str]


class Windows:
    """The run so far, one window at a time: ``add`` calls, ``close`` a window.

    Calls of instances not complete yet are carried into the next window; those whose first
    call is older than ``carry_ns`` are given up (``Window.incomplete``). Run-so-far sums are
    kept per row (bounded: a skew histogram, never the instances), and so is each group's
    *normal* skew, the late ranks' instances left out: a slowdown that lasts half the run does
    not become the measure it is judged by."""

    def __init__(self, carry_ns: int = 30_000_000_000) -> None:
        self.calls = Calls()
        self.carry_ns = carry_ns
        self.run: dict[tuple[str, str | None], Totals] = {}
        self.normal: dict[str, Totals] = {}
        self.index = 0

    def add(self, calls: Iterable[Call]) -> None:
        self.calls.add(calls)

    def close(self, seen: Iterable[int], start_ns: int, end_ns: int,
              since_ns: int | None = None) -> Window:
        """Join what was added; the instances complete now make the window (``since_ns``:
        only those that ended after it; earlier ones count for the run so far alone)."""
        seen = sorted(set(seen))
        inst, pending = join(self.calls, seen)
        given_up = pending[self.calls.columns()["begin"][pending] < end_ns - self.carry_ns]
        incomplete = len(np.unique(_instance_keys(self.calls, given_up)))
        self.calls = self.calls.keep(np.setdiff1d(pending, given_up))
        if since_ns is not None:
            self._normal(inst.take(inst.last_end <= since_ns), [])
            here = inst.take(inst.last_end > since_ns)
        else:
            here = inst
        normal = {g: t.skew_ns(0.5) or 0 for g, t in self.normal.items()
                  if t.instances >= NORMAL_MIN}
        late = stragglers(here, normal)
        self._normal(here, late)
        rows = {by_origin: self._rows(inst, here, seen, by_origin) for by_origin in (False, True)}
        window = Window(self.index, start_ns, end_ns, seen, rows[False], rows[True], late,
                        incomplete, {}, [])
        self.index += bool(len(here))         # windows are numbered as they hold instances
        return window

    def _rows(self, inst: Instances, here: Instances, seen: list[int],
              by_origin: bool) -> list[Row]:
        """Every row's run-so-far sums grow by ``inst``; the window's rows are ``here``'s."""
        for (g, o), idx in _segments(inst, by_origin):
            key = inst.groups[g].name, None if o < 0 else inst.origins[o]
            self.run.setdefault(key, Totals()).add(inst.take(idx))
        out = []
        seen_set = set(seen)
        for (g, o), idx in _segments(here, by_origin):
            group = here.groups[g]
            origin = None if o < 0 else here.origins[o]
            part = here.take(idx)
            win = Totals()
            win.add(part)
            out.append(Row(group.name, group.label, origin,
                           sum(r in seen_set for r in group.ranks), len(group.ranks),
                           "gpu" if win.timed else "cpu", figures(win, part.arrivals()),
                           figures(self.run[group.name, origin])))
        out.sort(key=lambda r: (-r.window.wait_ns, r.group, r.origin or ""))
        return out

    def _normal(self, inst: Instances, late: list[Straggler]) -> None:
        """Add to each group's normal skews those of ``inst`` the late ranks did not cause."""
        mask = ~inst.launch_only & (inst.seq > WARMUP) & (inst.n > 1)
        names = np.array([g.name for g in inst.groups], dtype=object)
        origins = np.array(inst.origins, dtype=object)
        for s in late:
            mask &= ~((names[inst.group] == s.group) & (origins[inst.origin] == s.origin)
                      & (inst.late_rank == s.rank)) if len(inst) else mask
        kept = inst.take(mask)
        for (g, _), idx in _segments(kept, False):
            self.normal.setdefault(kept.groups[g].name, Totals()).add(kept.take(idx))


def _instance_keys(calls: Calls, rows: np.ndarray) -> np.ndarray:
    cols = calls.columns()
    group = _shape_table(calls.shapes).group
    return group[cols["shape"][rows]].astype(np.int64) << 40 | cols["seq"][rows]
