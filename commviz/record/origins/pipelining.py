"""torch's pipelining, p2p transfers only: the stage, the action and micro-batch (``PP:3F0``
ranges of the multi-stage schedules and torch 2.11's ``PP:0SEND_F0``, ``Forward 1`` /
``Backward 1`` of GPipe; 1F1B in torch 2.13 opens none: the batch's ``desc`` and the order of
its batches, ``MicroBatches``); the schedule's set-up before its first step (``SETUP``: shape
inference, the p2p warm-up). A collective a stage's module or loss issues is named by what
issued it.

A 1F1B batch's p2p ops are recorded natively: the boundary kernel asks for each one's
micro-batch (``MicroBatches.of``, a few frames up to the schedule) and keeps a shape per
micro-batch."""

from __future__ import annotations

import functools
import re
import weakref
from collections import Counter
from types import FrameType
from typing import Any

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.frames import Look, torch_path

PP, FORWARD, BACKWARD = "PP:", "Forward ", "Backward "
# What a schedule does before its first step, by the function that does it: torch 2.11 infers
# a stage's shapes (``_shape_inference``), torch 2.13 warms its p2p up (a vote) and infers
# forward and backward metadata
SETUP = {"_shape_inference": "shape inference", "_prepare_forward_infra": "shape inference",
         "_prepare_backward_infra": "shape inference", "_warmup_p2p": "p2p warm-up"}
_STAGE, _SETUP, _BATCH = "pp.stage", "pp.setup", "pp.batch"


@functools.cache
def _schedules() -> str:
    return torch_path("distributed", "pipelining", "schedules.py")


def _look_schedules(frame: FrameType, found: dict[str, Any]) -> None:
    name = frame.f_code.co_name
    if name in ("_batch_p2p", "_sorted_batch_p2p"):
        if not found.get(_BATCH):
            found[_BATCH] = frame.f_locals.get("desc")
    elif name == "_step_microbatches" and found.get(_STAGE) is None:
        found[_STAGE] = getattr(frame.f_locals.get("self"), "_stage", None)
    if not found.get(_SETUP):
        found[_SETUP] = SETUP.get(name)


def _look_stage(frame: FrameType, found: dict[str, Any]) -> None:
    if found.get(_STAGE) is None:
        stage = frame.f_locals.get("self")
        found[_STAGE] = stage if hasattr(stage, "stage_index") else None
    if not found.get(_SETUP):
        found[_SETUP] = SETUP.get(frame.f_code.co_name)


def _looks() -> dict[str, Look]:
    return {_schedules(): _look_schedules,
            torch_path("distributed", "pipelining", "stage.py"): _look_stage}


def _resolve(call: Call, _: Any) -> Origin | None:
    """A schedule's transfer: its set-up's, or a p2p op of an action."""
    found = call.frames.found
    stage_obj = found.get(_STAGE)
    if call.kind != "p2p" or (stage_obj is None and not any(
            n.startswith((PP, FORWARD, BACKWARD)) for n in call.ranges)):
        return None
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    op, stage, setup = call.op, getattr(stage_obj, "stage_index", None), found.get(_SETUP)
    if setup and stage is not None:    # once: no later call takes it over
        return Origin(f"{PP}{stage} {setup}", md.OriginKind.PIPELINE, f"stage {stage}",
                      setup, refresh=Refresh.ALL)
    action = None
    for name in reversed(call.ranges):
        if name.startswith(PP):
            try:
                action = _Action.from_str(name[len(PP):])
            except (RuntimeError, ValueError, KeyError):
                continue
            break
        if name.startswith((FORWARD, BACKWARD)) and name.split(" ")[-1].isdigit() \
                and stage is not None:
            forward = name.startswith(FORWARD)
            sent = op in ("send", "isend")
            ctype = _ComputationType.from_str(("SEND_" if sent else "RECV_") +
                                              ("F" if forward else "B"))
            action = _Action(stage, ctype, int(name.split(" ")[-1]))
            break
    if action is not None:
        return Origin(PP + str(action), md.OriginKind.PIPELINE, f"stage {action.stage_index}",
                      action.computation_type.value,
                      ((md.ORIGIN_MICROBATCH, action.microbatch_index),)
                      if action.microbatch_index is not None else ())
    batch = found.get(_BATCH)
    if stage is None or batch is None:
        return None
    phase = _batch_phase(batch, op in ("send", "isend"))
    if phase is not None:       # the micro-batch is per call (``MicroBatches``)
        return Origin(f"{PP}{stage}{phase} ({batch})", md.OriginKind.PIPELINE,
                      f"stage {stage}", phase, refresh=Refresh.MICROBATCH)
    return Origin(f"{PP}{stage} {batch}", md.OriginKind.PIPELINE, f"stage {stage}", batch)


def _batch_phase(desc: str | None, sent: bool) -> str | None:
    """The action of a send (or receive) in a pipelining batch described by ``desc``
    (``fwd_send_bwd_recv``: its sends are SEND_F, its receives RECV_B)."""
    part = next((p for p in re.findall(r"(fwd|bwd)_(send|recv)", desc or "")
                 if (p[1] == "send") == sent), None)
    return None if part is None else ("SEND_" if sent else "RECV_") + part[0][0].upper()


class MicroBatches:
    """The micro-batch of each p2p op of a single-stage schedule that opens no range (1F1B),
    worked out per call from a few frames: the schedule fuses sends and receives of different
    micro-batches into one batch (``fwd_send_bwd_recv``: the forward just run, the backward to
    come). A stage sends and receives its micro-batches in order, one batch part each, so a
    part's micro-batch is how many parts of its action the schedule ran before, modulo the
    micro-batches of a step. A batch is known by its first ``P2POp`` (held weakly)."""

    def __init__(self) -> None:
        self._batches: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = (
            weakref.WeakKeyDictionary())
        self._runs: "weakref.WeakKeyDictionary[Any, Counter[str]]" = weakref.WeakKeyDictionary()

    def keys(self, keys: dict[str, Any], frame: FrameType | None) -> dict[str, Any]:
        """``keys`` of a batched p2p call made from ``frame``, its micro-batch added."""
        found = self._find(frame, keys[md.ORIGIN_PHASE])
        if found is None:
            return keys
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        stage, microbatch = found
        action = _Action(stage, _ComputationType.from_str(keys[md.ORIGIN_PHASE]), microbatch)
        return dict(keys, **{md.ORIGIN: PP + str(action), md.ORIGIN_MICROBATCH: microbatch})

    def of(self, frame: FrameType | None, sent: bool) -> int | None:
        """The micro-batch of a batched send (or receive) made from ``frame``, if any (the
        boundary kernel's shapes of such calls are per micro-batch)."""
        found = self._find(frame, None, sent)
        return None if found is None else found[1]

    def _find(self, frame: FrameType | None, phase: str | None, sent: bool = False
              ) -> tuple[int, int] | None:
        """(stage, micro-batch) of the p2p call made from ``frame`` whose batch part is
        ``phase`` (None: the part its batch's description gives a send, ``sent``, or a
        receive)."""
        batch = step = None
        schedules = _schedules()
        while frame is not None and step is None:    # the op, batch_isend_irecv, the schedule
            code = frame.f_code
            if code.co_filename == schedules:
                if code.co_name == "_batch_p2p":
                    batch = frame
                elif code.co_name == "_step_microbatches":
                    step = frame
            frame = frame.f_back
        if batch is None or step is None:
            return None
        ops, desc = batch.f_locals.get("p2p_ops"), batch.f_locals.get("desc")
        schedule = step.f_locals.get("self")
        n = getattr(schedule, "_n_microbatches", None)
        stage = getattr(getattr(schedule, "_stage", None), "stage_index", None)
        if not ops or not n or stage is None:
            return None
        taken = self._batches.get(ops[0])
        if taken is None:
            import torch.distributed as dist

            runs = self._runs.setdefault(schedule, Counter())
            taken = self._batches[ops[0]] = {}
            for action in {_batch_phase(desc, o.op is dist.isend) for o in ops} - {None}:
                taken[action], runs[action] = runs[action] % n, runs[action] + 1
        microbatch = taken.get(phase or _batch_phase(desc, sent))
        return None if microbatch is None else (stage, microbatch)


RESOLVER = Resolver("pipelining", _resolve, MicroBatches, _looks, (PP, FORWARD, BACKWARD))
