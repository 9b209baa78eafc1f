"""Named process groups laid out over the world, and their creation on every rank.

A layout of ``size`` ranks ``stride`` apart tiles the world the way Megatron-style parallelism
does: over 8 ranks, tp ``size: 4`` gives [[0,1,2,3],[4,5,6,7]] and dp ``size: 2, stride: 4``
gives [[0,4],[1,5],[2,6],[3,7]]. Explicit ``ranks`` lists need not cover every rank: a rank in
none of them has no group of that name and skips its collectives.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from commviz.launch.config_schema import WORLD, Config, Group


class LayoutError(ValueError):
    """A layout that cannot be laid over the world; ``key`` is the offending key under it."""

    def __init__(self, key: tuple[Any, ...], message: str) -> None:
        super().__init__(message)
        self.key = key


def layout(group: Group, world: int) -> list[list[int]]:
    """The rank lists of one named group over ``world`` ranks (raises LayoutError)."""
    if group.ranks is not None:
        if group.size is not None:
            raise LayoutError(("size",), "give either size (with stride) or ranks, not both")
        return _explicit(group.ranks, world)
    if group.size is None:
        raise LayoutError((), "needs size (ranks per group, with optional stride) or ranks")
    span = group.size * group.stride
    if world % span:
        what = f"size {group.size}" if group.stride == 1 else \
            f"size {group.size} × stride {group.stride} = {span}"
        raise LayoutError(("size",), f"{what} does not divide the world size {world}")
    return [[base + offset + k * group.stride for k in range(group.size)]
            for base in range(0, world, span) for offset in range(group.stride)]


def _explicit(lists: list[list[int]], world: int) -> list[list[int]]:
    if not lists:
        raise LayoutError(("ranks",), "is empty")
    seen: dict[int, int] = {}
    for i, ranks in enumerate(lists):
        if not ranks:
            raise LayoutError(("ranks", i), "is an empty group")
        for j, rank in enumerate(ranks):
            if not 0 <= rank < world:
                raise LayoutError(("ranks", i, j), f"rank {rank} does not exist (world size "
                                  f"{world}: ranks 0-{world - 1})")
            if rank in seen:
                where = "twice in this group" if seen[rank] == i else f"also in group {seen[rank]}"
                raise LayoutError(("ranks", i, j), f"rank {rank} is {where}; a rank belongs to "
                                  "at most one group of a name")
            seen[rank] = i
    return [list(r) for r in lists]


def layouts(config: Config) -> dict[str, list[list[int]]]:
    """Every named group's rank lists, ``world`` first (assumes the config was checked)."""
    world = config.world_size
    out = {WORLD: [list(range(world))]}
    for name, group in config.groups.items():
        out[name] = layout(group, world)
    return out


@dataclass
class Groups:
    """This rank's process groups by name (None: the rank is in no group of that name)."""

    pgs: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)   # this rank's group's ranks

    def size(self, name: str) -> int:
        return len(self.ranks.get(name, []))


def create(config: Config, rank: int) -> Groups:
    """Collective on every rank: create every named group in one fixed order.

    torch requires every rank to call ``new_group`` for every group, members or not, in the
    same order; each group's description is its config name (the trace's "Process Group
    Description").
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=config.job.timeout_s)
    out = Groups(pgs={WORLD: dist.group.WORLD}, ranks={WORLD: list(range(config.world_size))})
    for name, lists in layouts(config).items():
        if name == WORLD:
            continue
        backend = config.groups[name].backend or config.job.backend
        for ranks in lists:
            pg = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=name)
            if rank in ranks:
                out.pgs[name], out.ranks[name] = pg, ranks
        out.pgs.setdefault(name, None)
    return out
