"""Capture-time regions: find the CUDA graph nodes a collective adds while a graph is captured.

Placeholder interface used by ``commviz.annotate``; the CUDA implementation lives beside it.
``enter(meta)`` snapshots the capture frontier and returns a token; ``exit(token, meta)`` walks
only the new nodes and fills ``commviz.graph``, ``commviz.graph_nodes`` and ``commviz.ordinal``.
"""

from __future__ import annotations

from typing import Any


def enter(meta: dict[str, Any]) -> Any:
    return None


def exit(token: Any, meta: dict[str, Any]) -> None:  # noqa: A001 - mirrors __exit__
    return None
