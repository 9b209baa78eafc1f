"""Compiled code: the compiled function and its ``file:line`` (a ``Torch-Compiled Region``);
a compiled graph's backward by the region whose forward ran that graph."""

from __future__ import annotations

import os
from types import FrameType
from typing import Any

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.frames import Look, torch_path

_AOT = "compiled.aot"


def _look_aot(frame: FrameType, found: dict[str, Any]) -> None:
    """AOTAutograd's CompiledFunction ``forward`` / ``backward``: its ctx is the graph's
    autograd node in both."""
    name = frame.f_code.co_name
    if _AOT not in found and name in ("forward", "backward"):
        graph = getattr(getattr(frame.f_locals.get("ctx"), "_forward_cls", None), "_aot_id",
                        None)
        if graph is not None:
            found[_AOT] = (graph, name == "backward")


def _looks() -> dict[str, Look]:
    return {torch_path("_functorch", "_aot_autograd", "runtime_wrappers.py"): _look_aot}


def _backward(aot: int, graphs: dict[int, tuple[str, str]]) -> Origin:
    """A compiled graph's backward (on a GPU autograd's device thread, no frame of the user's;
    on CPU, under the line that called ``backward()``): named by the region whose forward ran
    that graph (seen by an earlier record), else by AOTAutograd's graph id. Per call: graphs
    of one shape may be different regions'."""
    qualname, at = graphs.get(aot, (f"AOT graph {aot}", None))
    where = f" ({os.path.basename(at)})" if at else ""
    return Origin(f"Torch-Compiled Region: {qualname}{where} backward", md.OriginKind.COMPILED,
                  qualname, "backward", ((md.COMPILED_AT, at),) if at else (), Refresh.ALL)


def _resolve(call: Call, graphs: dict[int, tuple[str, str]]) -> Origin | None:
    """``graphs``: AOTAutograd graph id -> (qualname, "file:line") of the compiled function
    whose forward ran it."""
    aot = call.frames.found.get(_AOT)
    if aot is not None and aot[1]:
        return _backward(aot[0], graphs)
    if call.frames.compiled is None:
        return None
    code = call.frames.compiled.f_code
    at = f"{code.co_filename}:{code.co_firstlineno}"
    qualname = getattr(code, "co_qualname", code.co_name)
    if aot is not None:
        graphs[aot[0]] = (qualname, at)
    return Origin(f"Torch-Compiled Region: {qualname} ({os.path.basename(at)})",
                  md.OriginKind.COMPILED, qualname, None, ((md.COMPILED_AT, at),))


RESOLVER = Resolver("compiled", _resolve, dict, _looks)
