"""Megatron-core's own GPTModel, schedules, DDP and optimizer on 4 gloo CPU ranks, under
torchrun with ``commviz.start``: several parallel layouts one after another in one launch.

``python megatron_job.py RUN_DIR OUT_DIR [LAYOUT ...]``: each layout (``LAYOUTS``) initializes
Megatron's model parallel state, builds a tiny ``GPTModel`` from its gpt package's local layer
spec and trains ``STEPS`` steps through ``get_forward_backward_func()``; each rank then leaves
``OUT_DIR/rank{R}.pkl``: torch's Flight Recorder entries and commviz's records
(``fr_compare.snapshot``), where each layout's records start (``marks``) and what Megatron
says of each layout's model (``facts``: module names and classes, layer numbers, stage,
buckets). ``TORCH_FR_BUFFER_SIZE`` must be set.

Megatron-core's model, layers, schedules, DDP and optimizer run as shipped. What CPU ranks lack
is stood in for by ``cpu_shim`` (the only change to what Megatron sees):

- ``ToCpu``, a ``TorchFunctionMode``: a tensor made or moved to ``"cuda"`` / a CUDA device
  index (``device=torch.cuda.current_device()``, ``.cuda()``, ``.to("cuda")``) is made on the
  CPU; ``pin_memory`` is dropped; a tensor's ``.type()`` names its CUDA type
  (``torch.cuda.FloatTensor``: Megatron's optimizers take no other);
- ``torch.cuda.current_device`` returns 0, ``torch.cuda.synchronize`` / ``empty_cache`` do
  nothing, ``torch.cuda.Stream`` / ``Event`` / ``stream`` / ``current_stream`` are stand-ins
  that order nothing (CPU work is ordered already), ``torch.cuda.nvtx`` ranges do nothing;
- Megatron's CUDA RNG (``tensor_parallel.random``): the tracker's ``fork`` runs its block under
  a fork of the CPU generator, ``model_parallel_cuda_manual_seed`` seeds the CPU one, and the
  CUDA generator's state that activation recomputation saves and restores
  (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) is an empty stand-in;
- ``moe_utils.te_general_gemm = None``: the MoE router's gating function asks whether
  Transformer Engine's GEMM is there by that name, which 0.16.1 leaves undefined without it;
- the MoE token dispatcher's copy of its split sizes from the GPU (``maybe_move_tensor_to_cpu``,
  which leaves CPU tensors as they are) gives them as numpy arrays, as from a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from torch.overrides import TorchFunctionMode, redispatch_function

STEPS, MICROBATCHES, SEQ, MICRO_BATCH, VOCAB = 2, 4, 8, 2, 64


class Layout(NamedTuple):
    tp: int
    pp: int
    vp: int | None = None          # virtual pipeline stages per rank: the interleaved schedule
    ddp: bool = False              # Megatron's DDP, its distributed optimizer, overlapped grads
    experts: int = 0               # MoE: experts per layer, expert parallelism 2
    recompute: bool = False        # full activation recomputation, one layer at a time
    sp: bool = False               # sequence parallelism (with Megatron's L2Norm: ``_spec``)
    layers: int = 4


LAYOUTS = {
    "pp": Layout(tp=2, pp=2, recompute=True),
    "interleaved": Layout(tp=2, pp=2, vp=2),
    "ddp": Layout(tp=2, pp=1, ddp=True, sp=True),
    "moe": Layout(tp=1, pp=1, ddp=True, experts=4, layers=2),
}


# -- the CPU shim -------------------------------------------------------------------------------

def _cpu(device: Any) -> Any:
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


class ToCpu(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU. A backward pass runs with the
    mode on (``redispatch_function``): activation recomputation makes tensors too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:   # the type's name
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and args and len(args) > 1 and not isinstance(
                args[1], torch.dtype) and not isinstance(args[1], torch.Tensor):
            args = (args[0], _cpu(args[1]), *args[2:])
        if func in (torch.autograd.backward, torch.Tensor.backward, torch.autograd.grad):
            with self:
                return redispatch_function(func, types, args, kwargs)
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event or _Event()


class _Event(_Stream):
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def cpu_shim() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = cuda.empty_cache = lambda *a, **k: None
    cuda.Stream, cuda.Event = _Stream, _Event
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx.range_push = cuda.nvtx.range_pop = lambda *a, **k: None

    @contextlib.contextmanager
    def fork(self: Any, name: str = "") -> Iterator[None]:
        with torch.random.fork_rng(devices=[]):
            yield

    mrandom.CudaRNGStatesTracker.fork = fork
    moe_utils.te_general_gemm = None

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom.model_parallel_cuda_manual_seed = lambda seed, *a, **k: torch.manual_seed(seed)
    ToCpu().__enter__()


# -- the layouts --------------------------------------------------------------------------------

def _spec(layout: Layout) -> Any:
    """The gpt package's local layer spec; with sequence parallelism, its norms Megatron's
    ``L2Norm`` (the torch norm the local spec takes refuses sequence parallelism, Apex's and
    Transformer Engine's need CUDA)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import L2Norm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=layout.experts or None, moe_grouped_gemm=False)
    if not layout.sp:
        return spec
    layer = ModuleSpec(module=spec.module, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=L2Norm, pre_mlp_layernorm=L2Norm))
    return TransformerBlockSubmodules(layer_specs=[layer] * layout.layers, layer_norm=L2Norm)


def _model(layout: Layout, vp_rank: int | None) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layout.layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        recompute_granularity="full" if layout.recompute else None,
        recompute_method="uniform" if layout.recompute else None,
        recompute_num_layers=1 if layout.recompute else None,
        num_moe_experts=layout.experts or None, moe_router_topk=2 if layout.experts else 2,
        expert_model_parallel_size=2 if layout.experts else 1,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, add_bias_linear=False, sequence_parallel=layout.sp)
    return GPTModel(config, _spec(layout), vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_rank),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_rank),
                    vp_stage=vp_rank)


# the (micro-batch, model chunk) of each forward step Megatron's schedule runs, in its order
FORWARDS: list[tuple[int, int]] = []


def _batches(chunk: int) -> Iterator[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    for i in itertools.count():
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
               "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
               "microbatch": i % MICROBATCHES, "chunk": chunk}


def _forward_step(data: Iterator[dict[str, Any]], model: torch.nn.Module) -> Any:
    batch = next(data)
    FORWARDS.append((batch["microbatch"], batch["chunk"]))
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return output.float().mean(), {}

    return out, loss


def _facts(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """What Megatron says of the model on this rank: each chunk's modules (name -> class) and
    transformer layers (name -> ``layer_number``), this rank's pipeline stage."""
    from megatron.core import parallel_state as ps

    return {"modules": [{n: type(m).__name__ for n, m in c.named_modules()} for c in chunks],
            "layers": [{n: m.layer_number for n, m in c.named_modules()
                        if type(m).__name__ == "TransformerLayer"} for c in chunks],
            "stage": ps.get_pipeline_model_parallel_rank()}


def run(layout: Layout) -> dict[str, Any]:
    """Train ``layout`` for ``STEPS`` steps; returns what Megatron says of its model
    (``_facts``) and, with its DDP, its buckets per buffer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(layout.tp, layout.pp, layout.vp,
                                 expert_model_parallel_size=2 if layout.experts else 1)
    torch.manual_seed(0)
    chunks = [_model(layout, v) for v in (range(layout.vp) if layout.vp else [None])]
    facts = _facts(chunks)
    optimizer = None
    if layout.ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=False,
            use_distributed_optimizer=True, bucket_size=2000)
        chunks = [DistributedDataParallel(m.config, ddp_config, m) for m in chunks]
        facts["buckets"] = [len(b.buckets) for m in chunks for b in m.buffers]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                            clip_grad=1.0), chunks)
        chunks[0].config.no_sync_func = chunks[0].no_sync
        chunks[0].config.finalize_model_grads_func = _finalize
    data = [_batches(v) for v in range(len(chunks))]
    FORWARDS.clear()
    for _ in range(STEPS):
        for m in chunks:
            if layout.ddp:
                m.zero_grad_buffer()
        if optimizer is not None:
            optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=data if layout.vp else data[0],
            model=chunks, num_microbatches=MICROBATCHES, seq_length=SEQ,
            micro_batch_size=MICRO_BATCH, forward_only=False)
        if optimizer is not None:
            optimizer.step()
    ps.destroy_model_parallel()
    facts["forwards"] = list(FORWARDS)
    return facts


def _finalize(*args: Any, **kwargs: Any) -> None:
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(*args, **kwargs)


def main(run_dir: Path, out_dir: Path, layouts: list[str]) -> None:
    import torch.distributed as dist

    import commviz
    from fr_compare import snapshot

    cpu_shim()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    commviz.start(run_dir, flush_interval=None)
    marks: list[tuple[str, int]] = []
    facts = {}
    for name in layouts:
        marks.append((name, len(commviz.RECORDER.records())))
        facts[name] = run(LAYOUTS[name])
    marks.append(("end", len(commviz.RECORDER.records())))
    snap = snapshot()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(dict(snap, marks=marks,
                                                                facts=facts)))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/: fr_compare
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] or list(LAYOUTS))
