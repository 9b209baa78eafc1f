"""A gloo job without a profiler for ``commviz watch``: three all_reduces a step, each on its
own line, and from step ``late_from`` on rank ``late_rank`` sleeps 20 ms just before the second
one (the line marked ``# the late line``; ``late_rank`` -1: nobody is late). The rank also
writes ``late.json`` into the run dir when it first sleeps: the wall time of the change and the
line, from the program itself.

    torchrun --nproc_per_node 4 late_allreduce.py RUN_DIR STEPS LATE_RANK LATE_FROM STEP_S [FLUSH_S]

``FLUSH_S``: how often each rank rewrites its pickle (each time its journal starts a new
generation and drops the old one; default 30 s). As a ``commviz launch`` entrypoint
(``late_allreduce:build``) the same step, with ``workload.args`` late_rank, late_from, step_s
and out (the run dir).
"""

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

LATE_S = 0.020


def stepper(rank: int, out: Path, late_rank: int, late_from: int, step_s: float
            ) -> Callable[[], None]:
    x = torch.ones(1024)
    done = [0]

    def step() -> None:
        time.sleep(step_s / 2)                       # "compute"
        dist.all_reduce(x)
        time.sleep(step_s / 2)
        if rank == late_rank and done[0] >= late_from:
            if done[0] == late_from:
                line = next(n for n, text in enumerate(open(__file__), 1)
                            if text.rstrip().endswith("# the late line"))
                (out / "late.json").write_text(json.dumps(
                    {"rank": rank, "time_ns": time.time_ns(), "file": __file__, "line": line}))
            time.sleep(LATE_S)
        dist.all_reduce(x)                           # the late line
        dist.all_reduce(x[:16])
        done[0] += 1
    return step


def build(ctx):
    a = ctx.args
    return stepper(ctx.rank, Path(a["out"]), int(a["late_rank"]), int(a["late_from"]),
                   float(a["step_s"]))


def main() -> None:
    import commviz

    run_dir = Path(sys.argv[1])
    steps, late_rank, late_from = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    step_s = float(sys.argv[5])
    flush_s = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
    dist.init_process_group("gloo")
    commviz.start(run_dir, flush_interval=flush_s)
    step = stepper(dist.get_rank(), run_dir, late_rank, late_from, step_s)
    for _ in range(steps):
        step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
