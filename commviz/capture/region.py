"""Capture-time regions of annotated collectives: which graph nodes did this collective add?

Importing this module connects the capture code to the recorder's hand-off
(``commviz.record.capturing``): ``calls.open_record`` then calls ``enter(rec, walk)`` when a
collective starts on a CUDA device while a capture may be running, and ``exit(token, rec)``
when it returns. A captured collective gets
its graph (``commviz.graph``), its ordinal within that graph on its lane (``commviz.ordinal``,
1-based) and, once the capture ends, its graph nodes (``commviz.graph_nodes``), all in the
compact record. The nodes are found one of two ways:

- a synchronous call (the common case, and the one capture time is spent on) costs one read of
  the stream's capture frontier as it returns: most are recorded by the boundary kernel, which
  reads the frontier itself and hands the call to its capture (``graphs.adopt_native``,
  placed after the capture or before the next call placed here); the others cost
  one cheap "is the stream capturing?" at entry and the frontier read at exit here. Their
  kernels are worked out from the whole graph after the capture (``GraphState``): the newest
  NCCL kernel the exit frontier depends on, since the previous exit on the stream;
- work the current stream does not wait for (async ops), user code in ``annotate_collective``
  and collectives under a running profiler (whose range needs the graph and ordinal up front)
  snapshot the frontier on entry and walk the dependent edges added since on exit.

Neither ever raises: a capture problem is logged once and the user's capture goes on.
"""

from __future__ import annotations

from typing import Any

import torch

from commviz import metadata as md
from commviz.capture import bindings as cb
from commviz.capture import graphs, hooks
from commviz.record import capturing

SYNC = "sync"          # the token of a synchronous region: everything happens at exit

_capturing = torch._C._cuda_isCurrentStreamCapturing if hasattr(
    torch._C, "_cuda_isCurrentStreamCapturing") else torch.cuda.is_current_stream_capturing


def probe() -> cb.CaptureInfo | None:
    """The current stream's capture, or None when it is not capturing (one CUDA query)."""
    stream = graphs._current_stream()
    backend = cb.backend()
    if backend is not None:
        return backend.capture_info(stream)
    if torch.cuda.is_current_stream_capturing():
        return cb.CaptureInfo(None, None, [], stream)
    return None


def _place(rec: list[Any], info: cb.CaptureInfo) -> graphs.GraphState:
    """Give ``rec`` its graph and ordinal in the capture ``info`` describes, after the calls
    the boundary kernel recorded before it."""
    graphs.adopt_native()
    state = graphs.state_for(info)
    state.place_native()
    state.place(rec)
    return state


def enter(rec: list[Any], walk: bool) -> Any:
    """Start a collective's region if the current stream is capturing; returns the token for
    ``exit`` (None: not capturing, or nothing to find)."""
    try:
        if not _capturing():        # the common case, one cheap query (a probe costs µs)
            return None
        if not walk:
            return SYNC
        info = probe()
        if info is None:
            return None
        if not hooks._saved:                # taken off since import: captures need them
            hooks.install()
        state = _place(rec, info)
        return graphs.Region(state, info) if state.graph is not None else None
    except Exception as exc:  # never break the user's capture
        rec[md.R_GRAPH] = rec[md.R_GRAPH] or 0
        graphs.warn_once("could not snapshot the capture frontier", exc)
        return None


def exit(token: Any, rec: list[Any]) -> None:  # noqa: A001 - mirrors __exit__
    """End the region ``enter`` returned ``token`` for."""
    try:
        if token is not SYNC:
            token.state.claim(rec, graphs.label_collective(token, rec))
            return
        info = probe()
        if info is None:                        # the capture ended inside the call
            rec[md.R_GRAPH] = 0
            return
        if not hooks._saved:
            hooks.install()
        _place(rec, info).returned(rec, info.stream, info.frontier)
    except Exception as exc:
        rec[md.R_GRAPH] = rec[md.R_GRAPH] or 0
        graphs.warn_once("could not find the captured nodes of a collective", exc)


capturing.connect(capture_possible=hooks.capture_possible, capturing_here=_capturing,
                  installed=hooks.installed, enter=enter, exit=exit)
