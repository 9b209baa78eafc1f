"""Communication per origin: which part of the program (``commviz.origin``) costs the time.

Each record names where its call comes from (``commviz.record.origins``): the user's call site,
or the framework unit it serves (an FSDP module and phase, a DDP bucket, a pipeline stage and
action, a DTensor redistribute, a compiled function). ``rollup`` adds the instances' comm
time and wait time up per origin (``ORIGIN``: the origin string) or per unit (``UNIT``: one
FSDP module over its phases, one DDP bucket, one pipeline stage over its actions).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from commviz import metadata as md
from commviz.match.model import CommEvent
from commviz.merge.instances import Instance

ORIGIN, UNIT = "origin", "unit"
BY = (ORIGIN, UNIT)


def event_origin(ev: CommEvent) -> str | None:
    return ev.args.get(md.ORIGIN)


def event_unit(ev: CommEvent) -> str | None:
    """The unit an event serves: "FSDP 1", "DDP bucket 2", "pipelining stage 0"; its origin
    where it names no unit."""
    return md.origin_unit(ev.args)


def instance_origin(i: Instance) -> str:
    """The origin the instance's ranks name (the most common; "-" for none)."""
    return i.origin or "-"


@dataclass
class OriginRow:
    """One origin's (or unit's) communication, over the instances its ranks took part in."""

    origin: str
    count: int = 0                   # instances
    comm_ns: int = 0                 # their comm time (launch-only ones add none)
    wait_ns: int = 0                 # the time this origin's ranks waited for the last one
    ops: Counter[str] = field(default_factory=Counter)


def rollup(instances: Iterable[Instance], by: str = ORIGIN) -> list[OriginRow]:
    """Comm and wait time per origin (``by``: ``ORIGIN`` or ``UNIT``), most time first. An
    instance whose ranks name different origins (a send of stage 0, the receive of stage 1)
    counts for each of them; each rank's wait goes to its own."""
    if by not in BY:
        raise ValueError(f"unknown rollup {by!r} (one of {', '.join(BY)})")
    name = event_origin if by == ORIGIN else event_unit
    rows: dict[str, OriginRow] = {}
    for i in instances:
        waits: dict[str, int] = {}
        for rank, ev in i.events.items():
            key = name(ev) or "-"
            waits[key] = waits.get(key, 0) + i.wait_ns.get(rank, 0)
        for key, wait in waits.items():
            row = rows.get(key)
            if row is None:
                row = rows[key] = OriginRow(key)
            row.count += 1
            row.comm_ns += i.comm_ns or 0
            row.wait_ns += wait
            row.ops[i.op] += 1
    return sorted(rows.values(), key=lambda r: (-(r.comm_ns + r.wait_ns), r.origin))
