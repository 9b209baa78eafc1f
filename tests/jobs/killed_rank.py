"""A 2-rank gloo job in which every rank records three all_reduces and then idles until killed."""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as td

import commviz
import commviz.distributed as dist

run_dir = Path(sys.argv[1])
td.init_process_group("gloo")
commviz.start(run_dir, flush_interval=None)  # only the signal handler may save these records
rank = td.get_rank()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
(run_dir / f"rank{rank}.pid").write_text(str(__import__("os").getpid()))
for _ in range(600):
    time.sleep(0.1)
