"""A 4-rank ``commviz launch`` entrypoint where the groups chain, broken on purpose one way per
``args.case`` (``broken_mesh.yaml``: tensor parallel ``tp`` over [0, 1] and [2, 3], data
parallel ``dp`` over [0, 2] and [1, 3]; NCCL on 4 GPUs in ``tests/test_gpu_verdict_4x.py``,
gloo on CPU). At its step ``args.at`` (1-based) the rank ``args.rank`` breaks:

- ``tp_stuck``: every step is an all_reduce over ``tp`` then one over ``dp`` of the same
  tensor; the rank sleeps ``args.sleep_s`` in Python before its ``tp`` all_reduce, so its tp
  partner waits for it there while the other pair goes on into the ``dp`` all_reduce and waits
  for the first pair;
- ``pp_raise``: a 4-stage 1F1B pipeline (torch.distributed.pipelining over the world, one
  stage per rank); the rank's stage raises a RuntimeError in its forward;
- ``a2a_splits``: expert-parallel routing over the world: the token counts are exchanged
  (``all_to_all_single``), then the tokens dispatched with ``all_to_all_single`` and uneven
  split sizes that change every step; the rank dispatches with the previous step's output
  split sizes (a stale routing table), which its peers' input splits do not match.

Just before it breaks, the rank writes the file ``args.mark`` (if given): a test waits on it.
"""

import time
from pathlib import Path

import torch
from torch import nn


def _mark(args, ctx, step):
    if args.get("mark"):
        Path(args["mark"]).write_text(f"rank {ctx.rank} breaks ({args['case']}) in step {step}\n")


def _tp_stuck(ctx, args, bad_at):
    t = torch.ones(1024, device=ctx.device)
    tp, dp = ctx.group("tp"), ctx.group("dp")

    def step(n):
        if bad_at(n):
            time.sleep(args["sleep_s"])           # stuck in its own code
        ctx.dist.all_reduce(t, group=tp)
        ctx.dist.all_reduce(t, group=dp)
    return step


class _Stage(nn.Module):
    """One pipeline stage; ``broken(n)`` says whether its forward in step ``n`` raises."""

    def __init__(self, width, broken, steps):
        super().__init__()
        self.layer, self.broken, self.steps = nn.Linear(width, width), broken, steps

    def forward(self, x):
        if self.broken(self.steps[0]):
            raise RuntimeError(f"injected failure in stage forward, step {self.steps[0]}")
        return torch.relu(self.layer(x))


def _pp_raise(ctx, args, bad_at):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    width, steps = 64, [0]
    torch.manual_seed(ctx.seed + ctx.rank)
    module = _Stage(width, bad_at, steps).to(ctx.device)
    stage = PipelineStage(module, ctx.rank, ctx.world_size, ctx.device)
    schedule = Schedule1F1B(stage, n_microbatches=4,
                            loss_fn=lambda out, target: (out - target).square().mean())
    batch = torch.randn(8, width, device=ctx.device)

    def step(n):
        steps[0] = n
        if ctx.rank == 0:
            schedule.step(batch)
        elif ctx.rank == ctx.world_size - 1:
            schedule.step(target=torch.zeros_like(batch))
        else:
            schedule.step()
    return step


def _a2a_splits(ctx, args, bad_at):
    world, n, me, width, tokens = ctx.group("world"), ctx.world_size, ctx.rank, 16, 32
    last = [None]

    def routing(s):
        counts = [1 + (s * 5 + me * 3 + e * 7) % (2 * n) for e in range(n)]
        counts[(s + me) % n] += tokens - sum(counts)
        return counts

    def step(s):
        send = routing(s)
        got = torch.empty(n, dtype=torch.int64, device=ctx.device)
        ctx.dist.all_to_all_single(got, torch.tensor(send, device=ctx.device), group=world)
        recv = got.tolist()
        if bad_at(s):
            recv = last[0]                         # a stale routing table
        last[0] = recv
        x = torch.randn(tokens, width, device=ctx.device)
        out = torch.empty(sum(recv), width, device=ctx.device)
        ctx.dist.all_to_all_single(out, x, recv, send, group=world)
    return step


CASES = {"tp_stuck": _tp_stuck, "pp_raise": _pp_raise, "a2a_splits": _a2a_splits}


def build(ctx):
    args = ctx.args
    bad_rank, at = args.get("rank", 1), args.get("at", 5)
    steps = [0]

    def bad_at(n):
        return ctx.rank == bad_rank and n == at

    body = CASES[args["case"]](ctx, args, bad_at)

    def step():
        steps[0] += 1
        if bad_at(steps[0]):
            _mark(args, ctx, steps[0])
        body(steps[0])
    return step
