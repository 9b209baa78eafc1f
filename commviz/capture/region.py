"""Capture-time regions of annotated collectives: which graph nodes did this collective add?

``commviz.annotate`` asks ``probe()`` whether the current stream is capturing, then calls
``enter(rec, capture, walk)`` when a collective starts and ``exit(token)`` when it returns.
``enter`` names the graph (``commviz.graph``) and the collective's ordinal within it on its lane
(``commviz.ordinal``, 1-based) in the compact record. The graph nodes (``commviz.graph_nodes``)
are found one of two ways:

- a synchronous collective costs two reads of the stream's capture frontier, at entry and at
  exit; the nodes between the two are resolved from the whole graph once, when the capture ends
  (``GraphState.finalize``). Capture time counts, and this is the cheapest exact way;
- work whose end the current stream does not wait for (async ops, user code in
  ``annotate_collective``) walks the dependent edges added since entry as it exits.

Neither ever raises: a capture problem is logged once and the user's capture goes on.
"""

from __future__ import annotations

from typing import Any

import torch

from commviz import metadata as md
from commviz.capture import bindings as cb
from commviz.capture import graphs, hooks


class Capture:
    """The current stream and its capture (``info`` None: no CUDA backend to read it with)."""

    __slots__ = ("stream", "info")

    def __init__(self, stream: int, info: cb.CaptureInfo | None) -> None:
        self.stream = stream
        self.info = info


def probe() -> Capture | None:
    """The current stream's capture, or None when it is not capturing (one CUDA query)."""
    try:
        stream = graphs._current_stream()
        if cb.available():
            info = cb.capture_info(stream)
            return None if info is None else Capture(stream, info)
        return Capture(stream, None) if torch.cuda.is_current_stream_capturing() else None
    except Exception as exc:  # never break the user's capture
        graphs.warn_once("could not ask whether the stream is capturing", exc)
        return None


def enter(rec: list[Any], capture: Capture, walk: bool) -> Any:
    """Start a collective's region in its capture; returns the token for ``exit``."""
    try:
        hooks.install()
        state = graphs.state_for(capture.info)
        lane = rec[md.R_INFO].lane
        rec[md.R_GRAPH] = state.gid
        rec[md.R_ORDINAL] = state.next_ordinal(lane)
        info = capture.info
        if info is None or state.graph is None:
            return None
        if walk or not info.frontier:       # nothing to diff against: walk from the roots
            return (rec, graphs.Region(state, info))
        return (rec, state, capture.stream, info.frontier)
    except Exception as exc:
        rec[md.R_GRAPH] = rec[md.R_GRAPH] or 0
        graphs.warn_once("could not snapshot the capture frontier", exc)
        return None


def exit(token: Any) -> None:  # noqa: A001 - mirrors __exit__
    """End a region; ``token`` is what ``enter`` returned."""
    try:
        if len(token) == 4:
            rec, state, stream, frontier = token
            info = cb.capture_info(stream)
            state.defer(rec, frontier, info.frontier if info is not None else [])
        else:
            rec, region = token
            region.state.claim(rec, graphs.label_collective(region, rec))
    except Exception as exc:
        graphs.warn_once("could not find the captured nodes of a collective", exc)
