"""``commviz.profile``: torch.profiler.profile that exports each rank's trace into the run dir.

Same habits as torch.profiler: pass ``schedule=``, call ``step()``; each ready trace is written
as ``RUN_DIR/trace_rank{R}[_step{N}].json.gz`` beside the rank's record, which lists it.
``record_shapes`` defaults to False, as torch's does: commviz needs nothing of it (the match step
pairs each record with the profiler's own ``c10d::<op>`` event, or an ``annotate_collective``
block's ``commviz::<name>`` range, by thread and time after the job).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile as _profile

from commviz.record import recorder as _rec
from commviz.record import schema


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def trace_handler(run_dir: str | os.PathLike[str] | None = None, *, stepped: bool = True
                  ) -> Callable[[Any], None]:
    """An ``on_trace_ready`` callback writing this rank's trace into ``run_dir`` (gzip JSON).

    ``stepped``: name each trace by its profiler step (a schedule can produce several). A
    repeating schedule hands the block's last, partial cycle over under the step number of the
    trace before it; that one is written beside it (``_step{N}_end``), never over it.
    """
    written: set[str] = set()

    def handler(prof: Any) -> None:
        target = Path(run_dir) if run_dir is not None else _rec.RECORDER.run_dir
        if target is None:
            raise RuntimeError("commviz.trace_handler: no run dir (pass one or call commviz.start)")
        target.mkdir(parents=True, exist_ok=True)
        step = prof.step_num if stepped else None
        name = schema.trace_name(_rank(), step)
        if name in written:
            name = schema.trace_name(_rank(), step, end=True)
        written.add(name)
        prof.export_chrome_trace(str(target / name))
        _rec.RECORDER.add_trace(name)
    return handler


def profile(run_dir: str | os.PathLike[str] | None = None, *, activities: Any = None,
            schedule: Any = None, record_shapes: bool = False, with_stack: bool = False,
            on_trace_ready: Callable[[Any], None] | None = None, **kwargs: Any) -> Any:
    """``torch.profiler.profile`` with commviz's trace export; CUDA activity added when present."""
    if activities is None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
    if on_trace_ready is None:
        on_trace_ready = trace_handler(run_dir, stepped=schedule is not None)
    return _profile(activities=activities, schedule=schedule, record_shapes=record_shapes,
                    with_stack=with_stack, on_trace_ready=on_trace_ready, **kwargs)
