"""Where a recorded call comes from: ``commviz.origin``, one short string, and its parts.

The user's call site says where a call was made; for communication a framework issues it says
little (``model(x)``, ``loss.backward()``) or nothing (DDP's reducer on an autograd thread).
So a record also names the unit of the model the call serves, in torch's own words:

- FSDP2: the module's fully qualified name and the phase, from the ``FSDP::...`` profiler
  ranges FSDP2 opens whether or not a profiler runs (``FSDP::all_gather (layers.0)`` inside
  ``FSDP::pre_forward`` / ``FSDP::pre_backward``, ``FSDP::post_backward_reduce``);
- DDP: the reducer's bucket (``GradBucket.index()``): from the comm hook's ``bucket`` where a
  hook runs, else in the reducer's own order (it reduces bucket 0, 1, ... after each forward);
- DTensor: the module and the source -> target placements of the redistribute, before any
  range (a redistribute inside FSDP's post-backward or a pipeline action is DTensor's): the
  module being called (forward, activation checkpointing's recompute), the one its autograd
  node was made in (backward), or the one whose gradient FSDP makes local; names as the user
  wrote them (``layers.0.attention``, no ``_checkpoint_wrapped_module``); outside any module,
  the gradient-norm function that makes a norm whole (``clip_grad_norm_``) and its caller;
- pipelining, p2p transfers only: the stage, the action and micro-batch (``PP:3F0`` ranges of
  the multi-stage schedules and torch 2.11's ``PP:0SEND_F0``, ``Forward 1`` / ``Backward 1``
  of GPipe; 1F1B in torch 2.13 opens none: the batch's ``desc`` and the order of its
  batches, ``MicroBatches``); the schedule's set-up before its first step (``SETUP``: shape
  inference, the p2p warm-up). A collective a stage's module or loss issues is named by
  what issued it;
- compiled code: the compiled function and its ``file:line`` (a ``Torch-Compiled Region``);
- any call made during a backward pass: the user's line that called ``backward()``.

The boundary kernel keeps the chain of such ranges open on each thread as an id (kernels on
the ops Python's ``record_function`` enters and exits ranges through, ``boundary.cpp``: no
RecordFunction callback, which would make c10d build a profiling range of its own on every
collective); a call's origin is worked out from that chain and the live Python frames once per
call shape (what a call site repeats, with its origin id), so natively recorded calls pay
nothing per call for it. Three kinds resolve per call, through Python: DDP's buckets (buckets
may share a size; without a hook they are numbered in the reducer's order), DTensor
redistributes (layers called in a loop share call site and sizes, and a redistribute of no
known module shares them with one inside a module) and a schedule's set-up transfers (a later
call of their shape is not one). A
1F1B batch's p2p ops are still recorded natively: the kernel asks for each one's micro-batch
(``MicroBatches.of``, a few frames up to the schedule) and keeps a shape per micro-batch.
``COMMVIZ_ORIGIN_RANGES=off`` follows no ranges (``prefixes`` says what that loses).
"""

from __future__ import annotations

import functools
import gc
import os
import re
import sys
import weakref
from collections import Counter
from enum import Enum
from types import CodeType, FrameType
from typing import Any, Callable, NamedTuple

from commviz import metadata as md
from commviz.record import ddp_buckets

# Profiler ranges torch opens around its frameworks' communication (names as torch writes them)
FSDP, PP, FORWARD, BACKWARD, DDP_FORWARD = (
    "FSDP::", "PP:", "Forward ", "Backward ", "DistributedDataParallel.forward")
PREFIXES = (FSDP, PP, FORWARD, BACKWARD, DDP_FORWARD)


def prefixes() -> tuple[str, ...]:
    """The range prefixes the boundary kernel follows; none with ``COMMVIZ_ORIGIN_RANGES=off``
    (origins then come from the frames alone: FSDP modules, DDP buckets without a hook and
    GPipe micro-batches are not named)."""
    return () if os.environ.get("COMMVIZ_ORIGIN_RANGES", "on") == "off" else PREFIXES


# What a pipelining schedule does before its first step, by the function that does it: torch
# 2.11 infers a stage's shapes (``_shape_inference``), torch 2.13 warms its p2p up (a vote) and
# infers forward and backward metadata
SETUP = {"_shape_inference": "shape inference", "_prepare_forward_infra": "shape inference",
         "_prepare_backward_infra": "shape inference", "_warmup_p2p": "p2p warm-up"}
_FSDP_RANGE = re.compile(r"FSDP::(\w+)(?: \((.*)\)| for (.*))?$")
_SEP = os.sep


class Refresh(Enum):
    """What a later call of the same shape (call site, ranges, sizes) must work out again."""

    NOTHING = 0      # the shape's origin holds for each of its calls
    ALL = 1          # DDP buckets (may share a size), DTensor in a module (layers in a loop)
    MICROBATCH = 2   # batched p2p of a schedule without ranges: the micro-batch (MicroBatches)


class Origin(NamedTuple):
    """What a record says of where it comes from (``as_keys``: its metadata keys)."""

    text: str
    kind: md.OriginKind
    unit: str | None = None       # FSDP module, DDP bucket, pipeline stage, compiled function
    phase: str | None = None      # FSDP phase, pipeline action, DTensor placements
    extra: tuple[tuple[str, Any], ...] = ()
    refresh: Refresh = Refresh.NOTHING

    def as_keys(self, backward_site: str | None) -> dict[str, Any]:
        keys = {md.ORIGIN: self.text, md.ORIGIN_KIND: str(self.kind)}
        if self.unit is not None:
            keys[md.ORIGIN_UNIT] = self.unit
        if self.phase is not None:
            keys[md.ORIGIN_PHASE] = self.phase
        if backward_site is not None:
            keys[md.BACKWARD_CALLSITE] = backward_site
        keys.update(self.extra)
        return keys


def _torch_path(*parts: str) -> str:
    import torch

    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), *parts)


class _Places(NamedTuple):
    """torch's files (and functions) whose frames say what a call serves."""

    engine: str          # autograd's _engine_run_backward: a backward pass
    redistribute: str    # DTensor's redistribute_local_tensor
    fsdp_param: str      # FSDP2's FSDPParam (a gradient made local: _get_grad_inner_tensor)
    schedules: str       # pipelining's schedules
    stage: str           # pipelining's stages
    compilers: tuple[str, ...]   # dynamo, AOTAutograd, inductor: compiled code runs here
    module: str          # nn.Module's _call_impl
    aot: str             # AOTAutograd's runtime wrappers: a compiled graph's forward, backward


_places: _Places | None = None


def _where() -> _Places:
    global _places
    if _places is None:
        _places = _Places(
            _torch_path("autograd", "graph.py"),
            _torch_path("distributed", "tensor", "_redistribute.py"),
            _torch_path("distributed", "fsdp", "_fully_shard", "_fsdp_param.py"),
            _torch_path("distributed", "pipelining", "schedules.py"),
            _torch_path("distributed", "pipelining", "stage.py"),
            tuple(_torch_path(d) + _SEP for d in ("_dynamo", "_functorch", "_inductor")),
            _torch_path("nn", "modules", "module.py"),
            _torch_path("_functorch", "_aot_autograd", "runtime_wrappers.py"))
    return _places


@functools.cache
def _redistributing() -> tuple[CodeType, CodeType]:
    """DTensor's ``Redistribute.forward`` and ``.backward``: asked only while a frame of its
    module runs, so DTensor is never imported for a job that does not use it (importing it
    takes 0.7 s and registers its ops)."""
    from torch.distributed.tensor._redistribute import Redistribute

    return Redistribute.forward.__code__, Redistribute.backward.__code__


# -- the frames: one walk, reading only the frames that name a unit -----------------------------

class Frames(NamedTuple):
    """What the live Python frames of a call say (``read``)."""

    user: FrameType | None          # the call site's frame (the first outside torch/commviz)
    backward: str | None            # "file:line" of the user's backward() call
    compiled: FrameType | None      # the compiled function's frame, under compiled code
    redistribute: FrameType | None  # DTensor's redistribute_local_tensor
    node: Any                       # its Redistribute's autograd node (``ctx``), if any
    made: bool                      # ``node`` is being made (forward), not run (backward)
    owner: Any                      # the module whose parameter's gradient FSDP makes local
    modules: tuple[Any, ...]        # nn.Modules being called, innermost first
    stage: Any                      # the pipeline stage whose schedule or setup is running
    setup: str | None               # the schedule's set-up before its first step (``SETUP``)
    batch: str | None               # pipelining's batch label (``desc``: "fwd_send", ...)
    bucket: Any                     # the DDP comm hook's GradBucket
    from_cpp: bool                  # no Python between the engine (or nothing) and the call
    aot: tuple[int, bool] | None    # the AOTAutograd graph (``_aot_id``) whose code runs it,
                                    # and whether its backward does


def _site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def read(frame: FrameType | None, own: Callable[[CodeType], bool]) -> Frames:
    """Walk the frames from ``frame`` (the caller of the c10d op) outwards."""
    places = _where()
    user = compiled = redistribute = stage = node = owner = None
    backward = batch = bucket = None
    modules: list[Any] = []
    setup = aot = None
    seen_compiler = made = False
    from_cpp = frame is None or (frame.f_code.co_name == "_engine_run_backward"
                                 and frame.f_code.co_filename == places.engine)
    if frame is None:
        backward = _backward_elsewhere(own)
    while frame is not None:
        code = frame.f_code
        name, file = code.co_name, code.co_filename
        if bucket is None and "bucket" in code.co_varnames:
            bucket = _grad_bucket(frame.f_locals.get("bucket"))
        if not own(code):
            if file.startswith("<eval_with_key>"):
                seen_compiler = True
            elif user is None:
                user = frame
                compiled = frame if seen_compiler else None
        elif file == places.module:         # the most frequent: each module called, thrice
            if name == "_call_impl" and (mod := frame.f_locals.get("self")) is not None:
                modules.append(mod)
        elif file == places.engine and name == "_engine_run_backward":
            if backward is None:
                backward = _user_site(frame.f_back, own)
        elif file == places.redistribute:
            if name == "redistribute_local_tensor":
                redistribute = redistribute or frame
            elif node is None and ((forward := _redistributing()[0]) is code
                                   or _redistributing()[1] is code):
                node, made = frame.f_locals.get("ctx"), code is forward
        elif file == places.fsdp_param and name == "_get_grad_inner_tensor" and owner is None:
            owner = getattr(getattr(frame.f_locals.get("self"), "_module_info", None), "module",
                            None)
        elif file == places.schedules:
            if name in ("_batch_p2p", "_sorted_batch_p2p"):
                batch = batch or frame.f_locals.get("desc")
            elif name == "_step_microbatches" and stage is None:
                stage = getattr(frame.f_locals.get("self"), "_stage", None)
            setup = setup or SETUP.get(name)
        elif file == places.stage:
            if stage is None:
                stage = _stage(frame.f_locals.get("self"))
            setup = setup or SETUP.get(name)
        elif file.startswith(places.compilers):
            seen_compiler = True
            if aot is None and file == places.aot and name in ("forward", "backward"):
                # CompiledFunction's: its ctx is the graph's autograd node in both
                graph = getattr(getattr(frame.f_locals.get("ctx"), "_forward_cls", None),
                                "_aot_id", None)
                aot = None if graph is None else (graph, name == "backward")
        frame = frame.f_back
    return Frames(user, backward, compiled, redistribute, node, made, owner, tuple(modules),
                  stage, setup, batch, bucket, from_cpp, aot)


def _stage(obj: Any) -> Any:
    return obj if hasattr(obj, "stage_index") else None


def _user_site(frame: FrameType | None, own: Callable[[CodeType], bool]) -> str | None:
    while frame is not None and own(frame.f_code):
        frame = frame.f_back
    return None if frame is None else _site(frame)


def _backward_elsewhere(own: Callable[[CodeType], bool]) -> str | None:
    """On an autograd device thread (no Python frame): the line of the thread blocked in a
    backward pass (it waits in ``_engine_run_backward``, its frames still; the GIL is held)."""
    engine = _where().engine
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_engine_run_backward" and code.co_filename == engine:
                return _user_site(frame.f_back, own)
            frame = frame.f_back
    return None


def _grad_bucket(value: Any) -> Any:
    import torch.distributed as dist

    return value if isinstance(value, dist.GradBucket) else None


# -- names of things ---------------------------------------------------------------------------

# the segments torch's wrappers add to a module's name (activation checkpointing, compile,
# FSDP1): not the user's
_WRAPPERS = re.compile(r"(?:^|\.)(?:_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)"
                       r"(?=\.|$)")
# every module seen so far, by the name the outermost module called around it gives it
class Names:
    """A name per live object, looked up by ``id`` (a hash and no weak reference made per
    look-up: a DTensor origin looks up two per call); an entry goes with its object."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, str]] = {}

    def get(self, obj: Any, default: str | None = None) -> str | None:
        entry = self._by_id.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else default

    def __setitem__(self, obj: Any, name: str) -> None:
        key = id(obj)
        self._by_id[key] = (weakref.ref(obj, lambda _, by_id=self._by_id: by_id.pop(key, None)),
                            name)


_module_names = Names()


def as_written(name: str) -> str:
    """A module's name as the user wrote it: ``layers.0._checkpoint_wrapped_module.attention``
    is ``layers.0.attention``."""
    return _WRAPPERS.sub("", name).lstrip(".") if "_" in name else name


def module_name(modules: tuple[Any, ...]) -> str | None:
    """The fully qualified name of the innermost module being called (``named_modules()``'s
    name in the outermost one, wrappers left out); None outside any module call. A module
    called without its model around it (a block recomputed by activation checkpointing) keeps
    the name its model gave it."""
    return _named(modules[0], modules[-1]) if modules else None


def _named(module: Any, root: Any) -> str:
    name = _module_names.get(module)
    if name is None or _module_names.get(root) is None:
        prefix = _module_names.get(root, "")
        for sub, m in root.named_modules():
            _module_names[m] = as_written(f"{prefix}.{sub}" if prefix and sub else prefix or sub)
        name = _module_names.get(module)
    return type(module).__name__ if name is None else name


_param_names: dict[int, str] = {}


def param_name(param: Any) -> str | None:
    """A DDP parameter's name in its module (``DistributedDataParallel.module``); the
    DDP instances are found once, and again when a parameter is new to them."""
    name = _param_names.get(id(param))
    if name is None:
        from torch.nn.parallel import DistributedDataParallel

        for obj in gc.get_objects():
            if isinstance(obj, DistributedDataParallel):
                _param_names.update((id(p), n) for n, p in obj.module.named_parameters())
        name = _param_names.get(id(param))
    return name


def placements(spec: Any) -> str:
    return ", ".join(str(p) for p in getattr(spec, "placements", ()))


# -- the origin of a call ----------------------------------------------------------------------

class DdpCount:
    """The reducer's bucket order: it reduces bucket 0, 1, ... after each DDP forward
    (``prepare_for_backward``), so the n-th reducer all_reduce since the last forward is
    bucket n. Forwards are counted by the boundary kernel (``DistributedDataParallel.forward``
    ranges entered)."""

    def __init__(self) -> None:
        self.forwards = -1
        self.next = 0

    def take(self, forwards: int, count: bool) -> int:
        """The bucket of this call (``count``: False to look without taking it)."""
        if forwards != self.forwards:
            self.forwards, self.next = forwards, 0
        self.next += count
        return self.next - count


NATIVE: Any = None          # the boundary kernel's module (origin_path, origin_count)
DDP_ORDER = DdpCount()


def ranges(origin_id: int) -> list[str]:
    return NATIVE.origin_path(origin_id) if origin_id and NATIVE is not None else []


def _fsdp(names: list[str], op: str) -> Origin | None:
    parsed = [m.groups() for n in names if (m := _FSDP_RANGE.match(n))]
    if not parsed:
        return None
    labels = [label for label, _, _ in parsed]
    backward = any("backward" in label for label in labels)
    for label, fqn, target in reversed(parsed):
        if label in ("post_backward_reduce", "post_backward_rs_wait"):
            phase = "reduce-scatter" if op.startswith("reduce_scatter") else op.replace("_", "-")
            break
        if label == "all_gather":
            phase = ("backward" if backward else "forward") + " all-gather"
            break
    else:
        label, fqn, target = parsed[-1]
        phase = label.replace("_", " ")
    unit = as_written(fqn if fqn is not None else (target or ""))
    return Origin(f"FSDP {phase} ({unit or '<root>'})", md.OriginKind.FSDP, unit, phase)


def _pipeline(names: list[str], frames: Frames, op: str, kind: str) -> Origin | None:
    """A schedule's transfer: its set-up's, or a p2p op of an action (a ``PP:`` range as
    torch 2.11 and 2.13 name them, ``PP:0SEND_F0`` or ``PP:3F0``; GPipe's ``Forward 1``; or
    1F1B's batch, ``desc``). A collective a stage's module or loss issues, in an action or
    in the set-up, is named by what issued it."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    if kind != "p2p":
        return None
    stage = getattr(frames.stage, "stage_index", None)
    if frames.setup is not None and stage is not None:    # once: no later call takes it over
        return Origin(f"{PP}{stage} {frames.setup}", md.OriginKind.PIPELINE, f"stage {stage}",
                      frames.setup, refresh=Refresh.ALL)
    action = None
    for name in reversed(names):
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
        text = PP + str(action)
        return Origin(text, md.OriginKind.PIPELINE, f"stage {action.stage_index}",
                      action.computation_type.value,
                      ((md.ORIGIN_MICROBATCH, action.microbatch_index),)
                      if action.microbatch_index is not None else ())
    if stage is None or frames.batch is None:
        return None
    phase = _batch_phase(frames.batch, op in ("send", "isend"))
    if phase is not None:       # the micro-batch is per call (``MicroBatches``)
        return Origin(f"{PP}{stage}{phase} ({frames.batch})", md.OriginKind.PIPELINE,
                      f"stage {stage}", phase, refresh=Refresh.MICROBATCH)
    return Origin(f"{PP}{stage} {frames.batch}", md.OriginKind.PIPELINE, f"stage {stage}",
                  frames.batch)


# the module each DTensor Redistribute node was made in (forward): its backward runs with no
# module called around it
_node_units = Names()

# functions that take the norm of a model's gradients, torch's and a framework's of the same
# name (torchtitan's ``clip_grad_norm_`` makes torch's total norm whole itself): a norm
# partial over a mesh dimension is made whole in them, outside any module
GRAD_NORM = frozenset({"clip_grad_norm_", "clip_grad_norm", "get_total_norm", "_get_total_norm",
                       "clip_grads_with_norm_", "_clip_grads_with_norm_"})


def _grad_norm(frame: FrameType | None, own: Callable[[CodeType], bool]
               ) -> tuple[str, str | None] | None:
    """The outermost gradient-norm function (``GRAD_NORM``) running at ``frame``, and the
    line outside torch that called it."""
    found = None
    while frame is not None:
        if frame.f_code.co_name in GRAD_NORM:
            found = frame
        frame = frame.f_back
    return None if found is None else (found.f_code.co_name, _user_site(found.f_back, own))


def _dtensor(frames: Frames, own: Callable[[CodeType], bool]) -> Origin:
    """A DTensor redistribute's origin: its placements and the module it serves: the module
    being called (forward, activation checkpointing's recompute), the one its autograd node
    was made in (backward), or the one whose parameter's gradient FSDP makes local; outside
    any module, the gradient-norm function that makes a norm whole (``clip_grad_norm_``)."""
    loc = frames.redistribute.f_locals
    moved = f"{placements(loc.get('current_spec'))} -> {placements(loc.get('target_spec'))}"
    unit = module_name(frames.modules)
    if frames.node is not None:
        if not frames.made:
            unit = unit or _node_units.get(frames.node)
        elif unit is not None:
            _node_units[frames.node] = unit
    if unit is None and frames.owner is not None:
        unit = _module_names.get(frames.owner) or type(frames.owner).__name__
    if unit is None and (norm := _grad_norm(frames.redistribute.f_back, own)) is not None:
        unit, at = norm
        where = f" ({os.path.basename(at)})" if at else ""
        return Origin(f"DTensor {unit}{where}: {moved} (grad norm)", md.OriginKind.DTENSOR,
                      unit, moved, refresh=Refresh.ALL)
    # per call: layers called in a loop share call site and sizes, and so may a redistribute
    # of no known module (a backward's from_local) and one inside a module
    return Origin(f"DTensor {unit + ': ' if unit else ''}{moved}", md.OriginKind.DTENSOR,
                  unit, moved, refresh=Refresh.ALL)


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
        schedules = _where().schedules
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


MICRO_BATCHES = MicroBatches()


def _hooked(bucket: Any) -> ddp_buckets.Bucket | None:
    """What the comm hook's ``GradBucket`` holds."""
    params = bucket.parameters()
    if not params:
        return None
    return ddp_buckets.Bucket(len(params), bucket.buffer().numel() * bucket.buffer().element_size(),
                              param_name(params[0]), param_name(params[-1]))


def _bucket(index: int, nbytes: int, held: ddp_buckets.Bucket | None,
            extra: list[tuple[str, Any]]) -> Origin:
    extra = [(md.DDP_BUCKET, index), (md.DDP_BUCKET_BYTES, nbytes), *extra]
    if held is not None:
        extra += [(md.DDP_BUCKET_PARAMS, held.params), (md.DDP_BUCKET_BYTES, held.nbytes)]
        extra += [(key, name) for key, name in ((md.DDP_BUCKET_FIRST, held.first),
                                                (md.DDP_BUCKET_LAST, held.last)) if name]
    return Origin(f"DDP bucket {index}", md.OriginKind.DDP, f"bucket {index}", "all-reduce",
                  tuple(dict(extra).items()), Refresh.ALL)


# AOTAutograd graph id -> (qualname, "file:line") of the compiled function whose forward ran it
COMPILED_GRAPHS: dict[int, tuple[str, str]] = {}


def _compiled_backward(aot: int) -> Origin:
    """A compiled graph's backward (on a GPU autograd's device thread, no frame of the user's;
    on CPU, under the line that called ``backward()``): named by the region whose forward ran
    that graph (seen by an earlier record), else by AOTAutograd's graph id. Per call: graphs
    of one shape may be different regions'."""
    qualname, at = COMPILED_GRAPHS.get(aot, (f"AOT graph {aot}", None))
    where = f" ({os.path.basename(at)})" if at else ""
    return Origin(f"Torch-Compiled Region: {qualname}{where} backward", md.OriginKind.COMPILED,
                  qualname, "backward", ((md.COMPILED_AT, at),) if at else (), Refresh.ALL)


def resolve(origin_id: int, op: str, kind: str, numel: int, nbytes: int,
            frame: FrameType | None, own: Callable[[CodeType], bool], count: bool = True
            ) -> tuple[dict[str, Any], Refresh]:
    """A call's origin keys, and what of them a later call of its shape must work out again
    (``count``: False where the call is only being looked at, not recorded)."""
    frames = read(frame, own)
    names = ranges(origin_id)
    # DTensor first: its redistribute names the module even inside FSDP's or a schedule's range
    origin = None if frames.redistribute is None else _dtensor(frames, own)
    if origin is None:
        origin = _fsdp(names, op)
    if origin is None and "deepspeed" in sys.modules:   # its units, from its frames
        from commviz.record import origin_deepspeed
        found = origin_deepspeed.unit(frame, op, count)
        if found is not None:       # per call: DeepSpeed issues all from a few lines
            origin = Origin(found.text, md.OriginKind.DEEPSPEED, found.unit, found.phase,
                            found.extra, Refresh.ALL)
    if origin is None and (frames.stage is not None or any(
            n.startswith((PP, FORWARD, BACKWARD)) for n in names)):
        origin = _pipeline(names, frames, op, kind)
    if origin is None and frames.bucket is not None:
        origin = _bucket(frames.bucket.index(), nbytes, _hooked(frames.bucket), [])
    if origin is None and frames.from_cpp and op == "all_reduce" and NATIVE is not None:
        forwards = NATIVE.origin_count(DDP_FORWARD)
        if forwards:
            index = DDP_ORDER.take(forwards, count)
            if ddp_buckets.used_map(index, numel):
                origin = Origin("DDP unused-parameter map", md.OriginKind.DDP,
                                "unused parameters", "all-reduce", refresh=Refresh.ALL)
            else:
                origin = _bucket(index, nbytes, ddp_buckets.lookup(index, nbytes),
                                 [(md.DDP_BUCKET_NUMEL, numel)])
    if origin is None and any(n == DDP_FORWARD for n in names):
        origin = Origin("DDP forward", md.OriginKind.DDP, None, "forward")
    if origin is None and frames.aot is not None and frames.aot[1]:
        origin = _compiled_backward(frames.aot[0])
    if origin is None and frames.compiled is not None:
        code = frames.compiled.f_code
        at = f"{code.co_filename}:{code.co_firstlineno}"
        qualname = getattr(code, "co_qualname", code.co_name)
        origin = Origin(f"Torch-Compiled Region: {qualname} ({os.path.basename(at)})",
                        md.OriginKind.COMPILED, qualname, None, ((md.COMPILED_AT, at),))
        if frames.aot is not None:
            COMPILED_GRAPHS[frames.aot[0]] = (qualname, at)
    if origin is None and frames.user is not None:
        code = frames.user.f_code
        origin = Origin(f"{os.path.basename(code.co_filename)}:{frames.user.f_lineno}",
                        md.OriginKind.USER)
    if origin is None and frames.backward is not None:
        origin = Origin(f"backward ({os.path.basename(frames.backward)})", md.OriginKind.BACKWARD)
    if origin is None:
        origin = Origin(f"c10d {op} (no Python caller)", md.OriginKind.UNKNOWN)
    return origin.as_keys(frames.backward), origin.refresh
