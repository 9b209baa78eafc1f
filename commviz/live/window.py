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

Collectives join by their sequence number. An instance is complete when every rank of its group
*that this reader sees* made the call (on a node that sees only its own ranks, a group with
ranks elsewhere is joined over those here: ``Row.seen`` says how many of its ranks that is).
Point-to-point calls join as *transfers* (``Transfers``): a send matched to its receive by
(group, source, destination, their number between the two: ``commviz.p2p_seq``, which the
record numbers per pair as Flight Recorder's keys name it). A transfer's *delivery* runs from
the later of its two postings (a gloo or NCCL send or receive returns once posted) to the
receiver's next call: the data came and the receiver went on. Calls of an instance or transfer
not complete yet are carried to the next window (``Calls.keep``).

Times are the calls' CPU times (``t_begin``/``t_end`` of the record), except where every call
of an instance has its NCCL ops' GPU times (``Call.gpu_begin_ns``, ``commviz.live.gpujoin``):
then arrivals, ends, skew, wait, comm time and the late rank are the GPU's (a late rank's
kernel starts last; its peers wait inside their own kernels, so the arrival names it, not a
kernel's length). A CPU collective launched asynchronously (``async_op``: DDP's buckets on
gloo) covers its launch only, but its launch is its arrival (gloo takes the data in then): it
gets no comm time or bandwidth, and its wait is the others' time from their launch to the last
launch. Untimed NCCL launch-only instances (the plugin off, or a call it did not sample) get no
comm time, bandwidth, wait or late rank, and their launch skews count only in a row with
no timed instance (``Instances.arrivals``).

The ranks a window names, and why (late, slow transfers, a pause, a slow pipeline link), are
``commviz.live.cause``'s: one reading of "why" for the watcher, the report and the diff.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import numpy as np

from commviz import metadata as md
from commviz.live.cause import BINS as SKEW_BINS
from commviz.live.cause import Judge, Straggler, quantiles
from commviz.live.joined import Group, Instances, Transfers
from commviz.live.tail import Call, Shape
from commviz.merge import bandwidth as bw

SHAPES_REMEMBERED = 1 << 19          # shape objects known by identity (p2p: one per peer)
INHERIT_SHARE = 0.5              # a late arrival its previous collective held this much of
CHAIN = 16                       # links followed back to the rank whose lateness it is


class Calls:
    """Calls in columns (``array``: 8 bytes a number, no object per call) and their shapes."""

    def __init__(self) -> None:
        self.shapes: list[Shape] = []
        self.tabled = _Tabled()
        self._index: dict[Shape, int] = {}
        self._content: dict[tuple, int] = {}
        self.rank, self.shape = array("i"), array("i")
        self.seq, self.pair = array("q"), array("q")
        self.begin, self.end = array("q"), array("q")
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
                       shape.ctype, shape.size_bytes, shape.async_op, shape.device,
                       shape.meta.get(md.SRC), shape.meta.get(md.DST))
            i = self._content.get(content)
            if i is None:
                i = self._content[content] = len(self.shapes)
                self.shapes.append(shape)
                self.tabled.add(shape)
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
        rank, _, seq, pair, begin, end, failed, shapes, gpu_begin, gpu_end = zip(*calls)
        index = list(map(self._index.get, shapes))
        if None in index:              # each new shape once, then every call by identity
            for shape in {s for s, i in zip(shapes, index) if i is None}:
                self.shape_index(shape)
            index = list(map(self._index.get, shapes))
            if None in index:          # the identities were forgotten meanwhile (many shapes)
                index = [self.shape_index(s) if i is None else i for i, s in zip(index, shapes)]
        if None in seq:
            seq = [-1 if n is None else n for n in seq]
        if None in pair:
            pair = [-1 if n is None else n for n in pair]
        self.rank.extend(rank)
        self.shape.extend(index)
        self.seq.extend(seq)
        self.pair.extend(pair)
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
        out.tabled = self.tabled
        for name, col in self.columns().items():
            getattr(out, name).frombytes(col[rows].tobytes())
        return out


_COLUMNS = (("rank", np.int32), ("shape", np.int32), ("seq", np.int64), ("pair", np.int64),
            ("begin", np.int64),
            ("end", np.int64), ("gpu_begin", np.int64), ("gpu_end", np.int64), ("failed", np.int8))


@dataclass(slots=True)
class _ShapeTable:
    """Per shape, what the join needs, as arrays indexed by the shape column."""

    group: np.ndarray
    origin: np.ndarray
    size: np.ndarray
    launch_only: np.ndarray
    cpu: np.ndarray             # not a CUDA tensor: its call starts when its data goes in
    factor: np.ndarray          # bus factor of its type over its group's rank count; 0: none
    collective: np.ndarray      # a collective (what joins by its number)
    p2p: np.ndarray             # a send or receive with a known peer (joins as a transfer)
    src: np.ndarray
    dst: np.ndarray
    groups: list[Group]
    origins: list[str]


class _Tabled:
    """The shape table's columns, grown by each new shape once (``Calls.shape_index``): a
    window's join reads them as arrays, never walking every shape again."""

    def __init__(self) -> None:
        self.groups: dict[str, int] = {}
        self.origins: dict[str, int] = {}
        self.g_list: list[Group] = []
        self.cols: dict[str, list[Any]] = {k: [] for k in (
            "group", "origin", "size", "launch", "cpu", "factor", "collective", "src", "dst")}
        self._table: _ShapeTable | None = None

    def add(self, s: Shape) -> None:
        if s.group not in self.groups:
            self.groups[s.group] = len(self.g_list)
            self.g_list.append(Group(s.group, s.group_desc, s.group_ranks))
        cols = self.cols
        cols["group"].append(self.groups[s.group])
        cols["origin"].append(self.origins.setdefault(s.origin or s.op, len(self.origins)))
        cols["size"].append(s.size_bytes or 0)
        cols["launch"].append(s.async_op or s.device == "cuda")
        cols["cpu"].append(s.device != "cuda")
        cols["factor"].append(bw.bus_factor(s.ctype, len(s.group_ranks)) or 0.0)
        cols["collective"].append(s.kind == "collective")
        for end, key in (("src", md.SRC), ("dst", md.DST)):
            peer = s.meta.get(key) if s.kind == "p2p" else None
            cols[end].append(-1 if peer is None else int(peer))
        self._table = None

    def table(self) -> _ShapeTable:
        if self._table is None:
            c = self.cols
            src, dst = np.array(c["src"], np.int64), np.array(c["dst"], np.int64)
            self._table = _ShapeTable(
                np.array(c["group"], np.int32), np.array(c["origin"], np.int32),
                np.array(c["size"], np.int64), np.array(c["launch"], bool),
                np.array(c["cpu"], bool), np.array(c["factor"], np.float64), np.array(c["collective"], bool),
                (src >= 0) & (dst >= 0), src, dst, list(self.g_list), list(self.origins))
        return self._table


def join(calls: Calls, seen: Iterable[int]) -> tuple[Instances, Transfers, np.ndarray]:
    """The complete instances and transfers among ``calls``, and the rows of those not
    complete yet.

    ``seen``: the ranks whose calls this reader has; an instance is complete when every rank
    of its group among them made the call."""
    table = calls.tabled.table()
    full = calls.columns()
    joins = table.collective[full["shape"]] & (full["seq"] >= 0)
    transfers = table.p2p[full["shape"]] & (full["pair"] >= 0)
    links, pending_p2p = (_transfers(full, np.flatnonzero(transfers), table) if transfers.any()
                          else (_no_transfers(table), np.zeros(0, np.int64)))
    inst, pending = _instances(full, joins, table, seen)
    if len(pending_p2p):
        pending = np.sort(np.r_[pending, pending_p2p])
    return inst, links, pending


def _instances(c: dict[str, np.ndarray], joins: np.ndarray, table: _ShapeTable,
               seen: Iterable[int]) -> tuple[Instances, np.ndarray]:
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
    arrived = timed | (np.minimum.reduceat(table.cpu[shape].astype(np.int8), starts) > 0)
    failed = np.maximum.reduceat(c["failed"][order], starts).astype(bool)
    waited = np.clip(np.minimum(np.repeat(last_start, n), end) - begin, 0, None)
    behind = np.clip(np.repeat(last_start, n) - begin, 0, None)   # launched: waited later
    wait = np.where(~launch, np.add.reduceat(waited, starts),
                    np.where(arrived, np.add.reduceat(behind, starts), 0))
    last_end = np.maximum.reduceat(end, starts)
    comm = np.where(launch | failed, -1, np.maximum(0, last_end - last_start))
    size = np.maximum.reduceat(table.size[shape], starts)
    factor = table.factor[shape[lasts]]
    bus = np.where((comm > 0) & (factor > 0), size * factor, 0.0)
    late_rank = rank[lasts]
    own, carried = held(rank, begin, end, starts, lasts, complete & arrived,
                        ~(table.launch_only[shape] & ~np.repeat(timed, n)))
    inst = Instances(table.groups, table.origins, group=igroup, origin=table.origin[shape[lasts]],
                     seq=key[starts] & ((1 << 40) - 1), n=n, first_start=begin[starts],
                     last_start=last_start, last_end=last_end, late_rank=late_rank, wait=wait,
                     comm=comm, bus_bytes=bus, launch_only=launch, arrived=arrived, gpu=timed,
                     size=size,
                     root=roots(own, carried, late_rank, last_start - begin[starts]),
                     inherited=~own)
    return inst.take(complete), pending if rows is None else rows[pending]


def held(rank: np.ndarray, begin: np.ndarray, end: np.ndarray, starts: np.ndarray,
          lasts: np.ndarray, usable: np.ndarray, waits: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Per instance: whether its late rank was late by its own doing, and else the instance
    its lateness came from (-1: not known).

    A rank arrives late by its own doing when the time it took since its previous call (its
    work before this one) was longer than the others' by at least ``INHERIT_SHARE`` of the
    skew (or nothing tells: its first call in the window). Otherwise its previous call ended
    late (it waited there, arrived late there too, or the data of a transfer came late) and
    the lateness is carried in: from that call's instance, where it is a collective. The
    calls are in the join's order (``starts``/``lasts``: each instance's first and last).
    ``waits``: per call, whether its end is when the rank was done waiting (default: all);
    an async launch's is not (the rank waits for its work later, outside any call, as DDP's
    bucket all_reduces): a gap after one tells nothing, as before a rank's first call."""
    by_rank = np.lexsort((begin, rank))
    prev = np.full(len(rank), -1, np.int64)
    same = rank[by_rank[1:]] == rank[by_rank[:-1]]
    prev[by_rank[1:][same]] = by_rank[:-1][same]
    has = prev >= 0
    if waits is not None:
        has &= waits[np.maximum(prev, 0)]
    gap = np.where(has, begin - end[np.maximum(prev, 0)], 0)
    x = lasts
    others = np.add.reduceat(has.astype(np.int64), starts) - has[x]
    mean = (np.add.reduceat(gap, starts) - gap[x]) / np.maximum(others, 1)
    skew = begin[lasts] - begin[starts]
    own = ~has[x] | (others == 0) | (gap[x] - mean >= INHERIT_SHARE * skew)
    instance = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(rank)]))
    held = np.where(has[x], instance[np.maximum(prev[x], 0)], -1)
    return own, np.where(~own & usable & (held >= 0) & usable[np.maximum(held, 0)], held, -1)


def roots(own: np.ndarray, held: np.ndarray, late_rank: np.ndarray, skew: np.ndarray
          ) -> np.ndarray:
    """Per instance the rank whose lateness it was: its late rank's when its own, else along
    ``held`` the first late rank late by its own doing (-1: the chain ends unknown or is
    longer than ``CHAIN``). A link is followed only where the instance held from was skewed by
    ``INHERIT_SHARE`` of the lateness carried out of it: else that lateness was made inside its
    calls (a rank stopped in one, a stalled transfer), not by its late rank, and the chain ends
    unknown."""
    at = np.arange(len(held))
    root = np.full(len(held), -1, np.int64)
    settled = np.zeros(len(held), bool)
    for _ in range(CHAIN):
        mine = ~settled & own[at]
        root[mine] = late_rank[at[mine]]
        back = held[at]
        settled |= mine | (back < 0) | (skew[np.maximum(back, 0)] < INHERIT_SHARE * skew[at])
        if settled.all():
            break
        at = np.where(settled, at, held[at])
    return root


def _transfers(c: dict[str, np.ndarray], rows: np.ndarray, table: _ShapeTable
               ) -> tuple[Transfers, np.ndarray]:
    """Sends matched to receives (``rows``: the p2p calls); the rows of those whose other side
    has not come yet. Each rank's next call (for a transfer's delivery) is read off the
    window's calls in the rank's order (a stable sort: the tail hands them over in order)."""
    shape = c["shape"][rows]
    src, dst = table.src[shape], table.dst[shape]
    group = table.group[shape].astype(np.int64)
    key = np.stack([group, src, dst, c["pair"][rows]])
    order = np.lexsort(key[::-1])
    k = key[:, order]
    new = np.r_[True, (k[:, 1:] != k[:, :-1]).any(axis=0)]
    starts = np.flatnonzero(new)
    n = np.diff(np.r_[starts, len(order)])
    a, b = order[starts[n == 2]], order[starts[n == 2] + 1]
    rank = c["rank"][rows]
    send = np.where(rank[a] == src[a], a, b)
    recv = np.where(send == a, b, a)
    ok = (rank[send] == src[send]) & (rank[recv] == dst[recv])
    send, recv = send[ok], recv[ok]
    pending = rows[order[np.repeat(n == 1, n)]]
    by_rank = np.argsort(c["rank"], kind="stable")
    at = np.empty(len(by_rank), np.int64)
    at[by_rank] = np.arange(len(by_rank))
    following = at[rows[recv]] + 1
    has_next = following < len(by_rank)
    nxt = by_rank[np.minimum(following, len(by_rank) - 1)]
    has_next &= c["rank"][nxt] == c["rank"][rows[recv]]
    send_post, recv_post = c["begin"][rows[send]], c["begin"][rows[recv]]
    later = np.maximum(send_post, recv_post)
    delivery = np.where(has_next, np.maximum(0, c["begin"][nxt] - later), -1)
    return Transfers([g.name for g in table.groups], [g.label for g in table.groups],
                     table.origins, group=group[recv], origin=table.origin[shape[recv]],
                     src=src[send], dst=dst[send], link=src[send] << 32 | dst[send],
                     size=table.size[shape[send]], send_post=send_post, recv_post=recv_post,
                     delivery=delivery), pending


def _no_transfers(table: _ShapeTable) -> Transfers:
    z = np.zeros(0, np.int64)
    return Transfers([g.name for g in table.groups], [g.label for g in table.groups],
                     table.origins, z, z, z, z, z, z, z, z, z)


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
                     bus_bytes=np.zeros(0), launch_only=np.zeros(0, bool),
                     arrived=np.zeros(0, bool), gpu=np.zeros(0, bool),
                     size=z, root=z, inherited=np.zeros(0, bool))


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

    def merge(self, sums: _RowSums, i: int) -> None:
        """Add row ``i`` of ``sums``."""
        self.instances += int(sums.instances[i])
        self.timed += int(sums.timed[i])
        self.calls += int(sums.calls[i])
        self.comm_ns += int(sums.comm_ns[i])
        self.bus_bytes += float(sums.bus_bytes[i])
        self.bus_ns += int(sums.bus_ns[i])
        self.wait_ns += int(sums.wait_ns[i])
        self.skews += sums.skews[i]

    @property
    def busbw_gbps(self) -> float | None:
        """nccl-tests' bus bandwidth over the row's instances together (bytes x factor over
        their comm time)."""
        return self.bus_bytes / self.bus_ns if self.bus_ns else None


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


@dataclass(slots=True)
class _RowSums:
    """Every row's sums over some instances at once (``of``), and its window's exact skew
    quantiles: the rows of a 131,072-rank window are numbered in numpy, not one by one."""

    keys: np.ndarray                 # per row: group index x origins + origin (or the group)
    instances: np.ndarray
    timed: np.ndarray
    calls: np.ndarray
    comm_ns: np.ndarray
    bus_bytes: np.ndarray
    bus_ns: np.ndarray
    wait_ns: np.ndarray
    skews: np.ndarray                # (rows, bins) histogram of the arrivals' skews
    p50: np.ndarray                  # the inverted-CDF quantiles: values that occurred
    p99: np.ndarray

    @classmethod
    def of(cls, inst: Instances, by_origin: bool) -> _RowSums:
        width = len(inst.origins) if by_origin else 1
        raw = inst.group.astype(np.int64) * width + (inst.origin if by_origin else 0)
        keys, row = np.unique(raw, return_inverse=True)
        row = row.reshape(-1)
        R = len(keys)

        def total(w: np.ndarray) -> np.ndarray:
            return np.bincount(row, weights=w, minlength=R)
        has_comm = inst.comm >= 0
        usable = inst.arrived          # a row's arrivals: its usable instances', else all
        arrivals = usable | (total(usable.astype(np.float64)) == 0)[row]
        skew = inst.skew
        b = np.searchsorted(SKEW_BINS, skew[arrivals])
        skews = np.bincount(row[arrivals] * (len(SKEW_BINS) + 1) + b,
                            minlength=R * (len(SKEW_BINS) + 1)).reshape(R, len(SKEW_BINS) + 1)
        order = np.lexsort((skew[arrivals], row[arrivals]))
        ordered = skew[arrivals][order]
        n = np.bincount(row[arrivals], minlength=R)
        first = np.r_[0, np.cumsum(n)[:-1]]
        p50, p99 = (np.where(n > 0, ordered[np.minimum(first + np.maximum(
            np.ceil(q * n).astype(np.int64) - 1, 0), max(len(ordered) - 1, 0))], -1)
            if len(ordered) else np.full(R, -1) for q in (0.5, 0.99))
        comm = np.where(has_comm, inst.comm, 0)
        return cls(keys, np.bincount(row, minlength=R), total(inst.gpu.astype(np.float64)),
                   total(inst.n.astype(np.float64)), total(comm.astype(np.float64)),
                   total(inst.bus_bytes),
                   total(np.where(inst.bus_bytes > 0, inst.comm, 0).astype(np.float64)),
                   total(inst.wait.astype(np.float64)), skews, p50, p99)

    def figures(self, i: int) -> Figures:
        bus_ns = int(self.bus_ns[i])
        p50, p99 = int(self.p50[i]), int(self.p99[i])
        return Figures(int(self.instances[i]), int(self.timed[i]), int(self.calls[i]),
                       int(self.comm_ns[i]), float(self.bus_bytes[i]) / bus_ns if bus_ns
                       else None, None if p50 < 0 else p50, None if p99 < 0 else p99,
                       int(self.wait_ns[i]))


@dataclass
class Window:
    """One window: its rows, the late ranks named, and what could not be read."""

    index: int
    start_ns: int
    end_ns: int
    ranks: list[int]
    groups: list[Row]
    origins: list[Row]
    stragglers: list[Straggler]      # the roots named, each with its cause (``live.cause``)
    incomplete: int                  # instances given up on: some rank's call never came
    missed: dict[int, int]           # rank -> calls that could not be read
    problems: list[str]
    links: list[Row] = field(default_factory=list)   # transfers, per origin (``P2P_GROUP``)


class Windows:
    """The run so far, one window at a time: ``add`` calls, ``close`` a window.

    Calls of instances not complete yet are carried into the next window; those whose first
    call is older than ``carry_ns`` are given up (``Window.incomplete``). Run-so-far sums are
    kept per row (bounded: a skew histogram, never the instances); what the causes are judged
    against is the ``Judge``'s."""

    def __init__(self, carry_ns: int = 30_000_000_000) -> None:
        self.calls = Calls()
        self.carry_ns = carry_ns
        self.run: dict[tuple[str, str | None], Totals] = {}
        self.judge = Judge()
        self.index = 0

    def add(self, calls: Iterable[Call]) -> None:
        self.calls.add(calls)

    def close(self, seen: Iterable[int], start_ns: int, end_ns: int,
              since_ns: int | None = None) -> Window:
        """Join what was added; the instances complete now make the window (``since_ns``:
        only those that ended after it; earlier ones count for the run so far alone)."""
        seen = sorted(set(seen))
        inst, links, pending = join(self.calls, seen)
        given_up = pending[self.calls.columns()["begin"][pending] < end_ns - self.carry_ns]
        incomplete = len(np.unique(_instance_keys(self.calls, given_up)))
        self.calls = self.calls.keep(np.setdiff1d(pending, given_up))
        p2p = links.as_instances()
        if since_ns is not None:
            self.judge.learn(inst.take(inst.last_end <= since_ns))
            here = inst.take(inst.last_end > since_ns)
            links = links.take(p2p.last_end > since_ns)
            p2p_here = p2p.take(p2p.last_end > since_ns)
        else:
            here, p2p_here = inst, p2p
        named = self.judge.name(here, links)
        rows = {by_origin: self._rows(inst, here, seen, by_origin) for by_origin in (False, True)}
        window = Window(self.index, start_ns, end_ns, seen, rows[False], rows[True], named,
                        incomplete, {}, [], self._rows(p2p, p2p_here, seen, True))
        self.index += bool(len(here))         # windows are numbered as they hold instances
        return window

    def _rows(self, inst: Instances, here: Instances, seen: list[int],
              by_origin: bool) -> list[Row]:
        """Every row's run-so-far sums grow by ``inst``; the window's rows are ``here``'s."""
        width = len(inst.origins) if by_origin else 1

        def key(k: int) -> tuple[int, str, str | None]:
            g, o = divmod(k, width)
            return g, inst.groups[g].name, inst.origins[o] if by_origin else None
        sums = _RowSums.of(inst, by_origin)
        for i, k in enumerate(sums.keys.tolist()):
            _, name, origin = key(k)
            self.run.setdefault((name, origin), Totals()).merge(sums, i)
        window = _RowSums.of(here, by_origin)
        seen_set = set(seen)
        counted: dict[int, int] = {}
        named = [key(k) for k in window.keys.tolist()]
        runs = [self.run[name, origin] for _, name, origin in named]
        hists = np.stack([t.skews for t in runs]) if runs else np.zeros((0, len(SKEW_BINS) + 1))
        p50, p99 = (quantiles(hists, q).tolist() for q in (0.5, 0.99))
        out = []
        for i, ((g, name, origin), t) in enumerate(zip(named, runs)):
            group = inst.groups[g]
            if g not in counted:
                counted[g] = sum(r in seen_set for r in group.ranks)
            f = window.figures(i)
            run = Figures(t.instances, t.timed, t.calls, t.comm_ns, t.busbw_gbps,
                          None if p50[i] < 0 else p50[i], None if p99[i] < 0 else p99[i],
                          t.wait_ns)
            out.append(Row(name, group.label, origin, counted[g], len(group.ranks),
                           "gpu" if f.timed else "cpu", f, run))
        out.sort(key=lambda r: (-r.window.wait_ns, r.group, r.origin or ""))
        return out


def _instance_keys(calls: Calls, rows: np.ndarray) -> np.ndarray:
    cols = calls.columns()
    group = calls.tabled.table().group
    return group[cols["shape"][rows]].astype(np.int64) << 40 | cols["seq"][rows]
