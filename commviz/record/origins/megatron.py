"""Megatron-core's units, named as its users know them (looked for only once ``megatron.core``
is imported).

Megatron opens no profiler range of its own on CPU, and every collective of its tensor
parallelism comes from the same few lines of ``tensor_parallel/mappings.py`` and ``layers.py``
(layers called in a loop share call site and sizes), so, as for DeepSpeed, the unit comes from
Megatron's own frames, per call:

- tensor parallelism (``tensor_parallel``): the module as Megatron names it with its global
  layer index (``decoder.layers.3.self_attention.linear_proj``, from ``TransformerLayer
  .layer_number``: a later pipeline stage's ``layers.0`` is the model's ``layers.2``), the
  parallelism and the phase: ``TP all-reduce (forward)``, ``TP sequence-parallel all-gather
  (backward)``, ``(recompute)`` under activation recomputation (``CheckpointFunction``). In a
  backward pass no module is called: a linear layer's is found by its ``weight``, an autograd
  function that communicated in its forward keeps the forward's module (``Cache.nodes``);
- expert parallelism: ``EP token dispatch all-to-all``, ``EP token combine all-to-all`` (the
  MoE token dispatcher's);
- pipeline parallelism (``p2p_communication``): ``PP stage 1 send forward, microbatch 3``: the
  direction from which of the stage's tensors is sent or received, the micro-batch (1F1B,
  ``forward_backward_pipelining_without_interleaving``) from the order of its transfers; the
  interleaved schedule's also the model chunk (``..., microbatch 3, model chunk 1``), from
  its ``schedule_table`` and the order of its transfers;
- Megatron's DDP: ``DDP bucket 2 reduce-scatter`` (or all-reduce), ``distributed optimizer
  param all-gather (bucket 0)``; finalizing gradients, the optimizer's norms and checks.

The unit ``report --by unit`` rolls up is the layer and parallelism (``layer 3 TP``), the
pipeline stage, the bucket or the optimizer.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, NamedTuple

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.frames import PackageFrame as _Frame
from commviz.record.origins.frames import package_frames, package_root

_OPS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
        "all_gather": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
        "reduce_scatter": "reduce-scatter", "all_to_all_single": "all-to-all",
        "broadcast": "broadcast", "barrier": "barrier"}
# tensor_parallel/mappings.py's autograd functions: the parallelism each serves, and the
# function of Megatron's that applies it (what names a call no module is known for)
_SP = "TP sequence-parallel"
_MAPPINGS = {
    "_CopyToModelParallelRegion": ("TP", "copy_to_tensor_model_parallel_region"),
    "_ReduceFromModelParallelRegion": ("TP", "reduce_from_tensor_model_parallel_region"),
    "_ScatterToModelParallelRegion": ("TP", "scatter_to_tensor_model_parallel_region"),
    "_GatherFromModelParallelRegion": ("TP", "gather_from_tensor_model_parallel_region"),
    "_AllGatherFromTensorParallelRegion": (
        "TP", "all_gather_last_dim_from_tensor_parallel_region"),
    "_ReduceScatterToTensorParallelRegion": (
        "TP", "reduce_scatter_last_dim_to_tensor_parallel_region"),
    "_ScatterToSequenceParallelRegion": (_SP, "scatter_to_sequence_parallel_region"),
    "_GatherFromSequenceParallelRegion": (_SP, "gather_from_sequence_parallel_region"),
    "_ReduceScatterToSequenceParallelRegion": (_SP, "reduce_scatter_to_sequence_parallel_region"),
    "_AllToAll": ("EP", "all_to_all")}
_LINEAR = "LinearWithGradAccumulationAndAsyncCommunication"
# the MoE token dispatcher's steps
_DISPATCHER = {"preprocess": "token counts", "dispatch_preprocess": "token counts",
               "token_dispatch": "token dispatch", "dispatch_postprocess": "token dispatch",
               "combine_preprocess": "token combine", "token_combine": "token combine"}
# (file under megatron/core, function) -> (unit, what it does)
_NAMED = {
    ("distributed/finalize_model_grads.py", "_allreduce_word_embedding_grads"):
        ("finalize grads", "embedding grads all-reduce"),
    ("distributed/finalize_model_grads.py", "_allreduce_conditional_embedding_grads"):
        ("finalize grads", "conditional embedding grads all-reduce"),
    ("distributed/finalize_model_grads.py", "_allreduce_position_embedding_grads"):
        ("finalize grads", "position embedding grads all-reduce"),
    ("distributed/finalize_model_grads.py", "_allreduce_non_tensor_model_parallel_grads"):
        ("finalize grads", "TP-replicated grads all-reduce"),
    ("distributed/finalize_model_grads.py", "finalize_model_grads"):
        ("finalize grads", "num tokens"),
    ("optimizer/clip_grads.py", "get_grad_norm_fp32"): ("optimizer", "grad norm"),
    ("optimizer/clip_grads.py", "count_zeros_fp32"): ("optimizer", "count zeros"),
    ("optimizer/optimizer.py", "MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan"):
        ("optimizer", "found-inf check"),
    ("distributed/distributed_data_parallel.py", "DistributedDataParallel.broadcast_params"):
        ("DDP", "broadcast params"),
    ("distributed/param_and_grad_buffer.py", "_ParamAndGradBuffer.__init__"):
        ("DDP", "buffer warm-up"),
    ("optimizer/__init__.py", "_get_param_groups"): ("optimizer", "param groups set-up"),
}
_RECOMPUTE = ("tensor_parallel/random.py", "CheckpointFunction.backward")
_P2P = "pipeline_parallel/p2p_communication.py"
_ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
_INTERLEAVED = "forward_backward_pipelining_with_interleaving"
_DIRECTIONS = {"tensor_send_next": "send forward", "tensor_send_prev": "send backward",
               "tensor_recv_prev": "recv forward", "tensor_recv_next": "recv backward"}



class _Model(NamedTuple):
    """A model chunk's modules and parameters by id, named as Megatron names them."""

    modules: dict[int, tuple[str, int | None]]   # id -> (name, global layer index)
    params: dict[int, tuple[str, int | None]]    # id -> its module's (name, layer)


class Cache:
    """What Megatron's units keep: the model chunks seen (their names), the module each
    communicating autograd node was made in, the pipeline transfers counted per direction."""

    def __init__(self) -> None:
        self.models: "weakref.WeakKeyDictionary[Any, _Model]" = weakref.WeakKeyDictionary()
        self.nodes: "weakref.WeakKeyDictionary[Any, tuple[str | None, int | None, str]]" = (
            weakref.WeakKeyDictionary())
        self.transfers: dict[str, int] = {}
        # the interleaved schedule's step: its table, each direction's transfers, those seen
        self.schedule: tuple[Any, dict[str, list[tuple[int, int]]], dict[str, int]] | None = None




def _op(op: str) -> str:
    """The collective as Megatron's docs say it: all-gather, reduce-scatter (coalesced or not)."""
    op = op.removesuffix("_coalesced")
    return _OPS.get(op, op.replace("_", "-"))


def _unwrap(module: Any) -> Any:
    """The model inside Megatron's wrappers (its DDP, ``Float16Module``)."""
    while type(module).__name__ in ("DistributedDataParallel", "Float16Module") and hasattr(
            module, "module"):
        module = module.module
    return module


def _model(root: Any, cache: Cache) -> _Model:
    """``root``'s names: ``named_modules()``'s, each transformer layer's index made global
    (``layer_number`` - 1: a pipeline stage or virtual chunk numbers its layers from 0)."""
    model = cache.models.get(root)
    if model is None:
        layers: list[tuple[str, str, int]] = []       # (local prefix, global prefix, index)
        modules: dict[int, tuple[str, int | None]] = {}
        for path, m in root.named_modules():
            number = getattr(m, "layer_number", None)
            if isinstance(number, int) and path.rpartition(".")[2].isdigit():
                layers.append((path, f"{path.rpartition('.')[0]}.{number - 1}", number - 1))
            name, layer = path, None
            for local, glob, index in layers:
                if path == local or path.startswith(local + "."):
                    name, layer = glob + path[len(local):], index
            modules[id(m)] = (name, layer)
        params = {id(p): modules[id(m)] for m in root.modules()
                  for p in m.parameters(recurse=False)}
        model = cache.models[root] = _Model(modules, params)
    return model


def _roots(frames: list[_Frame], modules: tuple[Any, ...]) -> list[Any]:
    """The model chunks a call may belong to: the schedule's ``model``, else the outermost
    module being called."""
    for f in reversed(frames):
        if f.where == "pipeline_parallel/schedules.py" and "model" in f.frame.f_locals:
            model = f.frame.f_locals["model"]
            return [_unwrap(m) for m in (model if isinstance(model, list) else [model])]
    return [_unwrap(modules[-1])] if modules else []


def _module(call: Call, frames: list[_Frame], cache: Cache, param: Any = None
            ) -> tuple[str | None, int | None]:
    """The (name, global layer) of the innermost module being called, or of ``param``'s."""
    for root in _roots(frames, call.frames.modules):
        model = _model(root, cache)
        if param is not None:
            if id(param) in model.params:
                return model.params[id(param)]
            continue
        for m in call.frames.modules:
            if id(m) in model.modules:
                return model.modules[id(m)]
    return None, None


def _resolve(call: Call, cache: Cache) -> Origin | None:
    if "megatron.core" not in sys.modules:
        return None
    user = call.frames.user      # a call the job's own code makes, under Megatron's schedule
    root = package_root("megatron.core")
    if user is not None and not user.f_code.co_filename.startswith(root):
        return None              # (its loss function, say), is the job's line
    frames = package_frames(call.frame, root, qualified=True)
    if not frames:
        return None
    recompute = any((f.where, f.name) == _RECOMPUTE for f in frames)
    # the outermost of mappings' functions: a backward may apply one (_AllToAll's does)
    mapped = next((f for f in reversed(frames) if f.where == "tensor_parallel/mappings.py"
                   and f.name.rpartition(".")[0] in _MAPPINGS), None)
    if mapped is not None:
        cls, _, method = mapped.name.rpartition(".")
        return _mapped(call, frames, mapped, method, recompute, cache)
    for f in frames:
        cls, _, method = f.name.rpartition(".")
        if f.where == "tensor_parallel/layers.py" and cls == _LINEAR:
            ctx = f.frame.f_locals.get("ctx")
            sp = _SP if getattr(ctx, "sequence_parallel", False) else "TP"
            param = f.frame.f_locals.get("weight") if method == "backward" else None
            module, layer = _module(call, frames, cache, param)
            return _layered(call, module, layer, sp, _phase(method, recompute))
        if f.where == "tensor_parallel/cross_entropy.py":
            return _layered(call, "loss", None, "TP vocab-parallel cross-entropy",
                            _phase(method, recompute))
        if f.where == _P2P:
            return _pipeline(call, frames, cache)
        if f.where == "distributed/param_and_grad_buffer.py" and method in (
                "start_grad_sync", "start_param_sync"):
            return _bucket(call, f, method)
        if (f.where, f.name) in _NAMED:
            unit, what = _NAMED[(f.where, f.name)]
            return _named(f"{unit} {what} {_op(call.op)}", unit, what)
    inner = frames[0]
    unit = inner.name.rpartition(".")[0] or inner.where
    return _named(f"Megatron {inner.name} ({inner.where})", unit, inner.name)


def _phase(method: str, recompute: bool) -> str:
    return "backward" if method == "backward" else "recompute" if recompute else "forward"


def _mapped(call: Call, frames: list[_Frame], f: _Frame, method: str, recompute: bool,
            cache: Cache) -> Origin:
    """A collective of one of ``mappings``' autograd functions. The MoE token dispatcher's
    are expert parallelism's whatever the group; a backward takes what its node's forward
    was (the module, the dispatcher's step) where that communicated, else it is named by the
    function that applied it (``scatter_to_sequence_parallel_region``)."""
    parallelism, function = _MAPPINGS[f.name.rpartition(".")[0]]
    ctx = f.frame.f_locals.get("ctx")
    step = next((_DISPATCHER[d.name.rpartition(".")[2]] for d in frames
                 if d.where.startswith("transformer/moe/token_dispatcher")
                 and d.name.rpartition(".")[2] in _DISPATCHER), None)
    if method == "backward" and ctx is not None and ctx in cache.nodes:
        module, layer, parallelism = cache.nodes[ctx]
    else:
        module, layer = _module(call, frames, cache)
        if step is not None:
            parallelism = f"EP {step}"
        if method == "forward" and ctx is not None and call.count:
            cache.nodes[ctx] = (module, layer, parallelism)
    return _layered(call, module, layer, parallelism, _phase(method, recompute), function)


def _layered(call: Call, module: str | None, layer: int | None, parallelism: str,
             phase: str, function: str | None = None) -> Origin:
    """``decoder.layers.3.self_attention.linear_proj: TP all-reduce (forward)``; its unit the
    layer and parallelism (``layer 3 TP``), else the module's first part (``embedding TP``).
    Where no module is known, ``function`` names it."""
    what = f"{parallelism} {_op(call.op)} ({phase})"
    unit = (f"layer {layer}" if layer is not None else (module or "model").split(".")[0])
    extra: list[tuple[str, Any]] = [(md.MEGATRON_PARALLELISM, parallelism.split(" ")[0])]
    if module:
        extra.append((md.MEGATRON_MODULE, module))
    if layer is not None:
        extra.append((md.MEGATRON_LAYER, layer))
    named = module or function
    return Origin(f"{named}: {what}" if named else what, md.OriginKind.MEGATRON,
                  f"{unit} {parallelism.split(' ')[0]}", phase, tuple(extra), Refresh.ALL)


def _pipeline(call: Call, frames: list[_Frame], cache: Cache) -> Origin:
    """A transfer between pipeline stages: which of the stage's tensors it moves gives its
    direction; under 1F1B, the n-th transfer of a direction in a step is micro-batch n."""
    comm = next((f for f in frames if f.where == _P2P and f.name.endswith("._communicate")),
                None)
    group = getattr(comm.frame.f_locals.get("self"), "pp_group", None) if comm else None
    stage = group.rank() if group is not None else None
    direction = None
    tensor = call.frame.f_locals.get("tensor") if call.frame is not None else None
    for f in frames:
        if f.where == _P2P and f.name in ("_batched_p2p_ops", "_p2p_ops"):
            loc = f.frame.f_locals
            direction = next((d for name, d in _DIRECTIONS.items()
                              if tensor is not None and loc.get(name) is tensor), None)
            break
        if f.where == _P2P and f.name.endswith("._communicate_shapes"):
            direction = "shape exchange"
            break
    direction = direction or call.op
    extra: list[tuple[str, Any]] = [(md.MEGATRON_PARALLELISM, "PP")]
    text = f"PP stage {stage} {direction}"
    schedule = next((f for f in frames if f.name in (_ONE_F_ONE_B, _INTERLEAVED)), None)
    if schedule is not None and direction in _DIRECTIONS.values():
        loc = schedule.frame.f_locals
        if schedule.name == _INTERLEAVED:
            mine = _interleaved(call, loc, direction, cache)
        else:
            n = loc.get("num_microbatches")
            mine = None
            if isinstance(n, int) and n > 0:
                taken = cache.transfers.get(direction, 0)
                if call.count:
                    cache.transfers[direction] = taken + 1
                mine = taken % n, None
        if mine is not None:
            extra.append((md.ORIGIN_MICROBATCH, mine[0]))
            text += f", microbatch {mine[0]}"
            if mine[1] is not None:
                extra.append((md.MEGATRON_CHUNK, mine[1]))
                text += f", model chunk {mine[1]}"
    return Origin(text, md.OriginKind.MEGATRON, f"PP stage {stage}", direction, tuple(extra),
                  Refresh.ALL)


def _interleaved(call: Call, loc: dict[str, Any], direction: str, cache: Cache
                 ) -> tuple[int, int] | None:
    """(micro-batch, model chunk) of the interleaved schedule's transfer: its ``schedule_table``
    ((micro-batch, chunk) per virtual micro-batch, the forward order) gives each stage's sends
    in order: forward, all but the last stage's last chunk; backward, the chunks reversed
    (``get_model_chunk_id(k, forward=False)``), all but the first stage's chunk 0. A receive
    is the previous stage's send (the next one's, backward), in order, its chunk one further
    on where it wraps round from the last stage to the first (one back, backward)."""
    table, stages, chunks = (loc.get("schedule_table"), loc.get("pipeline_parallel_size"),
                             loc.get("num_model_chunks"))
    stage = loc.get("pipeline_parallel_rank")
    if not table or not all(isinstance(x, int) for x in (stages, chunks, stage)):
        return None
    if cache.schedule is None or cache.schedule[0] is not table:    # a new step
        cache.schedule = (table, {}, {})
    _, sequences, taken = cache.schedule
    if direction not in sequences:
        last = chunks - 1
        forward = direction.endswith("forward")
        sender = (stage + (-1 if forward else 1) * direction.startswith("recv")) % stages
        shift = (1 if forward and stage == 0 else -1 if not forward and stage == stages - 1
                 else 0) if direction.startswith("recv") else 0
        sent = ([(m, c) for m, c in table if not (sender == stages - 1 and c == last)]
                if forward else
                [(m, last - c) for m, c in table if not (sender == 0 and c == last)])
        sequences[direction] = [(m, c + shift) for m, c in sent]
    n = taken.get(direction, 0)
    if call.count:
        taken[direction] = n + 1
    sequence = sequences[direction]
    return sequence[n % len(sequence)] if sequence else None


def _bucket(call: Call, f: _Frame, method: str) -> Origin:
    """Megatron DDP's bucket group reducing its gradients (``start_grad_sync``) or, with the
    distributed optimizer, gathering its updated parameters (``start_param_sync``)."""
    index = getattr(f.frame.f_locals.get("bucket"), "bucket_id", None)
    op = _op(call.op)
    extra = ((md.MEGATRON_PARALLELISM, "DP"), (md.MEGATRON_BUCKET, index))
    if method == "start_param_sync":
        return Origin(f"distributed optimizer param {op} (bucket {index})",
                      md.OriginKind.MEGATRON, "distributed optimizer", f"param {op}", extra,
                      Refresh.ALL)
    return Origin(f"DDP bucket {index} {op}", md.OriginKind.MEGATRON, f"DDP bucket {index}", op,
                  extra, Refresh.ALL)


def _named(text: str, unit: str, phase: str) -> Origin:
    return Origin(text, md.OriginKind.MEGATRON, unit, phase, refresh=Refresh.ALL)


RESOLVER = Resolver("Megatron", _resolve, Cache)
