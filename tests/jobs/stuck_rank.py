"""A 2-rank gloo job that is SIGKILLed by its test: nothing but the journal can keep its records.

Both ranks run five collectives; each rank notes every call in ``issued_rank{R}.txt`` before
making it (plain appends: the page cache keeps them past SIGKILL). Midway they write their
record once, as the periodic flusher would (exit "running"), so the journal rolls over. Then
rank 1 enters an all_reduce that rank 0 never joins and hangs there; rank 0 idles. The test
kills both with SIGKILL once rank 1 has been stuck for a moment.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as td

import commviz
import commviz.distributed as dist

run_dir = Path(sys.argv[1])
td.init_process_group("gloo")
commviz.start(run_dir, flush_interval=None)   # no periodic flush, and SIGKILL runs no handler
rank = td.get_rank()
issued = open(run_dir / f"issued_rank{rank}.txt", "a", buffering=1)


def call(op: str, fn, *args, **kwargs) -> None:
    issued.write(op + "\n")
    fn(*args, **kwargs)


t = torch.ones(8)
call("all_reduce", dist.all_reduce, t)
call("broadcast", dist.broadcast, t, src=1)
commviz.flush("running")                        # what the periodic flusher writes
call("all_gather_into_tensor", dist.all_gather_into_tensor, torch.empty(16), t)
call("all_reduce", dist.all_reduce, t)
call("reduce_scatter_tensor", dist.reduce_scatter_tensor, torch.empty(4), t)
(run_dir / f"ready_rank{rank}").write_text(str(os.getpid()))
if rank == 1:
    call("all_reduce", dist.all_reduce, t)      # rank 0 never joins: stuck until killed
for _ in range(600):
    time.sleep(0.1)
