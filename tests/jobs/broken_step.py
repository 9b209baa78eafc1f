"""A ``commviz launch`` entrypoint that breaks on purpose, one way per ``args.case``: the
scenarios of ``broken_job.py`` on any backend (``broken_step.yaml``; NCCL on 2 GPUs in
``tests/test_gpu_verdict.py``), and a hang inside CUDA-graph replays.

Each step is an all_reduce on the group ``sub`` (``broken_step.yaml``: ranks [0, 1], with 2
ranks the world again, but its own communicator), then one on the world group. At its call
``args.at`` (1-based: each group's collective number ``at``) the rank ``args.rank`` breaks:

- ``stuck``: sleeps ``args.sleep_s`` in Python before the world's all_reduce;
- ``type``: calls a broadcast where the others call the all_reduce;
- ``size``: calls the all_reduce with half the elements;
- ``raise``: raises a RuntimeError before it (1 s after the others went in, as broken_job.py);
- ``kill``: SIGKILLs itself before it;
- ``skip``: skips the subgroup's all_reduce and goes on to the world's;
- ``graph`` (CUDA): every rank runs the step eagerly at its first call, captures it in a
  ``torch.cuda.graph`` and replays the graph at every later call; at call ``at`` the rank stops
  replaying and sleeps ``args.sleep_s``, so the others' replays wait inside the NCCL kernels,
  which NCCL's watchdog does not watch (only a collective's work object is watched; a
  replay has none).

Just before it breaks, the rank writes the file ``args.mark`` (if given): a test waits on it.
"""

import os
import signal
import time
from pathlib import Path

import torch


def build(ctx):
    args = ctx.args
    case, bad_rank, at = args["case"], args.get("rank", 1), args.get("at", 5)
    t = torch.ones(16, device=ctx.device)
    world, sub = ctx.group("world"), ctx.group("sub")
    calls, graph = [0], []

    def body(bad: bool) -> None:
        if not (bad and case == "skip"):
            ctx.dist.all_reduce(t, group=sub)
        if bad and case == "stuck":
            time.sleep(args["sleep_s"])           # stuck in its own code
        elif bad and case == "raise":
            time.sleep(1.0)
            raise RuntimeError(f"injected failure in call {calls[0]}")
        elif bad and case == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if bad and case == "type":
            ctx.dist.broadcast(t, src=0, group=world)
        elif bad and case == "size":
            ctx.dist.all_reduce(t[:8], group=world)
        else:
            ctx.dist.all_reduce(t, group=world)

    def replayed(bad: bool) -> None:
        if not graph:                   # eager first (NCCL's communicators), then capture
            body(False)
            torch.cuda.synchronize(ctx.device)
            graph.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graph[0]):
                body(False)
        elif bad:
            time.sleep(args["sleep_s"])           # stops replaying
        graph[0].replay()

    def step() -> None:
        calls[0] += 1
        bad = ctx.rank == bad_rank and calls[0] == at
        if bad and args.get("mark"):
            Path(args["mark"]).write_text(f"rank {ctx.rank} breaks ({case}) in call {at}\n")
        (replayed if case == "graph" else body)(bad)
    return step
