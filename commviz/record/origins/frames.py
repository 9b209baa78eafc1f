"""The one walk over a call's live Python frames that every resolver reads from (``read``).

The walk itself knows only what all frameworks share: the user's call site (the first frame
outside torch and commviz), the modules being called, the backward pass the call runs in,
compiled code around it and a DDP comm hook's bucket. A framework's own frames are handed to
the looks its resolver registers by file (``Resolver.looks``), so the walk stays one pass
with one dictionary look-up per frame of torch, whichever frameworks are known."""

from __future__ import annotations

import functools
import os
import sys
from types import CodeType, FrameType
from typing import Any, Callable, NamedTuple

Look = Callable[[FrameType, dict[str, Any]], None]
# dynamo's wrapper of what it must not compile (``torch._disable_dynamo``: c10d's collectives
# under a dispatch mode run in it): not compiled code
_DISABLED = "DisableContext."


def torch_path(*parts: str) -> str:
    import torch

    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), *parts)


class PackageFrame(NamedTuple):
    """A frame of one framework's package: its file relative to the package, its function."""

    where: str
    name: str
    frame: FrameType


@functools.cache
def package_root(module: str) -> str:
    """The folder of the imported package ``module``, with a trailing separator."""
    return os.path.dirname(os.path.abspath(sys.modules[module].__file__)) + os.sep


def package_frames(frame: FrameType | None, root: str, qualified: bool = False
                   ) -> list[PackageFrame]:
    """The frames of the package at ``root`` from ``frame`` outwards, innermost first, each
    named by its function (``qualified``: its qualified name, ``Class.method``)."""
    out = []
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(root):
            name = getattr(code, "co_qualname", code.co_name) if qualified else code.co_name
            out.append(PackageFrame(code.co_filename[len(root):].replace(os.sep, "/"), name,
                                    frame))
        frame = frame.f_back
    return out


class _Places(NamedTuple):
    """torch's files whose frames every resolver may need."""

    engine: str                  # autograd's _engine_run_backward: a backward pass
    module: str                  # nn.Module's _call_impl
    compilers: tuple[str, ...]   # dynamo, AOTAutograd, inductor: compiled code runs here


_places: _Places | None = None


def where() -> _Places:
    global _places
    if _places is None:
        _places = _Places(
            torch_path("autograd", "graph.py"), torch_path("nn", "modules", "module.py"),
            tuple(torch_path(d) + os.sep for d in ("_dynamo", "_functorch", "_inductor")))
    return _places


class Frames(NamedTuple):
    """What the live Python frames of a call say (``read``)."""

    user: FrameType | None          # the call site's frame (the first outside torch/commviz)
    backward: str | None            # "file:line" of the user's backward() call
    compiled: FrameType | None      # the compiled function's frame, under compiled code
    modules: tuple[Any, ...]        # nn.Modules being called, innermost first
    bucket: Any                     # the DDP comm hook's GradBucket
    from_cpp: bool                  # no Python between the engine (or nothing) and the call
    found: dict[str, Any]           # what the resolvers' looks noted, by their own keys


def site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def read(frame: FrameType | None, own: Callable[[CodeType], bool],
         looks: dict[str, Look]) -> Frames:
    """Walk the frames from ``frame`` (the caller of the c10d op) outwards."""
    places = where()
    user = compiled = backward = bucket = None
    modules: list[Any] = []
    found: dict[str, Any] = {}
    seen_compiler = False
    from_cpp = frame is None or (frame.f_code.co_name == "_engine_run_backward"
                                 and frame.f_code.co_filename == places.engine)
    if frame is None:
        backward = _backward_elsewhere(own)
    while frame is not None:
        code = frame.f_code
        file = code.co_filename
        if bucket is None and "bucket" in code.co_varnames:
            bucket = _grad_bucket(frame.f_locals.get("bucket"))
        if not own(code):
            if file.startswith("<eval_with_key>"):
                seen_compiler = True
            elif user is None:
                user = frame
                compiled = frame if seen_compiler else None
        elif file == places.module:         # the most frequent: each module called, thrice
            if code.co_name == "_call_impl" and (mod := frame.f_locals.get("self")) is not None:
                modules.append(mod)
        elif file == places.engine and code.co_name == "_engine_run_backward":
            if backward is None:
                backward = user_site(frame.f_back, own)
        else:
            if file.startswith(places.compilers) and not code.co_qualname.startswith(_DISABLED):
                seen_compiler = True
            look = looks.get(file)
            if look is not None:
                look(frame, found)
        frame = frame.f_back
    return Frames(user, backward, compiled, tuple(modules), bucket, from_cpp, found)


def user_site(frame: FrameType | None, own: Callable[[CodeType], bool]) -> str | None:
    """"file:line" of the first frame from ``frame`` outwards outside torch and commviz."""
    while frame is not None and own(frame.f_code):
        frame = frame.f_back
    return None if frame is None else site(frame)


def _backward_elsewhere(own: Callable[[CodeType], bool]) -> str | None:
    """On an autograd device thread (no Python frame): the line of the thread blocked in a
    backward pass (it waits in ``_engine_run_backward``, its frames still; the GIL is held)."""
    engine = where().engine
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_engine_run_backward" and code.co_filename == engine:
                return user_site(frame.f_back, own)
            frame = frame.f_back
    return None


def _grad_bucket(value: Any) -> Any:
    import torch.distributed as dist

    return value if isinstance(value, dist.GradBucket) else None
