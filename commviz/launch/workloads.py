"""What each rank runs: the built-in collective mix, the TP transformer block, a user entrypoint.

Each part is built once into a step function (tensors allocated up front, so the same step can
be captured in a CUDA graph and replayed) and the parts present run in order every step:
transformer, collectives, entrypoint. Collectives go through ``commviz.distributed`` so they are
recorded and annotated; compute regions are labelled with ``commviz.capture.mark``, and graphs
are captured with ``commviz.capture.graph`` so every replay in a trace names its graph.

A user entrypoint ``module:function`` is called once as ``function(ctx)`` with a ``Context``
(process groups by name, device, rank, ``ctx.args``) and returns the step: a callable taking no
arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

import commviz.distributed as D
from commviz.capture import graph as commviz_graph
from commviz.capture import mark
from commviz.launch import config_schema as S
from commviz.launch.config import elements, import_entrypoint

Step = Callable[[], None]


@dataclass
class Context:
    """What a workload gets to know about its rank: handed to user entrypoints as ``ctx``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    groups: dict[str, Any]                 # name -> this rank's ProcessGroup (None: not a member)
    group_ranks: dict[str, list[int]]      # name -> global ranks of this rank's group
    args: dict[str, Any] = field(default_factory=dict)
    cuda_graphs: bool = False
    seed: int = 0
    dist: Any = D                          # commviz.distributed: torch.distributed, recorded

    def group(self, name: str) -> Any:
        """This rank's group called ``name`` (KeyError names the known ones)."""
        if name not in self.groups:
            raise KeyError(f"no process group {name!r} (known: {', '.join(self.groups)})")
        return self.groups[name]


def _reduce_op(name: str) -> Any:
    return getattr(D.ReduceOp, name.upper())


# -- the collective mix -----------------------------------------------------------------------
def _issue(op: S.Collective, ctx: Context) -> Callable[[], Any] | None:
    """A closure issuing ``op`` once on preallocated tensors; None if this rank is not in it."""
    pg = ctx.groups.get(op.group)
    if pg is None:
        return None
    ranks = ctx.group_ranks[op.group]
    n, me = len(ranks), ranks.index(ctx.rank)
    dtype, dev, a = getattr(torch, op.dtype), ctx.device, op.async_op
    count = elements(op)

    def full(numel: int, value: float = me + 1) -> torch.Tensor:
        return torch.full((numel,), value, dtype=dtype, device=dev)

    t = full(count)
    root_index = op.root or 0
    root = ranks[root_index]
    red = _reduce_op(op.reduce_op or "sum")
    kind = op.op
    if kind == "all_reduce":
        return lambda: D.all_reduce(t, op=red, group=pg, async_op=a)
    if kind == "broadcast":
        return lambda: D.broadcast(t, src=root, group=pg, async_op=a)
    if kind == "reduce":
        return lambda: D.reduce(t, dst=root, op=red, group=pg, async_op=a)
    if kind == "all_gather":
        outs = [full(count, 0) for _ in range(n)]
        return lambda: D.all_gather(outs, t, group=pg, async_op=a)
    if kind == "all_gather_into_tensor":
        out = full(count * n, 0)
        return lambda: D.all_gather_into_tensor(out, t, group=pg, async_op=a)
    if kind == "reduce_scatter":
        out, ins = full(count // n, 0), list(t.chunk(n))
        return lambda: D.reduce_scatter(out, ins, op=red, group=pg, async_op=a)
    if kind == "reduce_scatter_tensor":
        out = full(count // n, 0)
        return lambda: D.reduce_scatter_tensor(out, t, op=red, group=pg, async_op=a)
    if kind == "all_to_all":
        ins, outs = list(t.chunk(n)), [full(count // n, 0) for _ in range(n)]
        return lambda: D.all_to_all(outs, ins, group=pg, async_op=a)
    if kind == "all_to_all_single":
        out = full(count, 0)
        return lambda: D.all_to_all_single(out, t, group=pg, async_op=a)
    if kind == "gather":
        outs = [full(count, 0) for _ in range(n)] if me == root_index else None
        return lambda: D.gather(t, gather_list=outs, dst=root, group=pg, async_op=a)
    if kind == "scatter":
        ins = [full(count, r + 1) for r in range(n)] if me == root_index else None
        return lambda: D.scatter(t, scatter_list=ins, src=root, group=pg, async_op=a)
    if kind == "batch_isend_irecv":
        recv = full(count, 0)
        ops = [D.P2POp(D.isend, t, ranks[(me + 1) % n], pg),
               D.P2POp(D.irecv, recv, ranks[(me - 1) % n], pg)]

        def exchange() -> Any:
            works = D.batch_isend_irecv(ops)
            if not a:
                for w in works:
                    w.wait()
                return None
            return works
        return exchange
    if kind == "barrier":
        return lambda: D.barrier(group=pg, async_op=a)
    raise ValueError(f"unknown op {kind!r}")  # the schema admits only S.OPS


def collective_mix(ops: Sequence[S.Collective], ctx: Context) -> Step:
    """One step = every entry ``repeat`` times, in order; async ones waited at the end."""
    calls = [c for op in ops for c in [_issue(op, ctx)] * op.repeat if c is not None]

    def step() -> None:
        pending = []
        for call in calls:
            work = call()
            if work is not None:
                pending.extend(work if isinstance(work, list) else [work])
        for work in pending:
            work.wait()
    return step


# -- the tensor-parallel transformer block ----------------------------------------------------
def transformer_block(spec: S.Transformer, ctx: Context) -> Step:
    """Megatron-style block: column-parallel QKV and MLP-in, row-parallel out-proj and MLP-out,
    an all_reduce over ``tp_group`` after attention and after the MLP of every layer, and one
    all_reduce of a gradient-sized buffer over ``dp_group`` per step."""
    tp = ctx.groups.get(spec.tp_group)
    n = len(ctx.group_ranks.get(spec.tp_group, [ctx.rank]))
    dtype, dev = getattr(torch, spec.dtype), ctx.device
    gen = torch.Generator(device="cpu").manual_seed(ctx.seed + ctx.rank)
    hd, heads = spec.hidden // spec.heads, spec.heads // n
    width, ffn = heads * hd, spec.ffn_mult * spec.hidden // n

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen) / math.sqrt(rows)
        return w.to(device=dev, dtype=dtype)

    layers = [{"qkv": weight(spec.hidden, 3 * width), "out": weight(width, spec.hidden),
               "w1": weight(spec.hidden, ffn), "w2": weight(ffn, spec.hidden)}
              for _ in range(spec.layers)]
    x = torch.randn(spec.batch * spec.seq, spec.hidden, generator=gen).to(dev, dtype)
    grads = None
    dp = ctx.groups.get(spec.dp_group) if spec.dp_group else None
    if dp is not None:
        grads = torch.zeros(sum(w.numel() for w in layers[0].values()), dtype=dtype, device=dev)
    B, T = spec.batch, spec.seq

    def attention(h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        with mark("qkv"):
            q, k, v = (h @ w["qkv"]).split(width, dim=-1)
        with mark("attention"):
            q, k, v = (t.view(B, T, heads, hd).transpose(1, 2) for t in (q, k, v))
            probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
            ctx_ = (probs @ v).transpose(1, 2).reshape(B * T, width)
        with mark("out_proj"):
            return ctx_ @ w["out"]

    def step() -> None:
        h = x
        for w in layers:
            o = attention(h, w)
            if tp is not None:
                D.all_reduce(o, group=tp)
            h = torch.nn.functional.layer_norm(h + o, (spec.hidden,))
            with mark("mlp"):
                m = torch.nn.functional.gelu(h @ w["w1"]) @ w["w2"]
            if tp is not None:
                D.all_reduce(m, group=tp)
            h = torch.nn.functional.layer_norm(h + m, (spec.hidden,))
        if grads is not None:
            grads.fill_(1.0)
            D.all_reduce(grads, group=dp)
    return step


# -- user entrypoints and the whole step ------------------------------------------------------
def entrypoint_step(spec: str, ctx: Context, paths: Sequence[Any]) -> Step:
    build = import_entrypoint(spec, paths)
    step = build(ctx)
    if not callable(step):
        raise TypeError(f"entrypoint {spec} returned {type(step).__name__}; it must return the "
                        "step function (a callable taking no arguments)")
    return step


def build(workload: S.Workload, ctx: Context, paths: Sequence[Any]) -> Step:
    """The step function of a workload: its parts, in order."""
    parts: list[Step] = []
    if workload.transformer is not None:
        parts.append(transformer_block(workload.transformer, ctx))
    if workload.collectives:
        parts.append(collective_mix(workload.collectives, ctx))
    if workload.entrypoint is not None:
        parts.append(entrypoint_step(workload.entrypoint, ctx, paths))
    if len(parts) == 1:
        return parts[0]

    def step() -> None:
        for part in parts:
            part()
    return step


def _sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def capture(step: Step, ctx: Context, warmup: int) -> Step:
    """Warm ``step`` up on a side stream, capture one call in a CUDA graph; returns its replay."""
    side = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    _sync(ctx)
    graph = torch.cuda.CUDAGraph()
    with commviz_graph(graph):
        step()
    _sync(ctx)
    return graph.replay


def run(step: Step, workload: S.Workload, ctx: Context, profiler: Any) -> None:
    """Warm up, capture if asked, then ``workload.steps`` profiled steps (``profiler.step()``)."""
    if workload.cuda_graphs:
        body = capture(step, ctx, workload.warmup_steps)
    else:
        for _ in range(workload.warmup_steps):
            step()
        _sync(ctx)
        body = step
    with profiler as prof:
        for _ in range(workload.steps):
            body()
            _sync(ctx)
            prof.step()
