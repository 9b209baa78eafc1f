"""What every origin resolver shares: the answer (``Origin``), how long it holds (``Refresh``),
the call it is asked about (``Call``) and the resolver's own description (``Resolver``)."""

from __future__ import annotations

from enum import Enum
from types import CodeType, FrameType
from typing import Any, Callable, NamedTuple

from commviz import metadata as md
from commviz.record.origins.frames import Frames


class Refresh(Enum):
    """What a later call of the same shape (call site, ranges, sizes) must work out again."""

    NOTHING = 0      # the shape's origin holds for each of its calls
    ALL = 1          # DDP buckets (may share a size), DTensor in a module (layers in a loop)
    MICROBATCH = 2   # batched p2p of a schedule without ranges: the micro-batch (MicroBatches)


class Origin(NamedTuple):
    """What a record says of where it comes from (``as_keys``: its metadata keys)."""

    text: str
    kind: md.OriginKind
    unit: str | None = None       # FSDP module, DDP bucket, pipeline stage, compiled function
    phase: str | None = None      # FSDP phase, pipeline action, DTensor placements
    extra: tuple[tuple[str, Any], ...] = ()
    refresh: Refresh = Refresh.NOTHING

    def as_keys(self, backward_site: str | None) -> dict[str, Any]:
        keys = {md.ORIGIN: self.text, md.ORIGIN_KIND: str(self.kind)}
        if self.unit is not None:
            keys[md.ORIGIN_UNIT] = self.unit
        if self.phase is not None:
            keys[md.ORIGIN_PHASE] = self.phase
        if backward_site is not None:
            keys[md.BACKWARD_CALLSITE] = backward_site
        keys.update(self.extra)
        return keys


class Call(NamedTuple):
    """A call a resolver is asked about: the c10d op, its sizes, the caller's frame, the
    boundary kernel's open ranges, what the one frame walk found (``frames.read``), and the
    recorder's origin state (``state``: the resolvers' caches)."""

    op: str
    kind: str                       # "collective" or "p2p"
    numel: int
    nbytes: int
    frame: FrameType | None         # the caller of the c10d op (None: no Python frame)
    own: Callable[[CodeType], bool]  # commviz's and torch's code: never a call site
    count: bool                     # False where the call is only looked at, not recorded
    ranges: list[str]               # the boundary kernel's open ranges, outermost first
    frames: Frames
    state: Any                      # state.State (which names the resolvers: no loop)


class Resolver(NamedTuple):
    """One framework's way of naming a call: ``resolve(call, cache)`` gives its origin or None
    (the next resolver is asked); ``cache`` makes its caches (``State`` keeps one per
    resolver, reset between tests); ``looks`` names the frames the one walk hands it
    (``frames.read``): {file: look(frame, found)}, files worked out once; ``prefixes``: the
    profiler ranges it reads (``Call.ranges``), which the boundary kernel then follows."""

    name: str
    resolve: Callable[[Call, Any], "Origin | None"]
    cache: Callable[[], Any] = lambda: None
    looks: Callable[[], dict[str, Callable[[FrameType, dict[str, Any]], None]]] = dict
    prefixes: tuple[str, ...] = ()
