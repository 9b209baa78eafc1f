"""``commviz.mark(name, stream=None)``: label the compute kernels a block launches.

Under CUDA graph capture the block's kernel nodes are found by the same frontier walk as
collectives and listed in the graph record, so the matcher can label them in every replay
(``commviz.mark``: the mark path, ``"outer/inner"`` for nested marks). ``stream`` is an optional
semantic lane (an int or a name) the writer may show the marked kernels on; no CUDA stream is
switched. Outside capture, while a profiler runs, the block becomes a ``commviz::mark::<name>``
range, and kernels launched inside it carry the label too.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from commviz import metadata as md
from commviz.capture import graphs, hooks
from commviz.record import recorder as _rec

MARK = md.MARK
MARK_LANE = md.MARK_LANE
RANGE_PREFIX = md.MARK_RANGE_PREFIX

_profiler_enabled = torch._C._autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class mark:  # noqa: N801 - used like torch.profiler.record_function
    """Label the kernels launched inside the ``with`` block as ``name``."""

    __slots__ = ("name", "stream", "_region", "_range", "_t0")

    def __init__(self, name: str, stream: int | str | None = None) -> None:
        self.name = str(name)
        self.stream = stream
        self._region: graphs.Region | None = None
        self._range: Any = None
        self._t0 = 0

    def __enter__(self) -> "mark":
        if _capturing():
            try:
                hooks.install()
                self._region = graphs.open_region()
                self._t0 = time.time_ns()
            except Exception as exc:
                graphs.warn_once("could not snapshot the capture frontier for a mark", exc)
        elif _profiler_enabled():
            args = {MARK_LANE: self.stream} if self.stream is not None else {}
            self._range = _RecordFunctionFast(RANGE_PREFIX + self.name, [], args)
            self._range.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        region, self._region = self._region, None
        if region is None:
            return
        try:
            found = graphs.label_mark(region, self.name, self.stream)
            entry = {"graph": region.state.gid, "name": self.name, "lane": self.stream,
                     "nodes": [], "kernels": len(found),        # node ids: when capture ends
                     "t_begin_ns": self._t0, "t_end_ns": time.time_ns()}
            _rec.RECORDER.marks.append(entry)
            region.state.claim(entry, found)
        except Exception as err:
            graphs.warn_once("could not walk the nodes of a mark", err)
