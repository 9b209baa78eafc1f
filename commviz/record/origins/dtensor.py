"""DTensor: a redistribute's source -> target placements and the module it serves, before any
range (a redistribute inside FSDP's post-backward or a pipeline action is DTensor's): the
module being called (forward, activation checkpointing's recompute), the one its autograd node
was made in (backward), or the one whose gradient FSDP makes local; outside any module, the
gradient-norm function that makes a norm whole (``clip_grad_norm_``, torch's and torchtitan's)
and its caller. Per call: layers called in a loop share call site and sizes, and so may a
redistribute of no known module (a backward's ``from_local``) and one inside a module."""

from __future__ import annotations

import functools
import os
from types import CodeType, FrameType
from typing import Any, Callable

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.frames import Look, torch_path, user_site
from commviz.record.origins.user_names import Names, module_name

# functions that take the norm of a model's gradients, torch's and a framework's of the same
# name (torchtitan's ``clip_grad_norm_`` makes torch's total norm whole itself): a norm
# partial over a mesh dimension is made whole in them, outside any module
GRAD_NORM = frozenset({"clip_grad_norm_", "clip_grad_norm", "get_total_norm", "_get_total_norm",
                       "clip_grads_with_norm_", "_clip_grads_with_norm_"})
_REDISTRIBUTE, _NODE, _OWNER = "dtensor.redistribute", "dtensor.node", "dtensor.owner"


@functools.cache
def _redistributing() -> tuple[CodeType, CodeType]:
    """DTensor's ``Redistribute.forward`` and ``.backward``: asked only while a frame of its
    module runs, so DTensor is never imported for a job that does not use it (importing it
    takes 0.7 s and registers its ops)."""
    from torch.distributed.tensor._redistribute import Redistribute

    return Redistribute.forward.__code__, Redistribute.backward.__code__


def redistribute_file() -> str:
    return torch_path("distributed", "tensor", "_redistribute.py")


def _look_redistribute(frame: FrameType, found: dict[str, Any]) -> None:
    code = frame.f_code
    if code.co_name == "redistribute_local_tensor":
        found.setdefault(_REDISTRIBUTE, frame)
    elif _NODE not in found:
        forward, backward = _redistributing()
        if code is forward or code is backward:
            found[_NODE] = (frame.f_locals.get("ctx"), code is forward)


def _look_fsdp_param(frame: FrameType, found: dict[str, Any]) -> None:
    """FSDP2's FSDPParam making a gradient local (``_get_grad_inner_tensor``): its module."""
    if frame.f_code.co_name == "_get_grad_inner_tensor" and _OWNER not in found:
        found[_OWNER] = getattr(getattr(frame.f_locals.get("self"), "_module_info", None),
                                "module", None)


def _looks() -> dict[str, Look]:
    return {redistribute_file(): _look_redistribute,
            torch_path("distributed", "fsdp", "_fully_shard", "_fsdp_param.py"): _look_fsdp_param}


def placements(spec: Any) -> str:
    return ", ".join(str(p) for p in getattr(spec, "placements", ()))


def _grad_norm(frame: FrameType | None, own: Callable[[CodeType], bool]
               ) -> tuple[str, str | None] | None:
    """The outermost gradient-norm function (``GRAD_NORM``) running at ``frame``, and the
    line outside torch that called it."""
    found = None
    while frame is not None:
        if frame.f_code.co_name in GRAD_NORM:
            found = frame
        frame = frame.f_back
    return None if found is None else (found.f_code.co_name, user_site(found.f_back, own))


def _resolve(call: Call, node_units: Names) -> Origin | None:
    found = call.frames.found
    redistribute = found.get(_REDISTRIBUTE)
    if redistribute is None:
        return None
    loc = redistribute.f_locals
    moved = f"{placements(loc.get('current_spec'))} -> {placements(loc.get('target_spec'))}"
    unit = module_name(call.frames.modules, call.state.modules)
    node, made = found.get(_NODE, (None, False))
    if node is not None:
        if not made:
            unit = unit or node_units.get(node)
        elif unit is not None:
            node_units[node] = unit
    owner = found.get(_OWNER)
    if unit is None and owner is not None:
        unit = call.state.modules.get(owner) or type(owner).__name__
    if unit is None and (norm := _grad_norm(redistribute.f_back, call.own)) is not None:
        unit, at = norm
        where = f" ({os.path.basename(at)})" if at else ""
        return Origin(f"DTensor {unit}{where}: {moved} (grad norm)", md.OriginKind.DTENSOR,
                      unit, moved, refresh=Refresh.ALL)
    return Origin(f"DTensor {unit + ': ' if unit else ''}{moved}", md.OriginKind.DTENSOR,
                  unit, moved, refresh=Refresh.ALL)


# the module each Redistribute node was made in (forward): its backward runs with no module
# called around it
RESOLVER = Resolver("DTensor", _resolve, Names, _looks)
