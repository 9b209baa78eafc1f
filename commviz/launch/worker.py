"""What torchrun runs on every rank: ``python -m commviz.launch.worker --config
RUN_DIR/config.yaml`` (the resolved config, which the launch writes into the run dir).

Init the process group, create the named groups, record with commviz, profile the workload's
steps, then (collectively) measure clock offsets, write this rank's Perfetto shard, matched run
and comm table (``commviz.convert.convert_here``), and gather into rank 0's run dir: everything
(``output.gather: full``) or the comm tables only (``tables``).

A rank that fails writes ``RUN_DIR/logs/failed_rank{R}.json`` (what went wrong), flushes its
record (so nothing recorded is lost), hands the exception to torchrun's error file, and exits 1.
SIGTERM (torchrun stopping the job after another rank failed) unwinds the same way, so the
profiler still exports what it traced. The process ends with ``os._exit`` after an explicit
flush: ``destroy_process_group`` has been seen to hang at exit on the GPU machines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from commviz.launch import placement
from commviz.review.analyses.exits import FAILED, FailedFile, log_dir
# what write_shard leaves beside the record: the shard and the rank's matched run, and the comm
# table made from it (what ``commviz overview`` reads)
SHARD_PATTERNS = ("shard_rank{rank}.pftrace", "matched_rank{rank}.json", "comm_rank{rank}.json")


class Stopped(Exception):
    """This rank was told to stop (SIGTERM/SIGINT from torchrun)."""


class _Export:
    """Whether a trace export is under way, and the stop signal that came during it.

    torchrun stops the other ranks (SIGTERM) a moment after one fails, just as a survivor,
    whose collective broke, unwinds through its profiler and exports what it traced. A
    ``Stopped`` raised inside that export would lose the survivor's trace; it is raised once
    the trace is written instead."""

    running = False
    pending: int | None = None


def _stop(signum: int, frame: Any) -> None:
    if _Export.running:
        _Export.pending = signum
        return
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def _whole(handler: Callable[[Any], None]) -> Callable[[Any], None]:
    """``handler`` (an ``on_trace_ready``) run to its end whatever stop signal comes (``_Export``)."""

    def export(prof: Any) -> None:
        _Export.running, _Export.pending = True, None
        try:
            handler(prof)
        finally:
            _Export.running = False
        if _Export.pending is not None:
            _stop(_Export.pending, None)

    return export


class _NoProfiler:
    """Stands in for the profiler when ``profile.enabled`` is false."""

    def __enter__(self) -> "_NoProfiler":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def step(self) -> None:
        return None


def _profiler(cfg: Any, run_dir: Path) -> Any:
    import torch

    import commviz

    p = cfg.profile
    if not p.enabled:
        return _NoProfiler()
    schedule = torch.profiler.schedule(wait=p.wait, warmup=p.warmup, active=p.active,
                                       repeat=p.repeat)
    return commviz.profile(run_dir, schedule=schedule, record_shapes=p.record_shapes,
                           with_stack=p.with_stack,
                           on_trace_ready=_whole(commviz.trace_handler(run_dir)))


def _finish(run_dir: Path, here: placement.Placement, mode: Any, gather_traces: bool = True
            ) -> None:
    """Collective: clock offsets, flush, this rank's conversion, gather, final barrier.

    ``here``: this rank's placement (rank 0's host and run dir are added to its file).
    ``mode``: ``commviz.gathered.Mode``. ``gather_traces=False`` (full gather): a rank whose
    shard was written sends only the shard and its record to rank 0's run dir (when it is not
    shared); its raw traces stay on its node."""
    import torch.distributed as dist

    import commviz
    from commviz.convert import convert_here
    from commviz.gathering import side_group
    from commviz.record import clock
    from commviz.record.recorder import RECORDER

    rank = here.rank
    group = side_group()
    RECORDER.clock = clock.measure_offsets(group)
    commviz.flush("finished")
    problem = convert_here(run_dir, rank)
    if problem is not None:    # the merge converts this rank itself; the job still succeeds
        print(f"[commviz] rank {rank}: write_shard failed ({problem}); the merge will convert "
              "this rank's trace", file=sys.stderr)
    commviz.gather(run_dir, extra_patterns=SHARD_PATTERNS, measure_clock=False,
                   traces=gather_traces or problem is not None, mode=mode)
    with commviz.unrecorded():
        here.rank0_host, here.rank0_run_dir = _rank0_where(run_dir, rank, group)
        placement.write(log_dir(run_dir), here)    # a disk that refuses it fails the rank
        dist.barrier(group=group)


def _place(run_dir: Path) -> placement.Placement:
    """This rank's placement file at its start, before torch is imported (``commviz status``
    tells from it that the rank started, and when); a disk that refuses it here is reported and
    the job goes on (its end fails the rank, naming the disk)."""
    here = placement.from_env(os.environ)
    try:
        placement.write(log_dir(run_dir), here)
    except OSError as exc:
        print(f"[commviz] rank {here.rank}: its placement file could not be written "
              f"({_os_error(exc, log_dir(run_dir))})", file=sys.stderr)
    return here


def _rank0_where(run_dir: Path, rank: int, group: Any) -> tuple[str, str]:
    """Rank 0's host and run dir, sent to every rank (JSON bytes as a uint8 tensor): what the
    other nodes' launches tell their users."""
    import torch
    import torch.distributed as dist

    data = json.dumps({"host": socket.gethostname(), "run_dir": str(run_dir)}).encode()
    size = torch.tensor([len(data) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0
           else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(buf, 0, group=group)
    where = json.loads(buf.numpy().tobytes())
    return where["host"], where["run_dir"]


def run(config_path: str) -> None:
    run_dir = Path(config_path).parent       # the launch writes the resolved config there
    placed = _place(run_dir)                 # before anything can fail, and before torch loads

    from commviz.launch import config as C

    loaded = C.load(config_path)             # its checks may import torch (dtype sizes)
    cfg = loaded.config

    import torch
    import torch.distributed as dist

    import commviz
    from commviz.gathered import Mode
    from commviz.launch import flight, groups, workloads

    sys.path[:0] = [p for p in cfg.workload.pythonpath if p not in sys.path]  # user code's imports
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if C.uses_nccl(cfg):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    flight.point_dumps_at(run_dir)
    if C.uses_nccl(cfg):        # NCCL loads its profiler when it makes the first communicator,
        from commviz.record import nccl_plugin   # which device_id below makes at once

        nccl_plugin.arm(run_dir, rank)
    dist.init_process_group(cfg.job.backend, timeout=datetime.timedelta(seconds=cfg.job.timeout_s),
                            device_id=device if cfg.job.backend == "nccl" else None)
    commviz.start(run_dir, capacity=cfg.record.capacity)   # every collective, whoever calls it
    if cfg.live.debug_server is not None:
        from commviz.serve.debug import start_in_job

        start_in_job(run_dir, cfg.live.debug_server, rank, C.uses_nccl(cfg))
    made = groups.create(cfg, rank)
    ctx = workloads.Context(rank=rank, world_size=world, local_rank=local_rank, device=device,
                            backend=cfg.job.backend, groups=made.pgs, group_ranks=made.ranks,
                            args=dict(cfg.workload.args), cuda_graphs=cfg.workload.cuda_graphs,
                            seed=cfg.workload.seed)
    step = workloads.build(cfg.workload, ctx, C.pythonpath(loaded))
    workloads.run(step, cfg.workload, ctx, _profiler(cfg, run_dir))
    flight.dump(run_dir, rank)
    _finish(run_dir, placed, Mode.resolve(cfg.output.gather, world), cfg.output.gather_traces)


def _fail(exc: BaseException) -> None:
    """Leave word of this rank's failure where the launcher and torchrun look, keep its record.

    On a full or read-only disk neither may be writable: the reason then says so, and the one
    line ``[commviz] rank R failed at NS: REASON`` on stderr (through torchrun) still carries it,
    with the time the launcher orders failures by (torchrun interleaves the ranks' output)."""
    failed_at = time.time_ns()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ.get("RANK", -1))
    text = "".join(traceback.format_exception(exc))
    reason = f"{type(exc).__name__}: {exc}".strip()
    try:
        from commviz.record.recorder import RECORDER

        if RECORDER.run_dir is not None:
            if isinstance(exc, OSError) and exc.filename is None:
                reason += f" (writing in {RECORDER.run_dir})"
            reason = _leave_word(RECORDER.run_dir, rank, exc, reason, text)
            _keep_flight_recorder(RECORDER.run_dir, rank)
    finally:
        sys.stderr.write(f"[commviz] rank {rank} failed at {failed_at}: {reason}\n{text}")
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def _keep_flight_recorder(run_dir: Path, rank: int) -> None:
    """torch's Flight Recorder as it stands at the failure, beside the record (if it is on)."""
    from commviz.launch import flight

    try:
        flight.dump(run_dir, rank)
    except Exception as err:  # the recorder's own trouble must not hide the rank's failure
        sys.stderr.write(f"[commviz] rank {rank}: no Flight Recorder dump ({err})\n")


def _leave_word(run_dir: Path, rank: int, exc: BaseException, reason: str, text: str) -> str:
    """Flush the record and write the failure file; the reason, with what could not be written."""
    from commviz.record.recorder import RECORDER

    try:
        RECORDER.flush("failed")
    except OSError as err:
        reason += f" (its record could not be written: {_os_error(err, run_dir)})"
    try:
        log_dir(run_dir).mkdir(parents=True, exist_ok=True)
        (log_dir(run_dir) / FAILED.format(rank=rank)).write_text(json.dumps(FailedFile(
            rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", -1)),
            group_rank=int(os.environ.get("GROUP_RANK", 0)),
            host=socket.gethostname(), pid=os.getpid(), time_ns=time.time_ns(),
            stopped=isinstance(exc, Stopped), error=reason, traceback=text,
        ), indent=1))
    except OSError as err:
        reason += f" (its failure file could not be written: {_os_error(err, log_dir(run_dir))})"
    return reason


def _os_error(err: OSError, where: Path) -> str:
    return f"{err.filename or where}: {err.strerror or err}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="commviz.launch.worker",
                                     description="one rank of a `commviz launch` job")
    parser.add_argument("--config", required=True, help="the resolved config (RUN_DIR/config.yaml)")
    args = parser.parse_args(argv)
    # torch's notices that say nothing about this job: renamed collectives, profiler cycles
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*Profiler clears events at the end of each cycle")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)   # commviz.start chains its flush in front of this
    code = 0
    try:
        run(args.config)
    except BaseException as exc:  # every failure: report it, keep the record, exit non-zero
        code = 1
        try:
            _fail(exc)
        except BaseException:  # reporting must not hide the original exit code
            traceback.print_exc()
    from commviz.record import stacks

    stacks.tidy()                   # os._exit runs no atexit hooks
    debug = sys.modules.get("commviz.serve.debug")      # loaded only with live.debug_server
    if debug is not None:
        debug.stop_in_job()         # os._exit would leave torch's debug server's frontend up
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
