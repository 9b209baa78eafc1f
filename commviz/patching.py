"""``commviz.patch()``: record an unmodified program's collectives.

Nothing of torch.distributed is replaced: ``patch()`` installs the c10d boundary recorder
(``commviz.record.boundary``), which sees every collective whoever issues it, and the
``torch.cuda.CUDAGraph`` hooks that name captured collectives. ``unpatch()`` gives torch its own
kernels back. Also usable as ``with commviz.patch(): ...``.
"""

from __future__ import annotations

from typing import Any

from commviz.capture import hooks
from commviz.record import boundary


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
