"""``commviz.start()`` and ``commviz.patch()``: record an unmodified program's collectives.

Nothing of torch.distributed is replaced: both install the c10d boundary recorder
(``commviz.record.boundary``), which sees every collective whoever issues it, and the
``torch.cuda.CUDAGraph`` hooks that name captured collectives (``commviz.capture``, which
connects itself to the recorder as it is imported here). ``start`` also arms the recorder
(run dir, flushing). ``unpatch()`` gives torch its own kernels back. ``patch`` is also usable
as ``with commviz.patch(): ...``.
"""

from __future__ import annotations

import os
from typing import Any

from commviz.capture import hooks, region  # noqa: F401 - region connects the capture hand-off
from commviz.record import boundary, recorder


class patch:  # noqa: N801 - a function to call that is also a context manager
    """Start recording every collective at the c10d boundary (idempotent)."""

    def __init__(self) -> None:
        boundary.install()
        hooks.install()

    def __enter__(self) -> "patch":
        return self

    def __exit__(self, *exc: Any) -> None:
        unpatch()


def unpatch() -> None:
    """Stop recording at the c10d boundary and take the CUDA graph hooks off."""
    boundary.uninstall()
    hooks.uninstall()


def start(run_dir: str | os.PathLike[str] | None = None, *, capacity: int | None = None,
          enabled: bool = True, handle_signals: bool = True,
          flush_interval: float | None = 30.0) -> recorder.Recorder:
    """Record every collective from now on (the c10d boundary recorder and the CUDA graph
    hooks go in), into ``run_dir`` (default ``$COMMVIZ_RUN_DIR``), and arm flushing.

    The record is written at normal interpreter exit, when SIGTERM/SIGINT arrive (the previous
    handlers still run afterwards) and every ``flush_interval`` seconds while new records come
    in (None: never). Call ``flush()`` yourself before ``os._exit``.
    """
    patch()
    armed = recorder.arm(run_dir, capacity=capacity, enabled=enabled,
                         handle_signals=handle_signals, flush_interval=flush_interval)
    if armed.run_dir is not None:
        _arm_gputime(armed.run_dir)
    return armed


def _arm_gputime(run_dir: Any) -> None:
    """GPU times of NCCL ops (``commviz.record.nccl_plugin``), where NCCL can run."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        from commviz.record import nccl_plugin

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        nccl_plugin.arm(run_dir, rank)
