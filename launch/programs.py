"""Real training programs as launch entrypoints: what the ``configs/programs-*.yaml`` run.

Each is an ordinary PyTorch program (DDP, FSDP2, tensor parallel, pipelining, a p2p ring, a
compiled step), written as a user would, against plain ``torch.distributed``: commviz sees
their collectives at c10d, whoever issues them. ``function(ctx)`` builds the model once and
returns the step (``commviz.launch.workloads`` runs, profiles and, with ``cuda_graphs``,
captures it). They run on CPU with gloo as well as on GPUs with NCCL; ``ctx.args`` holds the
config's ``workload.args``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from commviz.launch.workloads import Context

Step = Callable[[], None]


def _mlp(width: int, layers: int, seed: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(layers)]).to(device)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor,
                clip: float | None = None) -> Step:
    def step() -> None:
        model(batch).square().mean().backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def ddp(ctx: Context) -> Step:
    """DistributedDataParallel; ``args.hook``: none | allreduce | fp16 (torch's comm hooks);
    ``args.bucket_cap_mb`` sets the reducer's bucket size, so a small model still has several."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    a = ctx.args
    model = _mlp(a.get("width", 256), a.get("layers", 6), ctx.seed, ctx.device)
    wrapped = DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                  bucket_cap_mb=a.get("bucket_cap_mb", 0.25))
    hook = a.get("hook", "none")
    if hook != "none":
        wrapped.register_comm_hook(None, {"allreduce": default_hooks.allreduce_hook,
                                          "fp16": default_hooks.fp16_compress_hook}[hook])
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    batch = torch.randn(a.get("batch", 32), a.get("width", 256), device=ctx.device)
    return _train_step(wrapped, opt, batch)


def _mesh(ctx: Context, name: str | None = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,),
                            mesh_dim_names=(name,) if name else None)


def fsdp2(ctx: Context) -> Step:
    """FSDP2 (``fully_shard`` per layer and on the root) with ``clip_grad_norm_``."""
    from torch.distributed.fsdp import fully_shard

    a = ctx.args
    model = _mlp(a.get("width", 256), a.get("layers", 4), ctx.seed, ctx.device)
    mesh = _mesh(ctx)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(a.get("batch", 16), a.get("width", 256), device=ctx.device)
    return _train_step(model, opt, batch, clip=a.get("clip", 1.0))


def tensor_parallel(ctx: Context) -> Step:
    """DTensor tensor parallel: an MLP block, column- then row-parallel (Megatron style)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    a = ctx.args
    width = a.get("width", 256)
    torch.manual_seed(ctx.seed)
    block = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width)).to(ctx.device)
    model = parallelize_module(block, _mesh(ctx, "tp"),
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(ctx.seed + 1)            # the same batch on every rank, as TP needs
    batch = torch.randn(a.get("batch", 8), width, device=ctx.device)
    return _train_step(model, opt, batch)


def pipeline(ctx: Context) -> Step:
    """torch.distributed.pipelining: one stage per rank of an MLP; ``args.schedule``: gpipe |
    1f1b, ``args.microbatches`` per step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    a = ctx.args
    width, per_stage = a.get("width", 256), a.get("layers_per_stage", 2)
    full = _mlp(width, per_stage * ctx.world_size, ctx.seed, ctx.device)
    mine = full[ctx.rank * per_stage:(ctx.rank + 1) * per_stage]
    stage = PipelineStage(mine, ctx.rank, ctx.world_size, ctx.device)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[a.get("schedule", "gpipe")]
    schedule = kind(stage, n_microbatches=a.get("microbatches", 4),
                    loss_fn=lambda out, target: (out - target).square().mean())
    opt = torch.optim.SGD(mine.parameters(), lr=0.01)
    torch.manual_seed(ctx.seed + 1)
    batch = torch.randn(a.get("batch", 16), width, device=ctx.device)
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1

    def step() -> None:
        if first:
            schedule.step(batch)
        elif last:
            schedule.step(target=torch.zeros_like(batch))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def p2p_ring(ctx: Context) -> Step:
    """A ring exchange with ``batch_isend_irecv``: send to the next rank, receive from the last."""
    a = ctx.args
    n, me = ctx.world_size, ctx.rank
    send = torch.full((a.get("numel", 4096),), float(me), device=ctx.device)
    recv = torch.empty_like(send)

    def step() -> None:
        ops = [dist.P2POp(dist.isend, send, (me + 1) % n),
               dist.P2POp(dist.irecv, recv, (me - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return step


def compiled(ctx: Context) -> Step:
    """A ``torch.compile``d step with a functional all_reduce (as DTensor and compiled TP emit);
    ``args.mode`` is torch.compile's mode (``reduce-overhead``: CUDA graphs through cudagraph
    trees, on GPUs)."""
    import torch.distributed._functional_collectives as funcol

    a = ctx.args
    width = a.get("width", 256)
    torch.manual_seed(ctx.seed)
    weight = torch.randn(width, width, device=ctx.device)
    group = dist.group.WORLD

    @torch.compile(mode=a.get("mode", "default"))
    def layer(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(torch.relu(x @ weight), "sum", group)

    x = torch.randn(a.get("batch", 8), width, device=ctx.device)

    def step() -> None:
        layer(x)

    return step
