"""Hooks on ``torch.cuda.CUDAGraph``: capture boundaries and replay tags.

``install()`` wraps four methods of ``torch.cuda.CUDAGraph`` (so ``torch.cuda.graph``,
``make_graphed_callables`` and direct use are all covered):

- ``capture_begin``: the capture gets its commviz graph id;
- ``capture_end``: before capture really ends, the whole graph is read once, in one C++ call
  (``GraphState.read``); the record is finished later, before it is written, and the
  collectives the boundary kernel recorded in the capture are handed to it then
  (``graphs.adopt_native``); after it, the exec graph's id is noted;
- ``instantiate``: the exec graph's id (``keep_graph=True`` instantiates late);
- ``replay``: counts replays and, while a profiler runs, wraps the launch in a
  ``commviz::graph_replay`` range whose args are ``commviz.graph`` and ``commviz.replay``
  (and notes the replay in the recorder), so each replay in a trace names its graph.
  Without a profiler it costs one check.

It is installed when commviz is imported (and again by ``commviz.graph`` or the first annotated
collective or mark under capture, if it was taken off). Counting the captures in progress lets
every collective outside a capture skip asking CUDA whether its stream is capturing: that query
cost several microseconds per call on the H200s. A hook never raises into the user's code.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from commviz import metadata as md
from commviz.capture import graphs
from commviz.record import capturing
from commviz.record import recorder as _rec

REPLAY_RANGE = md.REPLAY_RANGE
GRAPH_ARG = md.GRAPH
REPLAY_ARG = md.REPLAY

_profiler_enabled = torch._C._autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
_lock = threading.Lock()
_saved: dict[str, Any] = {}
_own: set[str] = set()          # methods CUDAGraph defines itself (not inherited)
_ATTR = "_commviz_graph"
_active = 0                     # captures begun through the hooks and not ended yet, all threads


def capture_possible() -> bool:
    """Whether some stream may be capturing: a hooked capture is open, or no hooks are in."""
    return _active > 0 or not _saved


def _count(delta: int) -> None:
    global _active
    with _lock:
        _active = max(0, _active + delta)
        capturing.changed()


def state_of(cuda_graph: Any) -> graphs.GraphState | None:
    return getattr(cuda_graph, _ATTR, None)


def _bind(cuda_graph: Any, state: graphs.GraphState) -> None:
    try:
        setattr(cuda_graph, _ATTR, state)
    except AttributeError:  # a CUDAGraph subclass with __slots__: replays stay untagged
        graphs.warn_once("cannot tag replays of this CUDAGraph (no instance dict)")


def _capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
    _saved["capture_begin"](self, *args, **kwargs)
    _count(+1)
    try:
        state, _ = graphs.current_capture()
        _bind(self, state)
    except Exception as exc:
        graphs.warn_once("capture_begin hook failed", exc)


def _capture_end(self: Any) -> None:
    state = state_of(self)
    try:
        if state is None:                 # hooks installed mid-capture: find it by its stream
            state, _ = graphs.current_capture()
            _bind(self, state)
        state.read()
    except Exception as exc:
        graphs.warn_once("could not read the captured graph", exc)
    try:
        _saved["capture_end"](self)
    finally:
        _count(-1)
    if state is not None:
        try:
            state.record["t_end_ns"] = time.time_ns()
            graphs.forget(state)
            state.note_exec(self)
        except Exception as exc:
            graphs.warn_once("capture_end hook failed", exc)


def _instantiate(self: Any) -> None:
    _saved["instantiate"](self)
    state = state_of(self)
    if state is not None:
        state.exec_pending = True       # a new exec graph replaces the old one
        state.note_exec(self)


def _replay(self: Any) -> None:
    state = getattr(self, _ATTR, None)
    if state is None:
        return _saved["replay"](self)
    state.replays += 1
    state.record["replays"] = n = state.replays
    if not _profiler_enabled():
        _saved["replay"](self)
    else:
        rng = _RecordFunctionFast(REPLAY_RANGE, [], {GRAPH_ARG: state.gid, REPLAY_ARG: n})
        t0 = time.time_ns()
        rng.__enter__()
        try:
            _saved["replay"](self)
        finally:
            rng.__exit__(None, None, None)
            if _rec.RECORDER.enabled:
                _rec.RECORDER.replays.append({"graph": state.gid, "replay": n, "t_begin_ns": t0,
                                              "t_end_ns": time.time_ns(),
                                              "tid": threading.get_native_id()})
    if state.exec_pending:              # keep_graph=True instantiates in its first replay
        state.note_exec(self)
    return None


_HOOKS = {"capture_begin": _capture_begin, "capture_end": _capture_end,
          "instantiate": _instantiate, "replay": _replay}


def install() -> None:
    """Wrap ``torch.cuda.CUDAGraph``'s methods (idempotent)."""
    if _saved:
        return
    with _lock:
        if _saved:
            return
        cls = torch.cuda.CUDAGraph
        originals = {name: getattr(cls, name) for name in _HOOKS if hasattr(cls, name)}
        _own.update(name for name in originals if name in cls.__dict__)
        _saved.update(originals)           # before the swap: a hook may run at once
        for name in originals:
            setattr(cls, name, _HOOKS[name])
        capturing.changed()


def uninstall() -> None:
    """Put ``torch.cuda.CUDAGraph``'s own methods back."""
    with _lock:
        cls = torch.cuda.CUDAGraph
        for name, original in _saved.items():
            if name in _own:
                setattr(cls, name, original)
            else:
                delattr(cls, name)
        _saved.clear()
        _own.clear()
        capturing.changed()


def installed() -> bool:
    return bool(_saved)


class graph(torch.cuda.graph):  # noqa: N801 - the same context manager as torch.cuda.graph
    """``torch.cuda.graph`` whose captures and replays commviz can name in a trace.

    Same arguments as ``torch.cuda.graph``. Collectives and ``commviz.mark`` blocks inside are
    recorded per graph; ``cuda_graph.replay()`` then tags each replay while a profiler runs.
    """

    def __init__(self, cuda_graph: Any, *args: Any, **kwargs: Any) -> None:
        install()
        super().__init__(cuda_graph, *args, **kwargs)
