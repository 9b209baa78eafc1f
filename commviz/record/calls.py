"""One collective call's record: opened before torch runs it, finished when torch returns.

The c10d boundary kernel (``commviz.record.boundary``, every collective whoever issues it)
records a plain collective itself (also a synchronous one under CUDA graph capture), once
``shape`` has described its call site; it calls ``begin``/``finish`` for the others (profiled,
annotated, asynchronous under capture, point-to-point), which
build their record here, as ``commviz.annotate_collective`` does for communication the user
issues outside c10d. ``open_record`` does, each only when it applies:
- appends the compact record (``commviz.metadata.R_*``) to this rank's recorder;
- opens a ``commviz::<op>`` profiler range whose args are the metadata, so eager traces carry
  the keys graphed ones get;
- under CUDA graph capture, starts the region that finds the call's graph nodes.

Sequence numbers follow the backend's own (Flight Recorder's ``collective_seq_id``): one per
collective on its group, two for gloo's ``monitored_barrier`` (it takes two tags), and the
number NCCL reports after the call where it has one (coalesced calls share theirs).
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
import sysconfig
import threading
import time
from types import CodeType, FrameType
from typing import Any, Callable

import torch
import typing_extensions
from torch.distributed import distributed_c10d as _c10d

from commviz import metadata as md
from commviz.record import capturing as _capture
from commviz.record import origin as _origin
from commviz.record import recorder as _rec
from commviz.record.ops import OPS

_profiler_enabled = torch._C._autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
_time_ns = time.time_ns
_getframe = sys._getframe

# Keys that cannot go into a profiler range (non-scalar values).
_RANGE_SKIP = frozenset({md.GRAPH_NODES})
_META, _RANGE, _REGION = md.R_META, md.R_RANGE, md.R_REGION


class Claim:
    """An ``annotate_collective`` block, until a c10d collective inside it runs: the block's
    record then stands for that call and takes its sequence number (one call, one record).
    A block with no c10d collective inside gets a number of its own kind (``commviz.user_seq``)
    and leaves the group's numbering, which is torch's, alone."""

    __slots__ = ("rec", "open")

    def __init__(self, rec: list[Any] | None) -> None:
        self.rec = rec
        self.open = rec is not None

    def take(self, info: md.GroupInfo, slots: int) -> None:
        seq = info.take_seq(slots)
        rec = self.rec
        rec[md.R_SEQ] = seq
        if rec[_META] is not None:
            rec[_META][md.SEQ] = seq
        self.open = False

    def close(self) -> None:
        """At the block's end: an unclaimed collective annotation numbers itself."""
        rec = self.rec
        if self.open and rec is not None and rec[md.R_KIND] == "collective":
            info = rec[md.R_INFO]
            rec[md.R_SEQ] = None
            meta = rec[_META]
            if meta is not None:
                meta.pop(md.SEQ, None)
                meta[md.USER_SEQ] = info.next_user_seq()


class _Scope(threading.local):
    """Per-thread stack of blocks whose c10d calls are not recorded on their own: commviz's
    own traffic (``unrecorded``: None) and ``annotate_collective`` blocks (a ``Claim``).
    Its depth is mirrored in the boundary kernel's thread-local (``DEPTH``), which then need
    not ask Python on every call."""

    def __init__(self) -> None:
        self.stack: list[Claim | None] = []

    def push(self, claim: Claim | None) -> None:
        self.stack.append(claim)
        DEPTH(len(self.stack))

    def pop(self) -> Claim | None:
        claim = self.stack.pop()
        DEPTH(len(self.stack))
        return claim


def _unmirrored(depth: int) -> None:
    """Until the boundary kernel is in, nothing mirrors a scope's depth."""


SCOPE = _Scope()
DEPTH: Callable[[int], None] = _unmirrored   # the boundary kernel's setter, once it is in


class unrecorded:  # noqa: N801 - a context manager used like a function
    """Collectives issued inside are not recorded (commviz's own gather and clock traffic).
    Their group's sequence numbers still advance, as torch's do."""

    def __enter__(self) -> None:
        SCOPE.push(None)

    def __exit__(self, *exc: Any) -> None:
        SCOPE.pop()


# -- the call site: the first frame outside torch and commviz ----------------------------------

def _own_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: torch, commviz, the code inductor generates,
    and the standard library's and typing_extensions' decorators and context managers that
    torch's functions come wrapped in (``@deprecated``, ``contextlib``)."""
    paths = sysconfig.get_paths()
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, md)) + (
        os.path.abspath(inductor) + os.sep, paths["stdlib"] + os.sep,
        os.path.abspath(typing_extensions.__file__))


OWN_DIRS = _own_dirs()
_skip_code: dict[CodeType, bool] = {}


def own_code(code: CodeType) -> bool:
    """Whether a frame of ``code`` is torch's or commviz's (cached per code object)."""
    skip = _skip_code.get(code)
    if skip is None:
        skip = _skip_code[code] = code.co_filename.startswith(OWN_DIRS)
    return skip


def callsite(depth: int = 2) -> tuple[str | None, int | None]:
    """File and line of the first frame outside torch and commviz (None: no such frame, as
    in DDP's reducer on an autograd thread)."""
    frame = _getframe(depth)
    while frame is not None:
        code = frame.f_code
        if not own_code(code):
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None, None


# -- the origin: the unit a call serves (commviz.record.origin), per call shape ----------------

# per shape: its origin keys, and whether each call adds its micro-batch (Refresh.MICROBATCH)
_origins: dict[tuple[Any, ...], tuple[dict[str, Any], bool]] = {}
_merged: dict[tuple[Any, ...], dict[str, Any]] = {}


def with_origin(extra: dict[str, Any] | None, op: str, kind: str, numel: int, nbytes: int,
                site: tuple[str | None, int | None], origin: int | None, depth: int,
                count: bool = True) -> tuple[dict[str, Any], bool]:
    """``extra`` with the call's origin keys, worked out once per (origin ranges, call site,
    op, size, p2p peer), and whether they hold for this call only (DDP's buckets, numbered in the
    reducer's order). A collective's merged extra is one shared dict per content, so the
    journal and the shapes see a repeated call as such. ``depth``: frames between the
    caller of the c10d op and this function's caller; ``count``: False where the call is
    only being looked at (``shape``: ``begin`` records it)."""
    if origin is None:
        origin = _origin.NATIVE.current_origin() if _origin.NATIVE is not None else 0
    # a p2p call's peer is part of its shape: one pipeline call site sends forward to the
    # next stage and backward to the previous one
    key = (origin, site, op, kind, numel, extra.get(md.PEER) if extra and kind == "p2p" else None)
    cached = _origins.get(key)
    if cached is None or cached[1]:
        try:
            frame: FrameType | None = _getframe(depth + 1)
        except ValueError:                  # no Python frame: an autograd device thread
            frame = None
    if cached is None:
        keys, refresh = _origin.resolve(origin, op, kind, numel, nbytes, frame, own_code,
                                        count)
        if refresh is _origin.Refresh.ALL:
            return dict(extra or {}, **keys), True
        cached = _origins[key] = (keys, refresh is _origin.Refresh.MICROBATCH)
    keys, batched = cached
    if batched:
        keys = _origin.MICRO_BATCHES.keys(keys, frame)
    if kind != "collective":
        return dict(extra or {}, **keys), False     # per-call extras (peers, numbers)
    content = (id(keys), *(extra.items() if extra else ()))
    merged = _merged.get(content)
    if merged is None:
        merged = _merged[content] = dict(extra or {}, **keys)
    return merged, False


# -- open and finish ---------------------------------------------------------------------------

def open_record(op: str, kind: str, info: md.GroupInfo, in_n: int, out_n: int, dtype: str,
                esize: int, device: str, in_split: str, out_split: str, async_op: bool,
                extra: dict[str, Any] | None, site: tuple[str | None, int | None],
                seq: int | None, want_meta: bool = False, origin: int | None = None
                ) -> list[Any]:
    """Record a call that is about to run; returns its compact record for ``finish_record``.
    ``origin``: the boundary kernel's origin id (None: this thread's, read now)."""
    extra = with_origin(extra, op, kind, in_n, in_n * esize, site, origin, 2)[0]
    rec = [op, kind, info, in_n, out_n, dtype, esize, in_split, out_split, async_op,
           site[0], site[1], info.my_rank, device, seq, extra, None, None, None,
           None, None, None, None, None, None]
    profiling = _profiler_enabled()
    if device == "cuda" and _capture.capture_possible():
        # a synchronous call costs least (its nodes are worked out after capture); work the
        # stream does not wait for, user code and profiled calls are walked
        rec[_REGION] = _capture.enter(rec, walk=async_op or want_meta or profiling)
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


def finish_record(rec: list[Any], error: str | None = None) -> None:
    """Close what ``open_record`` opened; under capture this is where the region ends."""
    if rec[_REGION] is not None:
        _capture.exit(rec[_REGION], rec)
    meta = rec[_META]
    if meta is None:
        rec[md.R_T_END] = _time_ns()
        if error is not None:
            rec[md.R_ERROR] = error
        return
    meta[md.T_END] = _time_ns()
    if error is not None:
        meta[md.ERROR] = error
    if rec[_RANGE] is not None:
        rec[_RANGE].__exit__(None, None, None)


# -- the boundary kernel's callbacks -----------------------------------------------------------

_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_reductions: dict[int, dict[str, str]] = {}


def _reduction(code: int) -> dict[str, str]:
    """A reduction's record extra: one shared dict per op (records only ever read it)."""
    extra = _reductions.get(code)
    if extra is None:
        name = _REDUCE_OPS[code] if 0 <= code < len(_REDUCE_OPS) else "unknown"
        extra = _reductions[code] = {md.REDUCE_OP: name}
    return extra


_SPECS = tuple(OPS.values())
_BY_NAME = md._BY_NAME                        # group name -> GroupInfo, filled by group_by_name
_SIDE = md.SIDE_GROUP_DESC


def _describe(spec: Any, info: md.GroupInfo, in_n: int, out_n: int, dtype: str, esize: int,
              root: int, reduce_op: int) -> tuple[int, int, str, int, dict[str, Any] | None]:
    """A collective's sizes, dtype and extras as recorded (a barrier sends nothing)."""
    extra: dict[str, Any] | None
    if reduce_op >= 0:
        extra = _reduction(reduce_op)
        if root >= 0:
            extra = dict(extra, **{md.ROOT: info.global_rank(root)})
    elif root >= 0:
        extra = {md.ROOT: info.global_rank(root)}
    else:
        extra = None
    if spec.barrier:
        return 0, 0, "Byte", 0, extra
    return in_n, out_n, dtype, esize, extra


def _slots(spec: Any, info: md.GroupInfo, cuda: bool) -> int:
    """Sequence numbers a call takes: gloo runs a list reduce_scatter as one call per rank
    (NCCL reports its own number after the call)."""
    return info.size if spec.slots_per_rank and not cuda else spec.slots


def shape(code: int, pg_name: str, in_n: int, out_n: int, dtype: str, esize: int, cuda: bool,
          root: int, reduce_op: int, async_op: bool, file: str | None, line: int | None,
          origin: int = 0) -> tuple[int, md.GroupInfo, int] | bool | None:
    """The boundary kernel asks this once per call shape (what a call site repeats) when no
    block, profiler or asynchronous captured work needs Python: (the shape's index, its group, the sequence
    numbers a call takes) to record such calls natively, False never to record them (a group
    this rank is not in, commviz's own group), None to ask ``begin`` every time
    (point-to-point calls: numbered per peer pair)."""
    spec = _SPECS[code]
    info = _BY_NAME.get(pg_name) or md.group_by_name(pg_name)
    if not info.member or info.desc == _SIDE:
        return False
    if spec.kind != "collective":
        return None
    in_n, out_n, dtype, esize, extra = _describe(spec, info, in_n, out_n, dtype, esize, root,
                                                 reduce_op)
    extra, per_call = with_origin(extra, spec.op, spec.kind, in_n, in_n * esize, (file, line),
                                  origin, 1, count=False)
    if per_call:
        return None
    fields = [spec.op, spec.kind, info, in_n, out_n, dtype, esize, "[]", "[]", async_op, file,
              line, info.my_rank, "cuda" if cuda else "cpu"]
    return _rec.RECORDER.add_shape(fields, extra), info, _slots(spec, info, cuda)


def failed(ordinal: int, error: str) -> None:
    """A natively recorded call raised ``error``."""
    _rec.RECORDER.add_error(ordinal, error)


def begin(code: int, pg_name: str, in_n: int, out_n: int, dtype: str, esize: int, cuda: bool,
          root: int, reduce_op: int, async_op: bool, in_split: list[int] | None,
          out_split: list[int] | None, file: str | None, line: int | None, origin: int = 0
          ) -> list[Any] | None:
    """The boundary kernel calls this before torch's kernel runs, with the call site it found
    (``callsite``'s rule, walked in C++), for calls ``shape`` does not cover; None: nothing
    to record."""
    spec = _SPECS[code]
    info = _BY_NAME.get(pg_name) or md.group_by_name(pg_name)
    slots = _slots(spec, info, cuda)
    collective = spec.kind == "collective"
    scope = SCOPE.stack
    if scope:
        owner = scope[-1]
        if collective:
            if owner is not None and owner.open:
                owner.take(info, slots)       # the annotation stands for this call
            else:
                info.take_seq(slots)
        return None
    if not info.member or info.desc == _SIDE:
        return None
    op = spec.op
    if collective:
        seq = info.take_seq(slots)
        in_n, out_n, dtype, esize, extra = _describe(spec, info, in_n, out_n, dtype, esize,
                                                     root, reduce_op)
    else:
        seq = None
        async_op = True      # c10d's send/recv only enqueue (torch's send() waits afterwards)
        me = info.my_rank
        peer = None if spec.any_source else info.global_rank(root)
        src, dst = (me, peer) if op == "send" else (peer, me)
        extra = {md.PEER: peer, md.SRC: src, md.DST: dst,
                 md.FR_P2P_SEQ: info.take_fr_p2p_seq(_coalescing_block(info))}
        if peer is not None:
            extra[md.P2P_SEQ] = info.next_p2p_seq(src, dst)
    in_s = "[]" if in_split is None else str(in_split)
    out_s = "[]" if out_split is None else str(out_split)
    return open_record(op, spec.kind, info, in_n, out_n, dtype, esize, "cuda" if cuda else "cpu",
                       in_s, out_s, async_op, extra, (file, line), seq, origin=origin)


def _coalescing_block(info: md.GroupInfo) -> list[Any] | None:
    """The op list of the group's open ``_coalescing_manager`` block (``batch_isend_irecv`` on
    a backend that coalesces), None outside one: torch's own state, read, never changed."""
    return _c10d._world.pg_coalesce_state.get(info.pg) if info.pg is not None else None


def finish(rec: list[Any], backend_seq: int, error: str | None) -> None:
    """The boundary kernel calls this when torch's kernel returned (or raised ``error``)."""
    if backend_seq > 0 and rec[md.R_SEQ] is not None and backend_seq != rec[md.R_SEQ]:
        info = rec[md.R_INFO]
        info.last_seq = backend_seq
        rec[md.R_SEQ] = backend_seq
        if rec[_META] is not None:
            rec[_META][md.SEQ] = backend_seq
    finish_record(rec, error)
