"""A whole run's slowdowns named at their root, for ``commviz diff``: the watcher's reading.

The fold (``review.fold``) holds each numbered collective's instance over its ranks; its calls,
read before the fold lets them go, say what each late rank did just before (``live.window.held``:
whether its lateness was its own or carried in from a collective where it waited). Together
they are the live join's ``Instances``, and ``live.cause.Judge`` names their roots with their
causes, as ``commviz watch`` does a window: one reading of "why" (docs/reviewing.md). The run is
one window: a late rank is named when it was late in three quarters of an origin's instances of
the whole run, by five times the median skew of the other instances (no run
so far precedes it; a pause, judged against one, is not named here). Point-to-point transfers are not in the fold's numbered collectives: no link is
named here.
"""

from __future__ import annotations

import numpy as np

from commviz import metadata as md
from commviz.live.cause import Judge, Straggler
from commviz.live.joined import Group, Instances
from commviz.live.window import held, roots
from commviz.merge.instances import WARMUP
from commviz.merge.table import Flag
from commviz.review.fold import Fold

NO_ORIGIN = "-"


def name(fold: Fold, calls: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
         ) -> list[Straggler]:
    """The run's roots (``calls``: ``Fold.calls()``, taken before ``Fold.finish``)."""
    inst = instances(fold, calls)
    return Judge(alone=True).name(inst) if len(inst) else []


def instances(fold: Fold, calls: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
              ) -> Instances:
    """The fold's numbered collectives as the live join's instances."""
    rank, inst, start, end = calls
    names = fold.names.names
    key_pg, _ = fold.keys.numbered()
    order = np.lexsort((rank, start, inst))
    rank, inst, start, end = rank[order], inst[order], start[order], end[order]
    starts = np.flatnonzero(np.r_[True, inst[1:] != inst[:-1]]) if len(inst) else \
        np.zeros(0, np.int64)
    lasts = np.r_[starts[1:], len(inst)] - 1 if len(inst) else starts
    ids = inst[starts]
    launch = (fold.flags[ids] & int(Flag.LAUNCH_ONLY | Flag.FAILED)) != 0
    own, carried = held(rank, start, end, starts, lasts, ~launch & (fold.count[ids] > 1))
    late = rank[lasts].astype(np.int64)
    pg_ids, group = np.unique(np.asarray(fold.pg)[ids], return_inverse=True)
    groups = []
    for g in pg_ids.tolist():
        info = fold.pgs.get(names[g])
        groups.append(Group(names[g], info.desc if info is not None else "",
                            md.group_ranks(info.ranks) if info is not None else ()))
    origin_ids, origin = np.unique(np.asarray(fold.origin)[ids], return_inverse=True)
    first, last = start[starts], start[lasts]
    comm = np.where(launch, -1, np.maximum(fold.last_end[ids] - last, 0))
    full = Instances(
        groups, [names[o] if o >= 0 else NO_ORIGIN for o in origin_ids.tolist()],
        group=group.reshape(-1), origin=origin.reshape(-1),
        seq=np.where(fold.warmup[ids], WARMUP, WARMUP + 1), n=fold.count[ids].astype(np.int64),
        first_start=first, last_start=last, last_end=fold.last_end[ids], late_rank=late,
        wait=fold.wait[ids], comm=comm, bus_bytes=np.zeros(len(ids)), launch_only=launch,
        arrived=~launch,
        gpu=np.zeros(len(ids), bool), size=fold.size[ids],
        root=roots(own, carried, late, last - first),
        inherited=~own)
    return full.take(key_pg[ids] >= 0)
