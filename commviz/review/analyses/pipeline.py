"""A pipeline schedule's waits: each stage's bubbles, per action, apart from stragglers.

A pipeline stage waits for its neighbours by design: the last stage for the first
micro-batch's activations, the first for the last one's gradients. Such waits are the
schedule's bubbles, not a rank holding the others up, so the transfers a pipeline schedule
made (``Instance.pipeline``: their ``commviz.origin`` names the stage, the action and the
micro-batch, ``PP:1RECV_F2``) are kept out of the stragglers and the groups' waits and are
told here, per stage and action.

A side of a transfer waits from its start until the other side started (the data cannot come
earlier): on GPUs (NCCL) the transfer's kernel, a receive waiting for the send as a send for
its receive (``Instance.wait_ns``). On CPU (gloo) a transfer's record covers only its posting
(the wait happens in ``Work.wait()``, which is not recorded), so only a receive's wait is
known: from its posting until the send was posted. The schedule's setup (shape inference)
and its first step (each micro-batch's first transfer of an action, where later steps
follow: the stages start one after another, as a group's first collective is its warm-up)
are left out.

A stage that is slow (its compute) makes every other stage wait for it while it waits for
no one: the stage that waited least is named the slowest when every other stage waited at
least ``SLOW_FACTOR`` times as long, and at least ``STRAGGLER_MIN_NS`` longer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from commviz import metadata as md
from commviz.match.model import KeyKind
from commviz.merge.instances import STRAGGLER_MIN_NS, Instance

ACTIONS = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")   # pipelining's transfer actions, in order
SLOW_FACTOR = 3.0


@dataclass(slots=True)
class ActionWaits:
    """One action of one stage (``RECV_F``: receiving activations): its transfers' waits."""

    action: str
    transfers: int = 0               # after the first step
    warmup: int = 0                  # in the first step: left out
    measured: int = 0                # transfers whose wait is known (a gloo send's is not)
    wait_ns: int = 0
    max_wait_ns: int = 0
    on: dict[int, int] = field(default_factory=dict)   # peer stage -> time waited for it


@dataclass(slots=True)
class StageWaits:
    """One pipeline stage: how long it waited for its neighbours, and they for it."""

    stage: int
    rank: int
    actions: dict[str, ActionWaits] = field(default_factory=dict)
    waited_on_ns: int = 0            # what the other stages waited for this one
    slowest: bool = False            # the stage the others waited for (see the module)

    @property
    def wait_ns(self) -> int:
        return sum(a.wait_ns for a in self.actions.values())


def _stage(text: object) -> int | None:
    """The stage index of ``commviz.origin_unit`` ("stage 1")."""
    parts = str(text or "").split()
    return int(parts[1]) if len(parts) == 2 and parts[0] == "stage" and parts[1].isdigit() \
        else None


def _waits(inst: Instance) -> dict[int, int | None]:
    """rank -> how long its side waited for the other (None: not known)."""
    if not inst.launch_only:
        return dict(inst.wait_ns)
    if inst.key.kind is not KeyKind.P2P or len(inst.events) != 2:
        return {r: None for r in inst.events}
    recv, send = inst.events[inst.key.dst], inst.events[inst.key.src]
    return {inst.key.dst: max(0, send.start_ns - recv.start_ns), inst.key.src: None}


class _Side(NamedTuple):
    """One stage's side of one transfer."""

    start_ns: int
    microbatch: object
    wait_ns: int | None
    peers: tuple[int, ...]           # the other side's stage(s)


def _sides(instances: list[Instance]) -> dict[tuple[int, int, str], list[_Side]]:
    """(stage, rank, action) -> its sides of the pipeline's transfers, in time order."""
    out: dict[tuple[int, int, str], list[_Side]] = defaultdict(list)
    for inst in instances:
        if not inst.pipeline or len(inst.events) < 2:
            continue
        where = {r: (_stage(ev.args.get(md.ORIGIN_UNIT)), ev.args.get(md.ORIGIN_PHASE))
                 for r, ev in inst.events.items()}
        for rank, wait in _waits(inst).items():
            stage, action = where[rank]
            if stage is None or action not in ACTIONS:     # setup: shape inference
                continue
            ev = inst.events[rank]
            peers = tuple(s for r, (s, _) in where.items() if r != rank and s is not None)
            out[stage, rank, action].append(
                _Side(ev.start_ns, ev.args.get(md.ORIGIN_MICROBATCH), wait, peers))
    for sides in out.values():
        sides.sort(key=lambda s: s.start_ns)
    return out


def _first_step(sides: list[_Side]) -> int:
    """How many of an action's transfers belong to the first step: the first of each
    micro-batch, where later steps follow (0: a single step, kept)."""
    seen = {s.microbatch for s in sides}
    return len(seen) if len(sides) > len(seen) else 0


def stage_waits(instances: list[Instance]) -> list[StageWaits]:
    """Every pipeline stage's waits, the slowest first, then by stage (empty: no pipeline)."""
    stages: dict[int, StageWaits] = {}
    for (stage, rank, action), sides in sorted(_sides(instances).items()):
        row = stages.setdefault(stage, StageWaits(stage, rank))
        act = row.actions[action] = ActionWaits(action, warmup=_first_step(sides))
        for side in sides[act.warmup:]:
            act.transfers += 1
            if side.wait_ns is None:
                continue
            act.measured += 1
            act.wait_ns += side.wait_ns
            act.max_wait_ns = max(act.max_wait_ns, side.wait_ns)
            for peer in side.peers:
                act.on[peer] = act.on.get(peer, 0) + side.wait_ns
    for row in stages.values():
        for act in row.actions.values():
            for peer, ns in act.on.items():
                if peer in stages:
                    stages[peer].waited_on_ns += ns
    out = sorted(stages.values(), key=lambda s: s.stage)
    _mark_slowest(out)
    return sorted(out, key=lambda s: (not s.slowest, s.stage))


def _mark_slowest(stages: list[StageWaits]) -> None:
    if len(stages) < 2:
        return
    least, *others = sorted(stages, key=lambda s: s.wait_ns)
    floor = min(s.wait_ns for s in others)
    least.slowest = (floor >= SLOW_FACTOR * least.wait_ns
                     and floor - least.wait_ns >= STRAGGLER_MIN_NS)


def slowest(stages: list[StageWaits]) -> StageWaits | None:
    return next((s for s in stages if s.slowest), None)


def ordered(actions: dict[str, ActionWaits]) -> list[ActionWaits]:
    return sorted(actions.values(), key=lambda a: ACTIONS.index(a.action))
