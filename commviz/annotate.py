"""``annotate_collective``: build a collective's metadata, record it, and attach it to the trace.

One call does three things, each only when it applies:
- records the metadata in this rank's recorder (when recording is on);
- opens a profiler range ``commviz::<op>`` whose args are the metadata (when a profiler runs),
  so eager traces carry the same keys graphed ones get;
- under CUDA graph capture, finds the graph nodes the collective added (``commviz.capture``).

The wrappers in ``commviz.distributed`` use the fast internal pair ``begin``/``finish``; users
wrap their own communication (a custom kernel, a library call) in ``annotate_collective``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Iterable, Sequence

import torch

from commviz import metadata as md
from commviz.capture import hooks as _hooks
from commviz.capture import region as _region
from commviz.record import recorder as _rec

_profiler_enabled = torch._C._autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
_time_ns = time.time_ns
_getframe = sys._getframe

# Keys that cannot go into a profiler range (non-scalar values).
_RANGE_SKIP = frozenset({md.GRAPH_NODES})
# Keyword names of annotate_collective's **extra that map onto commviz keys.
_EXTRA_KEYS = {
    "root": md.ROOT, "src": md.SRC, "dst": md.DST, "peer": md.PEER, "reduce_op": md.REDUCE_OP,
    "async_op": md.ASYNC, "in_split": md.IN_SPLIT, "out_split": md.OUT_SPLIT, "kind": md.KIND,
}


class _Nesting(threading.local):
    """Per-thread depth of ``unrecorded`` blocks: wrappers inside pass straight to torch."""

    depth = 0


NESTING = _Nesting()


class unrecorded:  # noqa: N801 - a context manager used like a function
    """Collectives issued inside are passed straight to torch: commviz's own traffic (gather,
    clock offsets) must not show up among the job's collectives, even under ``patch()``."""

    def __enter__(self) -> None:
        NESTING.depth += 1

    def __exit__(self, *exc: Any) -> None:
        NESTING.depth -= 1


_META, _RANGE, _REGION = md.R_META, md.R_RANGE, md.R_REGION


def begin(op: str, group: Any, tensor: torch.Tensor | None, in_nelems: int, out_nelems: int,
          kind: str = "collective", in_split: str = "[]", out_split: str = "[]",
          async_op: bool = False, extra: dict[str, Any] | None = None,
          depth: int = 2, want_meta: bool = False) -> list[Any] | None:
    """Start a collective: record it, open its profiler range and capture region if needed.

    ``depth`` is how many frames up the user's call site is (2: the caller of a wrapper).
    Returns the call's compact record (``md.R_*``), to hand to ``finish``; None when this rank
    is not in ``group`` (torch skips such a call, so there is nothing to record).
    """
    info = md.group_info(group)
    if not info.member:
        return None
    frame = _getframe(depth)
    if tensor is None:
        dtype, esize, device = "Byte", 0, "cpu"
    else:
        dtype, esize = md.dtype_info(tensor.dtype)
        device = "cuda" if tensor.is_cuda else tensor.device.type
    rec = [op, kind, info, in_nelems, out_nelems, dtype, esize, in_split, out_split, async_op,
           frame.f_code.co_filename, frame.f_lineno, info.my_rank, device,
           next(info.seq) if kind == "collective" else None, extra, None, None, None,
           None, None, None, None, None, None]
    profiling = _profiler_enabled()
    if device == "cuda" and _hooks.capture_possible():
        # a wrapper's synchronous call costs least (its nodes are worked out after capture);
        # work the stream does not wait for, user code and profiled calls are walked
        rec[_REGION] = _region.enter(rec, walk=async_op or want_meta or profiling)
    meta = None
    if profiling:
        meta = rec[_META] = md.expand(rec)
        rng = rec[_RANGE] = _RecordFunctionFast(
            "commviz::" + op, [],
            {k: v for k, v in meta.items() if k not in _RANGE_SKIP and v is not None})
        rng.__enter__()
    elif want_meta:
        meta = rec[_META] = md.expand(rec)
    recorder = _rec.RECORDER
    if meta is None:
        if recorder.enabled:
            recorder.append(rec)
        rec[md.R_T_BEGIN] = _time_ns()
    else:
        if recorder.enabled:
            recorder.append(meta)
        meta[md.T_BEGIN] = _time_ns()
    return rec


def finish(rec: list[Any], error: BaseException | None = None) -> None:
    """Close what ``begin`` opened; under capture this is where the region ends."""
    if rec[_REGION] is not None:
        _region.exit(rec[_REGION], rec)
    meta = rec[_META]
    if meta is None:
        rec[md.R_T_END] = _time_ns()
        if error is not None:
            rec[md.R_ERROR] = repr(error)
        return
    meta[md.T_END] = _time_ns()
    if error is not None:
        meta[md.ERROR] = repr(error)
    if rec[_RANGE] is not None:
        rec[_RANGE].__exit__(None, None, None)


def invoke(rec: list[Any] | None, fn: Any, *args: Any) -> Any:
    """Run the real torch.distributed call between ``begin`` and ``finish``."""
    if rec is None:
        return fn(*args)
    try:
        result = fn(*args)
    except BaseException as exc:
        finish(rec, exc)
        raise
    finish(rec)
    return result


def _nelems(tensors: torch.Tensor | Iterable[torch.Tensor] | None) -> tuple[int, torch.Tensor | None]:
    if tensors is None:
        return 0, None
    if isinstance(tensors, torch.Tensor):
        return tensors.numel(), tensors
    items: Sequence[torch.Tensor] = list(tensors)
    return sum(t.numel() for t in items), (items[0] if items else None)


class annotate_collective:  # noqa: N801 - used like a function, as torch.profiler.record_function is
    """Annotate a collective (or any communication) issued inside the ``with`` block.

    ``name`` is a torch.distributed function name ("all_reduce") or any label; ``input`` and
    ``output`` are tensors or lists of tensors; ``group`` is the process group (``None``: world).
    Keyword extras ``root``, ``src``, ``dst``, ``peer``, ``reduce_op``, ``async_op``,
    ``in_split``, ``out_split`` map onto commviz's keys; any other extra is kept as given.
    The ``with`` statement yields the metadata dict.
    """

    __slots__ = ("_args", "_call")

    def __init__(self, name: str, input: Any, output: Any, group: Any = None,
                 **extra: Any) -> None:
        self._args = (name, input, output, group, extra)
        self._call: list[Any] | None = None

    def __enter__(self) -> dict[str, Any]:
        name, inp, out, group, extra = self._args
        in_n, tensor = _nelems(inp)
        out_n, out_tensor = _nelems(out)
        mapped: dict[str, Any] = {}
        for key, value in extra.items():
            target = _EXTRA_KEYS.get(key, key)
            if target == md.REDUCE_OP and not isinstance(value, str):
                value = md.reduce_op_name(value)
            if target in (md.IN_SPLIT, md.OUT_SPLIT) and not isinstance(value, str):
                value = str(list(value))
            mapped[target] = value
        kind = mapped.pop(md.KIND, "p2p" if name in ("send", "recv", "isend", "irecv") else "collective")
        in_split = mapped.pop(md.IN_SPLIT, "[]")
        out_split = mapped.pop(md.OUT_SPLIT, "[]")
        async_op = bool(mapped.pop(md.ASYNC, False))
        self._call = begin(name, group, tensor if tensor is not None else out_tensor, in_n, out_n,
                           kind=kind, in_split=in_split, out_split=out_split, async_op=async_op,
                           extra=mapped, depth=2, want_meta=True)
        return self._call[_META] if self._call is not None else {}

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._call is not None:
            finish(self._call, exc)
        self._call = None
