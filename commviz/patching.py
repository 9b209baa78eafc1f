"""Instrument an unmodified program: swap torch.distributed's functions for commviz's wrappers.

``commviz.patch()`` replaces the wrapped functions in ``torch.distributed`` and
``torch.distributed.distributed_c10d`` (so code that looks them up at call time is covered) and
``P2POp`` in ``torch.distributed``; ``unpatch()`` puts the originals back. ``isend``/``irecv``
stay torch's own inside ``distributed_c10d`` because torch's ``P2POp`` validates against them.
Also usable as ``with commviz.patch(): ...``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as _td
import torch.distributed.distributed_c10d as _c10d

from commviz import distributed as _cv

_lock = threading.Lock()
_saved: list[tuple[Any, str, Any]] = []


class patch:  # noqa: N801 - a function to call that is also a context manager
    """Route torch.distributed's collectives and p2p ops through commviz (idempotent)."""

    def __init__(self) -> None:
        with _lock:
            if _saved:
                return
            targets: list[tuple[Any, str, Any]] = []
            for name, wrapper in _cv.WRAPPERS.items():
                targets.append((_td, name, wrapper))
                if name not in ("isend", "irecv"):
                    targets.append((_c10d, name, wrapper))
            targets.append((_td, "P2POp", _cv.P2POp))
            for module, name, new in targets:
                _saved.append((module, name, getattr(module, name)))
                setattr(module, name, new)

    def __enter__(self) -> "patch":
        return self

    def __exit__(self, *exc: Any) -> None:
        unpatch()


def unpatch() -> None:
    """Restore torch.distributed's own functions."""
    with _lock:
        while _saved:
            module, name, original = _saved.pop()
            setattr(module, name, original)


def is_patched() -> bool:
    return bool(_saved)
