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


def _mesh_2d(ctx: Context, names: tuple[str, str], inner: int) -> Any:
    """A 2-D DeviceMesh of (world / inner, inner) named ``names``: the inner dimension's ranks
    are consecutive ([0, 1], [2, 3]), the outer's ``inner`` apart ([0, 2], [1, 3])."""
    from torch.distributed.device_mesh import init_device_mesh

    if ctx.world_size % inner:
        raise ValueError(f"{ctx.world_size} ranks do not tile a mesh of inner size {inner}")
    return init_device_mesh(ctx.device.type, (ctx.world_size // inner, inner),
                            mesh_dim_names=names)


def _blocks(width: int, layers: int, seed: int, device: torch.device) -> nn.Sequential:
    """Transformer-MLP-like blocks: a linear to 4x the width, GELU, a linear back."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width))
                           for _ in range(layers)]).to(device)


def _tp_then_fsdp(model: nn.Sequential, tp: Any, dp: Any) -> None:
    """As torchtitan composes them: each block's linears column- then row-parallel over the
    ``tp`` mesh (DTensor), then ``fully_shard`` per block and on the whole over ``dp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    for block in model:
        parallelize_module(block, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


def fsdp_tp(ctx: Context) -> Step:
    """FSDP2 x tensor parallel on a (dp, tp) DeviceMesh (``_tp_then_fsdp``) with
    ``clip_grad_norm_`` over the 2-D parameters. ``args.tp`` is the tensor-parallel size
    (default 2)."""
    a = ctx.args
    mesh = _mesh_2d(ctx, ("dp", "tp"), a.get("tp", 2))
    model = _blocks(a.get("width", 256), a.get("layers", 2), ctx.seed, ctx.device)
    _tp_then_fsdp(model, mesh["tp"], mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # a tp pair sees the same batch, the dp replicas different ones
    torch.manual_seed(ctx.seed + 1 + mesh.get_local_rank("dp"))
    batch = torch.randn(a.get("batch", 8), a.get("width", 256), device=ctx.device)
    return _train_step(model, opt, batch, clip=a.get("clip", 1.0))


def three_d(ctx: Context) -> Step:
    """3-D parallel: a 1F1B pipeline over ``pp`` whose stages are tensor parallel over ``tp``
    and FSDP2-sharded over ``dp`` (``_tp_then_fsdp``), on a (pp, dp, tp) DeviceMesh;
    ``args.pp``, ``args.tp`` (default 2 each; dp takes the rest of the world). With
    ``args.graph_after: N`` the first N steps run eagerly, then the step is captured in a CUDA
    graph (``commviz.launch.workloads.capture``) and replayed from then on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from commviz.launch.workloads import capture

    a = ctx.args
    pp, tp = a.get("pp", 2), a.get("tp", 2)
    if ctx.world_size % (pp * tp):
        raise ValueError(f"{ctx.world_size} ranks do not tile pp {pp} x tp {tp}")
    mesh = init_device_mesh(ctx.device.type, (pp, ctx.world_size // (pp * tp), tp),
                            mesh_dim_names=("pp", "dp", "tp"))
    width, per_stage, me = a.get("width", 256), a.get("layers_per_stage", 2), mesh.get_local_rank("pp")
    mine = _blocks(width, per_stage * pp, ctx.seed, ctx.device)[me * per_stage:(me + 1) * per_stage]
    _tp_then_fsdp(mine, mesh["tp"], mesh["dp"])
    stage = PipelineStage(mine, me, pp, ctx.device, group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, n_microbatches=a.get("microbatches", 4),
                            loss_fn=lambda out, target: (out - target).square().mean())
    graph_after = a.get("graph_after")
    if graph_after is not None and ctx.device.type != "cuda":
        raise ValueError("args.graph_after captures CUDA graphs: it needs GPUs (set it to null)")
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-3, capturable=graph_after is not None)
    torch.manual_seed(ctx.seed + 1 + mesh.get_local_rank("dp"))
    batch = torch.randn(a.get("batch", 8), width, device=ctx.device)
    target = torch.zeros_like(batch)

    def eager() -> None:
        if me == 0:
            schedule.step(batch)
        elif me == pp - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=False)

    calls, replay = [0], []

    def step() -> None:
        calls[0] += 1
        if graph_after is None or calls[0] <= graph_after:
            eager()
            return
        if not replay:
            replay.append(capture(eager, ctx, warmup=1))
        replay[0]()

    return step


def hsdp(ctx: Context) -> Step:
    """HSDP: FSDP2's ``fully_shard`` on a 2-D (replicate, shard) mesh, parameters sharded
    within each ``args.shard``-rank group (default 2) and replicated across them."""
    from torch.distributed.fsdp import fully_shard

    a = ctx.args
    model = _mlp(a.get("width", 256), a.get("layers", 4), ctx.seed, ctx.device)
    mesh = _mesh_2d(ctx, ("replicate", "shard"), a.get("shard", 2))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(ctx.seed + 1 + ctx.rank)
    batch = torch.randn(a.get("batch", 16), a.get("width", 256), device=ctx.device)
    return _train_step(model, opt, batch, clip=a.get("clip", 1.0))


def experts(ctx: Context) -> Step:
    """Expert-parallel token routing as mixture-of-experts layers do it: per step each rank
    routes ``args.tokens`` tokens to the experts (one per rank) in uneven counts that change
    every step, exchanges the counts (``all_to_all_single``), dispatches the tokens with those
    split sizes, runs its expert and sends the results back (two more ``all_to_all_single``
    with uneven splits). ``args.group``: a configured group to run over (default the world)."""
    a = ctx.args
    name = a.get("group", "world")
    group, ranks = ctx.group(name), ctx.group_ranks[name]
    n, me, width = len(ranks), ranks.index(ctx.rank), a.get("width", 128)
    tokens = a.get("tokens", 64)
    torch.manual_seed(ctx.seed)
    expert = nn.Linear(width, width).to(ctx.device)
    steps = [0]

    def routing(step: int) -> list[int]:
        """How many of this rank's tokens go to each expert at ``step``: uneven, changing."""
        weights = [1 + (step * 7 + me * 3 + e * 5) % (2 * n + 1) for e in range(n)]
        counts = [tokens * w // sum(weights) for w in weights]
        counts[(step + me) % n] += tokens - sum(counts)
        return counts

    def step() -> None:
        send = routing(steps[0])
        steps[0] += 1
        sizes = torch.tensor(send, dtype=torch.int64, device=ctx.device)
        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes, group=group)
        recv = got.tolist()
        x = torch.randn(tokens, width, device=ctx.device)
        routed = torch.empty(sum(recv), width, device=ctx.device)
        dist.all_to_all_single(routed, x, recv, send, group=group)
        with torch.no_grad():
            out = expert(routed)
        back = torch.empty(tokens, width, device=ctx.device)
        dist.all_to_all_single(back, out, send, recv, group=group)

    return step


def pipeline(ctx: Context) -> Step:
    """torch.distributed.pipelining over the world: an MLP cut into ``args.stages_per_rank``
    stages per rank, stage ``i`` on rank ``i % world`` (the looped placement interleaved
    schedules expect); ``args.schedule``: gpipe | 1f1b (one stage per rank) | interleaved1f1b
    (several), ``args.microbatches`` per step."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    a = ctx.args
    kind = a.get("schedule", "gpipe")
    width, per_stage = a.get("width", 256), a.get("layers_per_stage", 2)
    per_rank = a.get("stages_per_rank", 2 if kind == "interleaved1f1b" else 1)
    n_stages = per_rank * ctx.world_size
    full = _mlp(width, per_stage * n_stages, ctx.seed, ctx.device)
    ids = [ctx.rank + k * ctx.world_size for k in range(per_rank)]
    parts = [full[i * per_stage:(i + 1) * per_stage] for i in ids]
    stages = [PipelineStage(part, i, n_stages, ctx.device) for part, i in zip(parts, ids)]
    loss = lambda out, target: (out - target).square().mean()  # noqa: E731
    n_micro = a.get("microbatches", 4)
    if kind == "interleaved1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_micro, loss_fn=loss)
    else:
        if per_rank != 1:
            raise ValueError(f"schedule {kind!r} runs one stage per rank, not {per_rank}")
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](
            stages[0], n_microbatches=n_micro, loss_fn=loss)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.01)
    torch.manual_seed(ctx.seed + 1)
    batch = torch.randn(a.get("batch", 16), width, device=ctx.device)
    first, last = 0 in ids, n_stages - 1 in ids

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
