"""torch's own Flight Recorder, kept in the run dir beside commviz's records.

When a job turns the Flight Recorder on (``TORCH_FR_BUFFER_SIZE``, or NCCL's older
``TORCH_NCCL_TRACE_BUFFER_SIZE``), each rank's dumps land in ``RUN_DIR/flight_recorder/`` under
torch's own names (``rank_{R}``), where torch's analyzer reads them as they are::

    python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder

A dump torch writes itself (NCCL's dump on timeout) goes there because the ranks' dump prefix
(``TORCH_FR_DUMP_TEMP_FILE``) points there unless the job set its own; a rank that finishes its
workload writes one too, so every run with the recorder on has a dump to check commviz against.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from commviz.review.analyses.flightrec import PREFIX, dump_path, folder

BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
PREFIX_VAR = "TORCH_FR_DUMP_TEMP_FILE"


def enabled() -> bool:
    return any(os.environ.get(v, "0") not in ("", "0") for v in BUFFER_VARS)


def point_dumps_at(run_dir: Path) -> None:
    """Before the process group exists: torch's own dumps go to the run dir (unless the job
    chose a place)."""
    if enabled() and PREFIX_VAR not in os.environ:
        folder(run_dir).mkdir(parents=True, exist_ok=True)
        os.environ[PREFIX_VAR] = str(folder(run_dir) / PREFIX)


def dump(run_dir: Path, rank: int) -> Path | None:
    """This rank's Flight Recorder now, as torch writes it on a timeout (a pickle of plain
    data); a dump torch already wrote for this rank (a timeout's) is kept, never overwritten."""
    if not enabled():
        return None
    import torch
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    nccl = dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace")
    data = c10d._dump_nccl_trace() if nccl else c10d._dump_fr_trace()
    path = dump_path(run_dir, rank)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else pickle.dumps(data))
    tmp.replace(path)
    return path
