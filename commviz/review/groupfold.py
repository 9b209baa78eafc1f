"""The overview's fold of alike process groups: thousands of TP groups that behave the same are
one lane, not thousands.

``review.fold`` folds a group's alike ranks; a 131,072-rank job still has 16,384 TP groups and
32,768 pipeline groups, each with its own summary lane and folded-ranks lane, so the overview
grew with the ranks. Here the groups of one *family* (a description more than ``above`` groups
share: "tp", "pp", "dp") fold into one class per *shape*: the groups whose instances, in order
of first start, have the same ops, sizes, flags, rank counts and sequence numbers. A class
lines its groups' instances up by that order (the n-th instance of each group) and draws, per
place, the groups' median times with their spread.

A group is an *exception* and keeps its own lanes, with the flows to its kept ranks, when it
holds a kept rank (``Fold.kept``: stragglers, odd timing, failed calls, a desync's minority),
has a straggler or a desync, is alone in its shape, or at any place starts or ends
``tolerance`` or more away from its class's median group (``STRAGGLER_MIN_NS``, or 5x the
class's median deviation there, whichever is larger: the review's straggler rule applied
across groups). Folded lanes name the exceptions, so every planted rank stays one click away.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from commviz import metadata as md
from commviz.match.artifact import PgInfo
from commviz.merge.instances import STRAGGLER_FACTOR, STRAGGLER_MIN_NS
from commviz.review.fold import Fold

EXCEPTIONS_SHOWN = 8            # a folded slice names this many exceptions, then "+N more"


@dataclass
class AlikeGroups:
    """One class of alike groups of a family: its groups and their instances, place by place."""

    desc: str
    groups: list[str]               # the folded groups, in name order
    idx: np.ndarray                 # (groups, places): each group's instances by first start
    exceptions: dict[str, str]      # the family's groups drawn on their own -> why

    @property
    def name(self) -> str:
        """The class's pseudo group name (lanes' merge keys and order)."""
        return f"{self.groups[0]}+{len(self.groups) - 1}"

    @property
    def text(self) -> str:
        return groups_text(self.groups)

    @property
    def exceptions_text(self) -> str:
        names = sorted(self.exceptions, key=_natural)
        more = len(names) - EXCEPTIONS_SHOWN
        return ", ".join(names[:EXCEPTIONS_SHOWN]) + (f" +{more} more" if more > 0 else "")

    def describe(self) -> str:
        why = "; ".join(f"{pg}: {self.exceptions[pg]}"
                        for pg in sorted(self.exceptions, key=_natural))
        return (f"{len(self.groups):,} alike groups of PG {self.desc} folded ({self.text}). "
                + (f"Exceptions, on lanes of their own: {why}." if why else "No exceptions."))


def fold_groups(fold: Fold, pgs: dict[str, PgInfo], above: int) -> list[AlikeGroups]:
    """The classes of alike groups of every family of more than ``above`` groups (module
    docstring); a group in no class keeps its lanes."""
    families: dict[str, list[str]] = defaultdict(list)
    for pg in fold.by_pg:
        info = pgs.get(pg)
        if info is not None and info.desc and info.desc != md.UNDESCRIBED:
            families[info.desc].append(pg)
    kept = np.zeros(max(fold.hosts, default=-1) + 1, dtype=bool)
    kept[list(fold.kept)] = True
    desynced = {d.pg for d in fold.desyncs}
    shape = _shapes(fold)
    out = []
    for desc, members in sorted(families.items()):
        if len(members) <= above:
            continue
        why: dict[str, str] = {}
        by_shape: dict[bytes, list[str]] = defaultdict(list)
        for pg in sorted(members, key=_natural):
            idx = fold.by_pg[pg]
            held = fold.group_ranks.get(pg, np.zeros(0, np.int32))
            mine = held[kept[held]]
            if len(mine):
                why[pg] = f"ranks {md.ranks_text(mine.tolist())} kept"
            elif (fold.straggler[idx] >= 0).any():
                why[pg] = "a straggler"
            elif pg in desynced:
                why[pg] = "a desync"
            else:
                by_shape[shape[idx].tobytes()].append(pg)
        classes = []
        for groups in by_shape.values():
            if len(groups) < 2:
                why[groups[0]] = "alone in its shape"
                continue
            idx = np.stack([fold.by_pg[pg] for pg in groups])
            off = _off_timing(fold, idx)
            for g in np.flatnonzero(off).tolist():
                why[groups[g]] = "off its alike groups' timing"
            if (~off).sum() >= 2:
                classes.append(([pg for pg, o in zip(groups, off) if not o], idx[~off]))
            else:
                why.update((pg, "alone in its shape") for pg, o in zip(groups, off) if not o)
        out += [AlikeGroups(desc, groups, idx, why) for groups, idx in classes]
    return out


def _shapes(fold: Fold) -> np.ndarray:
    """Per instance, what alike groups share at that place: op, type, size, flags, ranks held,
    sequence number (numbered collectives) as one row of int64s."""
    _, seq = fold.keys.numbered()
    cols = [np.frombuffer(fold.op, np.int32), np.frombuffer(fold.ctype, np.int32), fold.size,
            fold.flags, fold.count, seq]
    return np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1)


def _off_timing(fold: Fold, idx: np.ndarray) -> np.ndarray:
    """Per group (row of ``idx``): whether at any place it starts or ends a tolerance or more
    from the median group."""
    off = np.zeros(len(idx), dtype=bool)
    for values in (fold.first_start, fold.last_end):
        v = values[idx]
        dev = np.abs(v - lower_median(v))
        bar = np.maximum(STRAGGLER_MIN_NS, STRAGGLER_FACTOR * lower_median(dev))
        off |= (dev >= bar).any(axis=1)
    return off


def lower_median(values: np.ndarray) -> np.ndarray:
    """Per column, the lower median (a value some group really had)."""
    return np.partition(values, (len(values) - 1) // 2, axis=0)[(len(values) - 1) // 2]


def _natural(name: str) -> tuple:
    head, num = _split(name)
    return (head, num if num is not None else -1, name)


def _split(name: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(.*?)(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def groups_text(names: list[str]) -> str:
    """Group names as runs: "tp1-2046, tp2048-16383" (names a prefix and a number)."""
    by_head: dict[str, list[int]] = defaultdict(list)
    others = []
    for name in names:
        head, num = _split(name)
        if num is None:
            others.append(name)
        else:
            by_head[head].append(num)
    parts = [", ".join(head + run for run in md.ranks_text(nums).split(", "))
             for head, nums in sorted(by_head.items())]
    return ", ".join(parts + sorted(others))
