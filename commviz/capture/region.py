"""Capture-time regions of annotated collectives: which graph nodes did this collective add?

``commviz.annotate`` calls ``enter(meta)`` when a collective starts under CUDA graph capture and
``exit(token, meta)`` when the call returns. ``enter`` names the graph (``commviz.graph``) and the
collective's ordinal within it on its lane (``commviz.ordinal``, 1-based) and snapshots the
capture frontier; ``exit`` walks only the nodes added since and stores their CUPTI node ids in
``commviz.graph_nodes`` (the graph record in ``commviz.capture.graphs`` keeps the rest). Neither
ever raises: a capture problem is logged once and the user's capture goes on.
"""

from __future__ import annotations

from typing import Any

from commviz import metadata as md
from commviz.capture import graphs, hooks


def enter(meta: dict[str, Any]) -> Any:
    try:
        hooks.install()
        region = graphs.open_region()
        lane = meta.get(md.LANE)
        ordinal = region.state.next_ordinal(lane)
        meta[md.GRAPH] = region.state.gid
        meta[md.ORDINAL] = ordinal
        return (region, lane, ordinal)
    except Exception as exc:  # never break the user's capture
        graphs.warn_once("could not snapshot the capture frontier", exc)
        return None


def exit(token: Any, meta: dict[str, Any]) -> None:  # noqa: A001 - mirrors __exit__
    if token is None:
        return
    region, lane, ordinal = token
    try:
        found = graphs.label_collective(region, meta, lane, ordinal)
        meta[md.GRAPH_NODES] = [n["node"] for n in found if n["node"] is not None]
    except Exception as exc:
        graphs.warn_once("could not walk the captured nodes", exc)
