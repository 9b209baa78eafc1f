"""DeepSpeed's units, named as its users know them (looked for only once ``deepspeed`` is
imported).

DeepSpeed opens no profiler range of its own on CPU (its ``instrument_w_nvtx`` ranges go to the
accelerator's NVTX, not to ``record_function``), so, as for pipelining's stages, the units come
from the live frames of DeepSpeed's own functions, as its docs and config name them:

- ZeRO-3: ``ZeRO-3 forward allgather params (layers.0)`` (the partitioned-parameter
  coordinator fetching a module's parameters; the modules named are those whose parameters the
  call gathers, prefetched ones included), ``ZeRO-3 reduce bucket 2`` (the gradient bucket
  ``reduce_bucket_size`` fills, numbered in each backward), ``ZeRO-3 module trace check``;
- ZeRO-1/2: ``ZeRO-2 reduce bucket 0``, ``ZeRO-2 step allgather params`` (the updated
  partitions gathered after the optimizer step);
- any stage: ``ZeRO-1 step gradient norm``, ``ZeRO-3 step overflow check``,
  ``DeepSpeed engine broadcast model`` (at ``initialize``);
- no ZeRO (stage 0): ``DeepSpeed engine gradient allreduce``, ``DeepSpeed engine step gradient
  norm``;
- elsewhere in DeepSpeed: ``DeepSpeed <function> (in <entry>)``: the innermost function of
  the engine or a ZeRO optimizer (else of DeepSpeed outside its communication wrappers), and the
  DeepSpeed function the user called (``initialize``, ``DeepSpeedEngine.step``).

A bucket's parameters are named from the optimizer's own ``param_names`` (the engine's
``named_parameters()``), a module's from the ZeRO-3 offload's ``module.named_modules()``.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any, NamedTuple

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.frames import PackageFrame as _Frame
from commviz.record.origins.frames import package_frames, package_root

ZERO3 = "ZeRO-3"
# (file under deepspeed/, function) -> the unit a call made inside it serves
_GATHER = ("runtime/zero/partitioned_param_coordinator.py", "__all_gather_params")
_TRACE = ("runtime/zero/partitioned_param_coordinator.py", "reset_step")
_PARTITION = ("runtime/zero/partition_parameters.py", "_convert_to_zero_parameters")
_OFFLOAD = {("runtime/zero/parameter_offload.py", f"pre_sub_module_{d}_function")
            for d in ("forward", "backward")}
_BUCKET3 = ("runtime/zero/stage3.py", "__reduce_and_partition_ipg_grads")
_BUCKET12 = ("runtime/zero/stage_1_and_2.py", "reduce_ipg_grads")
_OPTIMIZERS = ("runtime/zero/stage3.py", "runtime/zero/stage_1_and_2.py")
_EPILOGUE = "independent_gradient_partition_epilogue"
_STEP = {"get_grad_norm_direct": "step gradient norm", "has_overflow": "step overflow check",
         "all_gather_dp_groups": "step allgather params"}
_ENGINE = {"_broadcast_model": "broadcast model", "allreduce_gradients": "gradient allreduce",
           "clip_fp32_gradients": "step gradient norm"}
# the engine's and the optimizers' files: their functions name what a call serves
_OWNERS = ("runtime/engine.py", *_OPTIMIZERS)
# DeepSpeed's communication wrappers: never the unit
_WRAPPERS = ("comm/", "utils/nvtx.py", "runtime/comm/")


class Unit(NamedTuple):
    """The DeepSpeed unit a call serves (``_resolve`` makes it an ``Origin`` of kind DeepSpeed,
    worked out per call: DeepSpeed issues every collective from the same few lines of its
    ``comm`` wrappers, so a call's site and sizes do not tell its units apart, a bucket's
    all_reduce and the gradient norm's among them)."""

    text: str
    unit: str
    phase: str
    extra: tuple[tuple[str, Any], ...] = ()





def _stage(frames: list[_Frame]) -> str:
    """The ZeRO stage of the optimizer whose method is running ("ZeRO-2", as DeepSpeed's own
    ``zero_stage_string`` says); ZeRO-3 where only its coordinator is."""
    for f in frames:
        if f.where in _OPTIMIZERS:
            opt = f.frame.f_locals.get("self")
            return getattr(opt, "zero_stage_string", ZERO3)
    return ZERO3


class Cache:
    """What DeepSpeed's units keep: each ZeRO optimizer's buckets, each model's owners of
    parameters."""

    def __init__(self) -> None:
        self.buckets = ZeroBuckets()
        self.owned: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = (
            weakref.WeakKeyDictionary())


def _resolve(call: Call, cache: Cache) -> Origin | None:
    if "deepspeed" not in sys.modules:
        return None
    found = unit(call.frame, call.op, call.count, cache)
    if found is None:
        return None
    # per call: DeepSpeed issues all from a few lines
    return Origin(found.text, md.OriginKind.DEEPSPEED, found.unit, found.phase, found.extra,
                  Refresh.ALL)


def unit(frame: FrameType | None, op: str, count: bool, cache: Cache) -> Unit | None:
    """The DeepSpeed unit a call made from ``frame`` serves; None outside DeepSpeed."""
    frames = package_frames(frame, package_root("deepspeed"))
    if not frames:
        return None
    keys = {(f.where, f.name): f for f in frames}
    if _GATHER in keys:
        return _gathered(keys[_GATHER].frame, next(
            (f.frame for f in frames if (f.where, f.name) in _OFFLOAD), None), cache.owned)
    for bucket in (_BUCKET3, _BUCKET12):
        if bucket in keys:
            return cache.buckets.unit(keys[bucket].frame, _stage(frames), op,
                                any(f.name == _EPILOGUE for f in frames), count)
    for f in frames:
        if (f.where, f.name) == _TRACE:
            return _named(f"{ZERO3} module trace check", ZERO3)
        if (f.where, f.name) == _PARTITION:
            return _named(f"{ZERO3} partition params", ZERO3)
        if f.name in _STEP:
            return _named(f"{_stage(frames)} {_STEP[f.name]}", _stage(frames))
        if f.where == "runtime/engine.py" and f.name in _ENGINE:
            return _named(f"DeepSpeed engine {_ENGINE[f.name]}", "engine")
    inner = next((f for f in frames if f.where in _OWNERS),
                 next((f for f in frames if not f.where.startswith(_WRAPPERS)), frames[0]))
    entry = frames[-1].frame.f_code
    entry_name = getattr(entry, "co_qualname", entry.co_name)
    return _named(f"DeepSpeed {inner.name} (in {entry_name})", entry_name)


def _named(text: str, unit: str) -> Unit:
    return Unit(text, unit, text.removeprefix(unit).strip())


def _gathered(gather: FrameType, offload: FrameType | None,
              owned: "weakref.WeakKeyDictionary[Any, dict[int, str]]") -> Unit:
    """ZeRO-3's all-gather of ``params`` (the coordinator's ``__all_gather_params``): the
    modules whose parameters it gathers, in the model's order."""
    loc = gather.f_locals
    phase = ("forward" if loc.get("forward") else "backward") + " allgather params"
    root = getattr(offload.f_locals.get("self"), "module", None) if offload is not None else None
    names = _owners(root, loc.get("params") or (), owned)
    modules = _span(names) if names else "?"
    return Unit(f"{ZERO3} {phase} ({modules})", modules, phase,
                ((md.ZERO_PARAMS, len(loc.get("params") or ())),))


def _owners(root: Any, params: Any, owned: "weakref.WeakKeyDictionary[Any, dict[int, str]]"
            ) -> list[str]:
    """The names of the modules (in ``root.named_modules()`` order) owning ``params``."""
    if root is None:
        return []
    owner = owned.get(root)
    if owner is None or any(id(p) not in owner for p in params):
        owner = owned[root] = {}
        for name, mod in root.named_modules():
            for p in mod.parameters(recurse=False):
                owner.setdefault(id(p), name or "<root>")
    order = {n: i for i, n in enumerate(dict.fromkeys(owner.values()))}
    return sorted({owner[id(p)] for p in params if id(p) in owner}, key=order.__getitem__)


def _span(names: list[str]) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} … {names[-1]}, {len(names)} modules"


class ZeroBuckets:
    """The gradient buckets of each ZeRO optimizer, numbered 0, 1, ... in each backward:
    a bucket is the optimizer's reduce call (its frame) with its first parameter (each gradient
    is reduced once per backward); the backward's last bucket is reduced by the optimizer's
    ``independent_gradient_partition_epilogue``, after which numbering starts again."""

    def __init__(self) -> None:
        # optimizer -> (this bucket's index, its key, whether it ends the backward)
        self._last: "weakref.WeakKeyDictionary[Any, tuple[int, tuple[int, int], bool]]" = (
            weakref.WeakKeyDictionary())

    def unit(self, frame: FrameType, stage: str, op: str, last: bool, count: bool) -> Unit:
        opt = frame.f_locals.get("self")
        params = _bucket_params(opt, frame)
        key = (id(frame), id(params[0]) if params else 0)
        index, seen, ended = self._last.get(opt, (-1, (0, 0), True))
        if key != seen:
            index = 0 if ended else index + 1
            if count:
                self._last[opt] = (index, key, last)
        elif count and last:
            self._last[opt] = (index, key, True)
        names = getattr(opt, "param_names", None) or {}
        first, final = (names.get(params[0]), names.get(params[-1])) if params else (None, None)
        extra: list[tuple[str, Any]] = [(md.ZERO_BUCKET, index), (md.ZERO_PARAMS, len(params))]
        extra += [(k, n) for k, n in ((md.ZERO_BUCKET_FIRST, first), (md.ZERO_BUCKET_LAST, final))
                  if n]
        phase = op.replace("_", "-").removesuffix("-tensor")
        return Unit(f"{stage} reduce bucket {index}", f"{stage} bucket {index}", phase,
                    tuple(extra))


def _bucket_params(opt: Any, frame: FrameType) -> list[Any]:
    """The parameters of the bucket being reduced, in the bucket's order: ZeRO-3 keeps them
    (``params_in_bucket``), ZeRO-1/2 their (group, index, id) (``bucket.params``)."""
    loc = frame.f_locals
    if "params_in_bucket" in loc:
        return list(loc["params_in_bucket"])
    bucket = loc.get("bucket")
    lookup = getattr(opt, "param_dict", {})
    return [lookup[i] for _, _, i in getattr(bucket, "params", ()) if i in lookup]


RESOLVER = Resolver("DeepSpeed", _resolve, Cache)
