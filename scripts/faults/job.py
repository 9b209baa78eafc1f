"""The rank program the fault suite runs: a gloo job recorded by ``commviz.start`` (the live
journal ``commviz watch`` reads), started with the env torchrun would give it (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, GLOO_SOCKET_IFNAME in a network namespace).

    python job.py RUN_DIR WORKLOAD [--late RANK STEP] [--jitter RANK STEP]
    python job.py --serve        # ranks forked on request (``serve``): what the harness uses

Workloads (each runs until the harness kills it):

- ``mesh``: 4 ranks as a 2 x 2 mesh, an all_reduce in each TP pair ({0,1}, {2,3}) and each DP
  pair ({0,2}, {1,3}) a step (the issue's slow-link setting);
- ``ddp``: DDP over a small MLP with 4 buckets, so the backward's bucket all_reduces overlap
  the rest of the backward (what a CPU quota cut on one rank slows);
- ``pipe``: one stage per rank, each micro-batch's activation sent on to the next stage
  (``send``/``recv``), as a pipeline's forward.

The only fault planted inside the program is a sleep: ``--late R S``: rank R sleeps before
the DP all_reduce of every step from step S on; ``--jitter R S``: once, at step S. The rank
writes ``fault.json`` (the wall time it first slept) into the run dir. Every other fault is
injected from outside (``faults.inject``). Each rank writes ``ready_rank{R}`` once it has
made its first step, so the harness knows when the job is warm.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

LATE_S = 0.020              # the planted sleep (the late rank)
JITTER_S = 0.060            # the one-off: three times as long, once
MESH_BYTES = 256 * 1024     # per all_reduce: a shaped link makes it tens of ms
STEP_SLEEP_S = 0.010        # the mesh's and the pipeline's "compute"
PIPE_BYTES = 256 * 1024
PIPE_MICRO = 4
CLONE_NEWNET = 0x40000000
# a job's ranks own their cores on a cluster; on this shared 2-core machine (load 10-20) a rank
# at the default priority was descheduled for 100+ ms at random: a real pause nobody planted
RANK_NICE = -10


def _planted(rank: int, out: Path, late: tuple[int, int] | None,
             jitter: tuple[int, int] | None) -> Callable[[int], None]:
    """The in-program sleep of ``--late`` / ``--jitter`` before the collective it precedes."""
    def before(step: int) -> None:
        for plan, seconds, every in ((late, LATE_S, True), (jitter, JITTER_S, False)):
            if plan is None or plan[0] != rank:
                continue
            if step == plan[1]:
                (out / "fault.json").write_text(json.dumps({"rank": rank, "step": step,
                                                            "time_ns": time.time_ns()}))
            if step == plan[1] or (every and step > plan[1]):
                time.sleep(seconds)
    return before


def mesh(rank: int, world: int, before: Callable[[int], None]) -> Callable[[int], None]:
    half = world // 2
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // half]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % half]
    x = torch.ones(MESH_BYTES // 4)

    def step(i: int) -> None:
        time.sleep(STEP_SLEEP_S)
        dist.all_reduce(x, group=tp)          # the TP all_reduce
        before(i)
        dist.all_reduce(x, group=dp)          # the DP all_reduce
    return step


def ddp(rank: int, world: int, before: Callable[[int], None]) -> Callable[[int], None]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(16, 256)

    def step(i: int) -> None:
        before(i)
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()
    return step


def pipe(rank: int, world: int, before: Callable[[int], None]) -> Callable[[int], None]:
    act = torch.ones(PIPE_BYTES // 4)

    def step(i: int) -> None:
        for _ in range(PIPE_MICRO):
            if rank > 0:
                dist.recv(act, src=rank - 1)
            time.sleep(STEP_SLEEP_S / PIPE_MICRO)
            before(i)
            if rank < world - 1:
                dist.send(act, dst=rank + 1)
    return step


WORKLOADS = {"mesh": mesh, "ddp": ddp, "pipe": pipe}


def _pair(values: list[str] | None) -> tuple[int, int] | None:
    return None if values is None else (int(values[0]), int(values[1]))


def rank_main(argv: list[str]) -> None:
    """One rank: ``RUN_DIR WORKLOAD [--late R S] [--jitter R S]``, its env set as torchrun's."""
    import commviz

    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("--late", nargs=2)
    p.add_argument("--jitter", nargs=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    commviz.start(a.run_dir)
    step = WORKLOADS[a.workload](rank, world, _planted(rank, a.run_dir, _pair(a.late),
                                                       _pair(a.jitter)))
    i = 0
    while True:                               # until the harness ends the trial
        step(i)
        if i == 0:
            (a.run_dir / f"ready_rank{rank}").touch()
        i += 1


def _enter_netns(name: str) -> None:
    """This process into the named network namespace (what ``ip netns exec`` does first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns {name}")
    finally:
        os.close(fd)


def serve() -> None:
    """Start ranks on request: torch and commviz are imported once here, and each rank is a
    fork of this process (on a loaded 2-core machine four ranks importing torch at once take
    up to a minute; a fork takes milliseconds). A request is one JSON line on stdin,
    ``{"argv": [...], "ranks": [{"env": {...}, "netns": NAME|null, "log": PATH}, ...]}``; the
    answer, one line: the ranks' pids. Each rank leads a session of its own and is reaped by
    the kernel (SIGCHLD ignored): the harness ends it by its process group."""
    import commviz  # noqa: F401  (imported before the forks, not started)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        req = json.loads(line)
        pids = []
        for spec in req["ranks"]:
            pid = os.fork()
            if pid == 0:
                _rank_child(req["argv"], spec)
            pids.append(pid)
        sys.stdout.write(json.dumps(pids) + "\n")
        sys.stdout.flush()


def _rank_child(argv: list[str], spec: dict) -> None:
    code = 1
    try:
        os.setsid()
        os.nice(RANK_NICE)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(0)
        if spec["netns"]:
            _enter_netns(spec["netns"])
        os.environ.update(spec["env"])
        rank_main(argv)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        rank_main(sys.argv[1:])
