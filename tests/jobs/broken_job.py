"""A gloo job (run under torchrun) that breaks on purpose, one way per ``CASE``.

``python broken_job.py RUN_DIR FR_DIR CASE``: every rank records with commviz into RUN_DIR and
runs ``STEPS`` steps of an all_reduce on the world group (3 ranks: also one on the subgroup
[0, 1] before it). At step ``AT`` the rank ``BAD`` (1, or ``$BROKEN_RANK``) breaks:

- ``stuck``: sleeps in Python before its collective (its data loader, say);
- ``type``: calls a broadcast where the others call the all_reduce;
- ``size``: calls the all_reduce with half the elements;
- ``raise``: raises a RuntimeError before its collective;
- ``kill``: SIGKILLs itself before its collective;
- ``skip``: skips the subgroup's all_reduce (it is a member) and goes on to the world's.

Each rank leaves torch's own Flight Recorder dump in FR_DIR/fr_rank{R} when it stops (the
test's independent expectation; a SIGKILLed rank leaves none). The gloo timeout is 3 s (or
``$BROKEN_TIMEOUT_S``), so a waiting rank raises then and torchrun SIGTERMs the others.
``$BROKEN_SLEEP_S`` (default 120) is how long the stuck rank sleeps.
"""

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as td

import commviz
import commviz.distributed as dist
from fr_dump import arm, dump

STEPS, AT = 6, 4
BAD = int(os.environ.get("BROKEN_RANK", 1))
run_dir, fr_dir, case = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
td.init_process_group("gloo", timeout=datetime.timedelta(
    seconds=float(os.environ.get("BROKEN_TIMEOUT_S", 3))))
rank, world = td.get_rank(), td.get_world_size()
fr_path = fr_dir / f"fr_rank{rank}"
arm(fr_path)                                # before commviz.start, which chains in front of it
commviz.start(run_dir, flush_interval=None)
sub = dist.new_group([0, 1], group_desc="sub") if world > 2 else None
t = torch.ones(16)
try:
    for step in range(STEPS):
        bad = rank == BAD and step == AT
        if sub is not None and rank in (0, 1) and not (bad and case == "skip"):
            dist.all_reduce(t, group=sub)
        if bad and case == "stuck":
            time.sleep(float(os.environ.get("BROKEN_SLEEP_S", 120)))
        elif bad and case == "raise":
            # raise once the others wait inside the collective (within the 3 s gloo timeout):
            # on a loaded machine they might otherwise be stopped before torch's Flight
            # Recorder has their entry, and the scenario would not be the one described
            time.sleep(1.0)
            raise RuntimeError(f"injected failure at step {step}")
        elif bad and case == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if bad and case == "type":
            dist.broadcast(t, src=0)
        elif bad and case == "size":
            dist.all_reduce(t[:8])
        else:
            dist.all_reduce(t)
except BaseException:
    dump(fr_path)
    raise
dump(fr_path)
