"""What the origin resolvers keep between calls, in one object the recorder owns
(``Recorder.origins``): the names seen so far, each resolver's own caches, the origin of each
call shape. ``reset`` empties them all (between tests, between programs of one job)."""

from __future__ import annotations

import functools
from typing import Any

from commviz.record.origins.base import Resolver
from commviz.record.origins.frames import Look
from commviz.record.origins.user_names import Names


class State:
    """The resolvers' state; ``native`` is the boundary kernel's module once it is installed
    (its open ranges and counts of them), which ``reset`` leaves in place."""

    def __init__(self, resolvers: tuple[Resolver, ...]) -> None:
        self.resolvers = resolvers
        self.native: Any = None
        # per call shape (calls.with_origin): its origin keys, and whether each call adds its
        # micro-batch; and a collective's merged extra, one dict per content
        self.shapes: dict[tuple[Any, ...], tuple[dict[str, Any], bool]] = {}
        self.merged: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget everything learnt (the dicts others hold are emptied in place)."""
        self.modules = Names()              # every module seen, by its name in its model
        self.params: dict[int, str] = {}    # DDP's parameters' names, by id
        self.caches = {r.name: r.cache() for r in self.resolvers}
        self.shapes.clear()
        self.merged.clear()

    @functools.cached_property
    def looks(self) -> dict[str, Look]:
        """The resolvers' looks by file, for the one frame walk (torch's paths, worked out
        at the first call resolved)."""
        return {file: look for r in self.resolvers for file, look in r.looks().items()}

    def ranges(self, origin_id: int) -> list[str]:
        """The names of the ranges open at the call (the boundary kernel's origin id)."""
        native = self.native
        return native.origin_path(origin_id) if origin_id and native is not None else []

    def prefixes(self) -> tuple[str, ...]:
        return tuple(p for r in self.resolvers for p in r.prefixes)
