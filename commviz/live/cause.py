"""Why a window was slow, at its root: each rank named carries its cause, and no victim is named.

One place reads "why" from a window's joined instances (``commviz.live.window``): the watcher,
its windows series (so the report's "over the whole run") and ``commviz diff`` all take their
names from ``Judge.name``. A slowdown shows as one of:

- ``late``: the rank arrived last persistently (its work before the collective was slow): last
  by its own doing in at least ``LATE_SHARE`` of an origin's instances of a group (those whose
  lateness was carried in count against it), at least ``MIN_LATE`` of them, by a median skew of
  at least ``STRAGGLER_MIN_NS`` and ``STRAGGLER_FACTOR`` times the group's normal skew (its own
  over the run so far, else its sibling groups' at that origin together, else the window's;
  in the window that holds the group's warm-up, its first collective, nobody is judged late
  or paused there: the ranks' start-up is in it).
  Three quarters, not a bare majority: four ranks sharing two loaded cores made one of them
  last in 5 of 9 instances of a second, by 4 ms, with nobody slow.
- ``transfer``: the rank's transfers are slow. Its groups' *comm* (last arrival to last end:
  the transfer, waiting left out) runs ``SLOW_FACTOR`` times slower, in ``LATE_SHARE`` of their
  instances, than their sibling groups' (same origin, size and bytes: the siblings' lower
  median, so two siblings compare with the faster) and than the run so far (before there is
  one: against three siblings or more), and the rank is the one those slow groups share: in at
  least two of them, more than any other member. The peers it made late elsewhere (a TP peer,
  done late with it, arrives late to its DP all_reduce) are listed as having waited
  (``waited``) and their lateness is added to its cost: they are never named.
- ``pause``: the rank stopped for a while: it arrived last, by ``PAUSE_MIN_NS`` or more,
  ``PAUSE_FACTOR`` times the group's normal skew and the window's median skew at that origin
  (of the instances late by their own doing, where there are enough: a slowdown of every
  instance is no pause), and ``PAUSE_COMM_FACTOR`` times the window's comm time there (every
  link slow alike stalls the ranks that much), in at least two of its groups at once (stalls overlapping in time). Its
  peers, held inside the first group's call, carry that lateness into their other group: it
  is the paused rank's, but only the stalls of groups it is in count and are shown.
- ``p2p_link``: a pipeline link (sender ``rank``, receiver ``peer``) delivers slowly: its
  transfers' *delivery* (both sides posted to the receiver's next call) runs ``SLOW_FACTOR``
  times slower than the sibling links' of the same origin and bytes, and than the run so far;
  the two ranks' own lateness elsewhere is the link's.

A slowdown of the whole job (every link shaped alike) leaves no group slower than its siblings
and names nobody: it shows in the rows as groups slower than the run so far. The run so far is
kept per group (normal skew) and per sibling class (normal comm, normal delivery), leaving out
what was named: a slowdown that lasts half the run does not become the measure it is judged by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from commviz.metadata import StrEnum
from commviz.live.joined import Instances, Transfers
from commviz.merge.instances import STRAGGLER_FACTOR, STRAGGLER_MIN_NS, WARMUP

LATE_SHARE = 3 / 4               # late in at least this share of an origin's instances
MIN_LATE = 4
NORMAL_MIN = 20                 # instances (transfers) a normal figure is read from
SLOW_FACTOR = 3.0               # a slow group or link: this times its siblings and the run so far
SLOW_MIN = 3                    # instances (transfers) a slow group (link) shows in a window
TRANSFER_MIN_NS = 1_000_000     # and this much slower per instance than its siblings
SIBLINGS_ALONE = 3              # groups of a class judged with no run so far (two say little)
PAUSE_MIN_NS = 100_000_000      # a stall: arrived last by this much (jitter is shorter)
PAUSE_FACTOR = 10.0             # and this times its group's normal skew
PAUSE_COMM_FACTOR = 5.0         # and this times the window's comm time at the origin
WAITED_SHOWN = 8
# figures (ns) run-so-far medians are read from: 20 bins a decade from 1 µs to 100 s
BINS = np.geomspace(1e3, 1e11, 161)


class Cause(StrEnum):
    LATE = "late"
    TRANSFER = "transfer"
    PAUSE = "pause"
    P2P_LINK = "p2p_link"


class Straggler(NamedTuple):
    """A rank named in a window, with its cause (the module docstring says what each field
    means for each cause)."""

    rank: int
    origin: str
    group: str
    group_label: str
    instances: int                   # late: the origin's instances; else those it slowed
    late_in: int                     # late: where it arrived last; transfer: its slow groups;
    #                                  pause: its groups stalled; p2p_link: slow transfers
    skew_ns: int                     # late/pause: its median/longest lateness; transfer and
    #                                  p2p_link: the time lost per instance against its siblings
    cost_ns: int                     # what the others lost to it (its victims' lateness too)
    cause: str = Cause.LATE
    peer: int | None = None          # p2p_link: the receiver (``rank`` sends)
    waited: tuple[int, ...] = ()     # ranks it made late elsewhere (never named themselves)


def said(s: Mapping[str, Any], fmt_ns: Callable[[int], str]) -> str:
    """One named rank in one line, as the watcher and the report say it (``s``: a
    ``Straggler._asdict()`` or its windows-series line; a line without a cause is late)."""
    cause, rank, cost = s.get("cause", Cause.LATE), s["rank"], fmt_ns(s["cost_ns"])
    waited = s.get("waited") or []
    held = (f"; ranks {', '.join(map(str, waited))} waited for it there (not named)"
            if waited else "")
    where = f"{s['origin']} in {s['group_label']}"
    if cause == Cause.TRANSFER:
        return (f"TRANSFER: rank {rank}'s transfers are slow: the {s['late_in']} groups it "
                f"shares run {fmt_ns(s['skew_ns'])} slower per instance than their sibling "
                f"groups (worst at {where}), cost the others {cost}{held}")
    if cause == Cause.PAUSE:
        return (f"PAUSE: rank {rank} stopped: {s['late_in']} of its groups stalled at once "
                f"waiting for it (longest {fmt_ns(s['skew_ns'])}, at {where}), cost the "
                f"others {cost}{held}")
    if cause == Cause.P2P_LINK:
        return (f"P2P LINK: rank {rank} -> rank {s['peer']} at {s['origin']}: delivery "
                f"{fmt_ns(s['skew_ns'])} slower than its sibling links (slow in "
                f"{s['late_in']} of {s['instances']} transfers), cost {cost}{held}")
    return (f"LATE: rank {rank} to {where}: last in {s['late_in']} of {s['instances']}, skew "
            f"{fmt_ns(s['skew_ns'])} (median), cost the others {cost} of waiting{held}")


def quantile(hist: np.ndarray, q: float) -> int | None:
    """A histogram's ``q`` quantile over ``BINS``, to within a bin (12 %)."""
    got = quantiles(hist[None, :], q)[0]
    return None if got < 0 else int(got)


def quantiles(hists: np.ndarray, q: float) -> np.ndarray:
    """``quantile`` of each row of ``hists`` (-1: an empty row)."""
    total = hists.sum(axis=1)
    i = (np.cumsum(hists, axis=1) < (q * total)[:, None]).sum(axis=1)
    lo = np.where(i > 0, BINS[np.maximum(i - 1, 0)], 0.0)
    hi = BINS[np.minimum(i, len(BINS) - 1)]
    out = np.where(lo > 0, np.sqrt(lo * hi), hi / 2).astype(np.int64)
    return np.where(total > 0, out, -1)


@dataclass
class _Normal:
    """Run-so-far histograms by key (bounded: one histogram a key)."""

    hists: dict[object, np.ndarray] = field(default_factory=dict)

    def add(self, keys: np.ndarray, values: np.ndarray, names: list) -> None:
        if not len(keys):
            return
        width = len(BINS) + 1
        present, row = np.unique(keys, return_inverse=True)
        hists = np.bincount(row.reshape(-1) * width + np.searchsorted(BINS, values),
                            minlength=len(present) * width).reshape(len(present), width)
        for k, h in zip(present.tolist(), hists):
            got = self.hists.get(names[k])
            if got is None:
                self.hists[names[k]] = h.copy()
            else:
                got += h

    def median(self, name: object) -> int | None:
        h = self.hists.get(name)
        return quantile(h, 0.5) if h is not None and h.sum() >= NORMAL_MIN else None


def _segments(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order, segment starts and ends of ``keys`` sorted."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(k)] if len(k) else np.zeros(0, np.int64)
    return order, starts, ends


def _medians(keys: np.ndarray, values: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key: the key, its values' lower median, their count, and the index of
    the median's element."""
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    if not len(k):
        return k, v, np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    n = np.diff(np.r_[starts, len(k)])
    mid = starts + (n - 1) // 2
    return k[starts], v[mid], n, order[mid]


@dataclass
class _Slow:
    """Segments (a group, or a link, at one sibling class) slower than their siblings."""

    segment: np.ndarray              # the group (link) index
    klass: np.ndarray                # the sibling class index
    median: np.ndarray
    usual: np.ndarray                # the siblings' lower median
    count: np.ndarray
    at: np.ndarray                   # one of its instances (transfers)


def _slower(seg: np.ndarray, klass: np.ndarray, value: np.ndarray, normal: _Normal,
            class_names: list, share: float) -> _Slow:
    """The (segment, class) pairs whose ``value`` is, in ``share`` of their instances and at
    their median, ``SLOW_FACTOR`` times their siblings' (the other segments of the class:
    their lower median) and the run so far's, and ``TRANSFER_MIN_NS`` more."""
    width = int(seg.max()) + 1 if len(seg) else 1
    raw = klass.astype(np.int64) * width + seg
    keys, med, n, at_of = _medians(raw, value)
    k_of = keys // width
    ck, usual, groups, _ = _medians(k_of, med)
    at = np.searchsorted(ck, k_of)
    sib = usual[at]
    known = np.array([normal.median(class_names[int(c)]) or 0 for c in ck.tolist()],
                     np.int64)[at]
    siblings = np.where(known > 0, 2, SIBLINGS_ALONE)
    mine = np.searchsorted(keys, raw)              # each value's segment
    bar = np.maximum(SLOW_FACTOR * np.maximum(sib, known), sib + TRANSFER_MIN_NS)
    slow_n = np.bincount(mine, weights=value >= bar[mine], minlength=len(keys))
    slow = ((groups[at] >= siblings) & (n >= SLOW_MIN) & (slow_n >= share * n)
            & (med >= bar))
    return _Slow(keys[slow] % width, k_of[slow], med[slow], sib[slow], n[slow], at_of[slow])


class Judge:
    """Names a window's roots (``name``) and keeps the run so far they are judged against.
    Before a group has a run so far, a late rank's skew is judged against the window's median
    skew outside the candidates' instances (each a rank last in three quarters of an origin's
    instances), and a pause against the window's median: unless the window holds the group's
    warm-up, the ranks' start-up (then nobody is judged there). ``alone``: a whole run judged
    as one window (``commviz diff``: its warm-ups are left out, the run is judged all the same)."""

    def __init__(self, alone: bool = False) -> None:
        self.alone = alone
        self.skew = _Normal()           # per group name: skews the named did not cause
        self.origin_skew = _Normal()    # per origin: the same, its groups together
        self.comm = _Normal()           # per sibling class: comm times of groups not slow
        self.delivery = _Normal()       # per link class: deliveries of links not slow

    def _usual(self, group: str, origin: str) -> int | None:
        """A group's normal skew at an origin: its own, else its sibling groups' together."""
        usual = self.skew.median(group)
        return usual if usual is not None else self.origin_skew.median(origin)

    def name(self, inst: Instances, links: Transfers | None = None) -> list[Straggler]:
        """Every root of the window's slowdowns, the costliest first; the run so far learns
        from what they did not cause."""
        sub = inst.take(inst.arrived & (inst.seq > WARMUP) & (inst.n > 1))
        classes, class_names = _classes(sub)
        starting = set() if self.alone else set(
            np.unique(inst.group[inst.seq <= WARMUP]).tolist())
        late = self._late(sub, starting)
        timed = sub.comm >= 0
        slow = _slower(sub.group[timed], classes[timed], sub.comm[timed], self.comm,
                       class_names, LATE_SHARE) if timed.any() else None
        if slow is not None:
            slow.at = np.flatnonzero(timed)[slow.at]
        transfer, held = _shared(sub, slow) if slow is not None else ([], {})
        named = {s.rank for s in late} | {s.rank for s in transfer}
        pauses = self._paused(sub, named | set(held), starting)
        link_named, link_ranks, link_slow = self._links(links)
        out = _attribute(late, transfer, held, link_named, link_ranks)
        out += pauses
        out.sort(key=lambda s: -s.cost_ns)
        self._learn(sub, classes, class_names, out, slow, links, link_slow)
        return out

    def learn(self, inst: Instances) -> None:
        """Instances no window shows (older than a ``--once`` window), for the run so far."""
        sub = inst.take(inst.arrived & (inst.seq > WARMUP) & (inst.n > 1))
        classes, class_names = _classes(sub)
        self._learn(sub, classes, class_names, [], None, None, None)

    # -- late -------------------------------------------------------------------------------

    def _late(self, sub: Instances, starting: set[int]) -> list[Straggler]:
        """Ranks last persistently by their own lateness (not carried in: ``Instances.root``);
        the lateness they made others carry into later collectives is added to their cost.
        ``starting``: the groups whose warm-up is in the window (no run so far: not judged)."""
        own = sub.take(~sub.inherited)
        if not len(own):
            return []
        rows, row_n = np.unique(sub.group.astype(np.int64) * len(sub.origins) + sub.origin,
                                return_counts=True)      # every instance of a row counts
        row_of = np.searchsorted(rows, own.group.astype(np.int64) * len(own.origins)
                                 + own.origin)
        width = int(own.late_rank.max()) + 1
        pairs, pair_of, pair_n = np.unique(row_of.astype(np.int64) * width + own.late_rank,
                                           return_inverse=True, return_counts=True)
        order, starts, ends = _segments(pair_of.reshape(-1))
        candidates = [(i, p, k) for i, (p, k) in enumerate(zip(pairs.tolist(), pair_n.tolist()))
                      if k >= MIN_LATE and k >= LATE_SHARE * int(row_n[p // width])]
        alone = None                   # no run so far: the window's other instances' median
        if candidates:
            others = np.ones(len(own), bool)
            for i, _, _ in candidates:
                others[order[starts[i]:ends[i]]] = False
            alone = int(np.median(own.skew[others])) if others.any() else None
        out = []
        for i, p, k in candidates:
            r_i, rank = divmod(p, width)
            total = int(row_n[r_i])
            these = order[starts[i]:ends[i]]
            skew = int(np.median(own.skew[these]))
            g, o = divmod(int(rows[r_i]), len(own.origins))
            group = own.groups[g]
            usual = self._usual(group.name, own.origins[o])
            if usual is None and g not in starting:
                usual = alone
            if usual is None:          # the warm-up window (the ranks' start-up): not judged
                continue
            if skew < max(STRAGGLER_MIN_NS, STRAGGLER_FACTOR * usual):
                continue
            out.append(Straggler(int(rank), own.origins[o], group.name, group.label, total, k,
                                 skew, int(own.wait[these].sum())))
        return _carried(sub, out)

    # -- pause ------------------------------------------------------------------------------

    def _paused(self, sub: Instances, excluded: set[int], starting: set[int]
                ) -> list[Straggler]:
        """Ranks last, by a stall, in two or more of their groups at once (``starting``: as
        ``_late``'s)."""
        if not len(sub):
            return []
        # a stall stands out of its origin's window too: of the instances late by their own
        # doing, where there are NORMAL_MIN of them (a collective called right after another
        # has its lateness carried in nearly always: its few own late arrivals in a window can
        # be the stalls themselves; then the run so far and the comm time are the measure)
        own = ~sub.inherited
        _, here, _, _ = _group_medians(sub.origin[own], sub.skew[own], len(sub.origins))
        few = np.bincount(sub.origin[own], minlength=len(sub.origins)) < NORMAL_MIN
        timed = sub.comm >= 0                 # and of its transfers (every link slow alike)
        _, comm, _, _ = _group_medians(sub.origin[timed], sub.comm[timed], len(sub.origins))
        none = np.iinfo(np.int64).max
        here, comm = np.where(few, 0, here), np.where(comm == none, 0, comm)
        skew = sub.skew
        stall = []
        for i in np.flatnonzero(skew >= PAUSE_MIN_NS).tolist():
            o, g = int(sub.origin[i]), int(sub.group[i])
            known = self._usual(sub.groups[g].name, sub.origins[o])
            if known is None and g not in starting:
                known = 0                  # no run so far: the window's own median alone
            if known is not None and skew[i] >= PAUSE_FACTOR * max(known, here[o]) \
                    and skew[i] >= PAUSE_COMM_FACTOR * comm[o]:
                stall.append(i)
        by_rank: dict[int, list[int]] = {}
        for i in stall:
            r = int(sub.root[i])
            if r not in excluded:
                by_rank.setdefault(r, []).append(i)
        out = []
        for rank, idx in by_rank.items():
            idx.sort(key=lambda i: int(sub.first_start[i]))
            best: list[int] = []
            best_groups: set[int] = set()
            episode: list[int] = []
            in_episode: set[int] = set()
            end = -1
            for i in idx:                     # stalls overlapping in time: one episode
                if episode and int(sub.first_start[i]) > end:
                    episode, in_episode = [], set()
                episode.append(i)
                members = sub.groups[int(sub.group[i])].ranks
                if rank in members or not members:      # its own groups' stalls (or unknown)
                    in_episode.add(int(sub.group[i]))
                end = max(end, int(sub.last_start[i]))
                if len(in_episode) > len(best_groups):
                    best, best_groups = list(episode), set(in_episode)
            groups = best_groups
            mine = [j for j in best if int(sub.group[j]) in groups]
            if len(groups) < 2 or sub.inherited[mine].all():
                continue
            worst = max(mine, key=lambda j: int(skew[j]))
            g = sub.groups[int(sub.group[worst])]
            waited = sorted({int(sub.late_rank[j]) for j in idx} - {rank})
            out.append(Straggler(rank, sub.origins[int(sub.origin[worst])], g.name, g.label,
                                 len(idx), len(groups), int(skew[worst]),
                                 int(sub.wait[idx].sum()), Cause.PAUSE, None,
                                 tuple(waited[:WAITED_SHOWN])))
        return out

    # -- p2p links --------------------------------------------------------------------------

    def _links(self, links: Transfers | None
               ) -> tuple[list[Straggler], dict[int, int], _Slow | None]:
        """Slow links, and per rank of theirs the index of its link's entry."""
        if links is None or not len(links):
            return [], {}, None
        ok = links.delivery >= 0
        idx = np.flatnonzero(ok)
        if not len(idx):
            return [], {}, None
        _, link_of = np.unique(links.link[idx], return_inverse=True)
        klass, class_names = _link_classes(links, idx)
        slow = _slower(link_of.astype(np.int64), klass, links.delivery[idx], self.delivery,
                       class_names, 0.5)
        order, starts, ends = _segments(link_of)
        per_link: dict[int, Straggler] = {}
        for s, m, u in zip(slow.segment.tolist(), slow.median.tolist(), slow.usual.tolist()):
            these = idx[order[starts[s]:ends[s]]]
            first = int(these[0])
            src, dst = int(links.src[first]), int(links.dst[first])
            lost = links.delivery[these] - u
            entry = Straggler(src, links.origins[int(links.origin[first])],
                              links.group_names[int(links.group[first])],
                              links.group_labels[int(links.group[first])], len(these),
                              int((links.delivery[these] >= SLOW_FACTOR * u).sum()), int(m - u),
                              int(lost[lost > 0].sum()), Cause.P2P_LINK, dst)
            old = per_link.get(s)
            if old is None or entry.skew_ns > old.skew_ns:
                per_link[s] = entry
        out = sorted(per_link.values(), key=lambda e: -e.cost_ns)
        ranks: dict[int, int] = {}
        for i, e in enumerate(out):
            ranks.setdefault(e.rank, i)
            ranks.setdefault(e.peer, i)      # type: ignore[arg-type]
        return out, ranks, slow

    # -- the run so far ---------------------------------------------------------------------

    def _learn(self, sub: Instances, classes: np.ndarray, class_names: list,
               named: list[Straggler], slow: _Slow | None, links: Transfers | None,
               link_slow: _Slow | None) -> None:
        if len(sub):
            keep = np.ones(len(sub), bool)
            names = [g.name for g in sub.groups]
            for s in named:
                if s.cause == Cause.LATE:
                    keep &= sub.root != s.rank
                elif s.cause == Cause.PAUSE:
                    keep &= ~((sub.root == s.rank) & (sub.skew >= PAUSE_MIN_NS))
            self.skew.add(sub.group[keep].astype(np.int64), sub.skew[keep], names)
            self.origin_skew.add(sub.origin[keep].astype(np.int64), sub.skew[keep], sub.origins)
            has = sub.comm >= 0
            if slow is not None and len(slow.segment):
                width = int(sub.group.max()) + 1
                slow_keys = slow.klass.astype(np.int64) * width + slow.segment
                has &= ~np.isin(classes.astype(np.int64) * width + sub.group, slow_keys)
            self.comm.add(classes[has].astype(np.int64), sub.comm[has], class_names)
        if links is not None and len(links):
            idx = np.flatnonzero(links.delivery >= 0)
            if not len(idx):
                return
            klass, class_names = _link_classes(links, idx)
            keep = np.ones(len(idx), bool)
            if link_slow is not None and len(link_slow.segment):
                _, link_of = np.unique(links.link[idx], return_inverse=True)
                keep &= ~np.isin(link_of, link_slow.segment)
            self.delivery.add(klass[keep].astype(np.int64), links.delivery[idx][keep],
                              class_names)


def _group_medians(keys: np.ndarray, values: np.ndarray, n: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_medians`` spread over ``n`` keys 0..n-1 (a key with no value: the largest int)."""
    k, med, count, at = _medians(keys.astype(np.int64), values)
    full = np.full(n, np.iinfo(np.int64).max, np.int64)
    full[k] = med
    return k, full, count, at


def _classes(sub: Instances) -> tuple[np.ndarray, list]:
    """Per instance its sibling class (origin, ranks, bytes), and the classes' names."""
    if not len(sub):
        return np.zeros(0, np.int64), []
    raw = (sub.origin.astype(np.int64) << 40) | (sub.n.astype(np.int64) << 24) \
        | np.minimum(np.unique(sub.size, return_inverse=True)[1].reshape(-1), (1 << 24) - 1)
    keys, inv = np.unique(raw, return_inverse=True)
    first = np.zeros(len(keys), np.int64)
    first[inv.reshape(-1)[::-1]] = np.arange(len(raw))[::-1]
    names = [(sub.origins[int(sub.origin[i])], int(sub.n[i]), int(sub.size[i]))
             for i in first.tolist()]
    return inv.reshape(-1), names


def _link_classes(links: Transfers, idx: np.ndarray) -> tuple[np.ndarray, list]:
    """Per transfer (``idx``) its link class (origin, bytes), and the classes' names."""
    raw = (links.origin[idx].astype(np.int64) << 40) | np.unique(
        links.size[idx], return_inverse=True)[1].reshape(-1)
    keys, inv = np.unique(raw, return_inverse=True)
    first = np.zeros(len(keys), np.int64)
    first[inv.reshape(-1)[::-1]] = np.arange(len(raw))[::-1]
    names = [("p2p", links.origins[int(links.origin[idx[i]])], int(links.size[idx[i]]))
             for i in first.tolist()]
    return inv.reshape(-1), names


def _shared(sub: Instances, slow: _Slow) -> tuple[list[Straggler], dict[int, int]]:
    """The ranks the slow groups share (two or more of them, more than any other member), and
    every member of their slow groups -> the index of its transfer rank's entry."""
    groups = sorted(set(slow.segment.tolist()))
    if len(groups) < 2:
        return [], {}
    members = [np.asarray(sub.groups[g].ranks, np.int64) for g in groups]
    ranks, counts = np.unique(np.concatenate(members), return_counts=True)
    count = dict(zip(ranks.tolist(), counts.tolist()))
    out: list[Straggler] = []
    held: dict[int, int] = {}
    for rank in ranks[counts >= 2].tolist():
        mine = [g for g, m in zip(groups, members) if rank in set(m.tolist())]
        others = {r for g in mine for r in sub.groups[g].ranks} - {rank}
        if any(count[r] >= count[rank] for r in others):
            continue
        at = np.isin(slow.segment, mine)
        worst = int(np.argmax(np.where(at, slow.median - slow.usual, -1)))
        g = sub.groups[int(slow.segment[worst])]
        lost = (slow.median - slow.usual)[at] * slow.count[at]
        origin = sub.origins[int(sub.origin[slow.at[worst]])]
        for r in others:
            held.setdefault(r, len(out))
        held[rank] = len(out)
        out.append(Straggler(rank, origin, g.name, g.label, int(slow.count[at].sum()),
                             len(mine), int(slow.median[worst] - slow.usual[worst]),
                             int(lost.sum()) * (len(g.ranks) - 1), Cause.TRANSFER))
    return out, held


def _carried(sub: Instances, late: list[Straggler]) -> list[Straggler]:
    """Each late rank's entry (its costliest) takes the waits of the instances whose lateness
    was its own carried on (``Instances.root``), and lists the ranks that carried it."""
    first: dict[int, int] = {}
    for i, s in enumerate(late):
        if s.rank not in first or s.cost_ns > late[first[s.rank]].cost_ns:
            first[s.rank] = i
    if not first or not sub.inherited.any():
        return late
    idx = np.flatnonzero(sub.inherited & np.isin(sub.root, list(first)))
    extra: dict[int, int] = {}
    waited: dict[int, set[int]] = {}
    for root, rank, wait in zip(sub.root[idx].tolist(), sub.late_rank[idx].tolist(),
                                sub.wait[idx].tolist()):
        extra[root] = extra.get(root, 0) + wait
        if rank != root:
            waited.setdefault(root, set()).add(rank)
    out = list(late)
    for rank, i in first.items():
        out[i] = out[i]._replace(cost_ns=out[i].cost_ns + extra.get(rank, 0),
                                 waited=tuple(sorted(waited.get(rank, ()))[:WAITED_SHOWN]))
    return out


def _attribute(late: list[Straggler], transfer: list[Straggler], held: dict[int, int],
               links: list[Straggler], link_ranks: dict[int, int]) -> list[Straggler]:
    """The late entries of ranks a transfer rank or a slow link held up become theirs: their
    cost is the root's, and they are listed as having waited."""
    roots = [*transfer, *links]
    extra = [0] * len(roots)
    waited: list[set[int]] = [set() for _ in roots]
    out = []
    for s in late:
        if s.rank in held:
            i = held[s.rank]
        elif s.rank in link_ranks:
            i = len(transfer) + link_ranks[s.rank]
        else:
            out.append(s)
            continue
        extra[i] += s.cost_ns
        if s.rank != roots[i].rank and s.rank != roots[i].peer:
            waited[i].add(s.rank)
    for i, r in enumerate(roots):
        out.append(r._replace(cost_ns=r.cost_ns + extra[i],
                              waited=tuple(sorted(waited[i])[:WAITED_SHOWN])))
    return out
