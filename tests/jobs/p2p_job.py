"""A gloo ring exchange (run under torchrun) that breaks on purpose, one way per ``CASE``.

``python p2p_job.py RUN_DIR FR_DIR CASE``: every rank records with commviz into RUN_DIR and
runs ``STEPS`` steps of a ring exchange on the world group: it sends its tensor of ``N`` floats
to the next rank (``isend``), receives the previous rank's (``recv``), then waits for its send.
With 3 ranks, ranks 0 and 1 first all_reduce on the subgroup [0, 1] each step. At step ``AT``
(each pair's 5th transfer) rank ``BAD`` breaks:

- ``stuck``: rank 1 sleeps in Python before its send (rank 0 waits in its receive);
- ``size``: rank 1 posts its receive with half the elements (gloo aborts rank 1: the data
  that arrives is larger than its buffer);
- ``deadlock``: every rank receives before it sends (each waits for the other);
- ``raise``: rank 1 raises a RuntimeError before its send;
- ``chain`` (3 ranks): rank 0 sleeps before the subgroup's all_reduce; rank 1 waits in it and
  so never sends to rank 2, which waits in its receive.

Each rank leaves torch's own Flight Recorder dump in FR_DIR/fr_rank{R} when it stops (an
aborted rank leaves none). The gloo timeout is 3 s, so a waiting rank raises then and torchrun
SIGTERMs the others.
"""

import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as td

import commviz
import commviz.distributed as dist
from fr_dump import arm, dump

STEPS, AT, N = 6, 4, 16
run_dir, fr_dir, case = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
BAD = 0 if case == "chain" else 1
td.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
rank, world = td.get_rank(), td.get_world_size()
fr_path = fr_dir / f"fr_rank{rank}"
arm(fr_path)                                # before commviz.start, which chains in front of it
commviz.start(run_dir, flush_interval=None)
sub = dist.new_group([0, 1], group_desc="sub") if world > 2 else None
nxt, prv = (rank + 1) % world, (rank - 1) % world
t, buf = torch.ones(N), torch.empty(N)
try:
    for step in range(STEPS):
        bad = rank == BAD and step == AT
        if bad and case == "chain":
            time.sleep(120)
        if sub is not None and rank in (0, 1):
            dist.all_reduce(t, group=sub)
        if bad and case == "stuck":
            time.sleep(120)
        elif bad and case == "raise":
            time.sleep(1.0)                 # raise once the peer waits in its receive
            raise RuntimeError(f"injected failure at step {step}")
        if step == AT and case == "deadlock":
            dist.recv(buf, prv)
            dist.send(t, nxt)
            continue
        req = dist.isend(t, nxt)
        dist.recv(buf[:N // 2] if bad and case == "size" else buf, prv)
        req.wait()
except BaseException:
    dump(fr_path)
    raise
dump(fr_path)
