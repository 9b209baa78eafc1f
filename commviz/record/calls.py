"""One collective call's record: opened before torch runs it, finished when torch returns.

The c10d boundary kernel (``commviz.record.boundary``, every collective whoever issues it)
records a call itself (collective or point-to-point, profiled or not, also a synchronous one
under CUDA graph capture), once ``shape`` has described its call site; a collective inside an
``annotate_collective`` block gives its number to the block (``Claim``). It calls
``begin``/``finish`` for the others (split sizes, origins that change per call, asynchronous or
point-to-point work under capture), which build their record here, as
``commviz.annotate_collective`` does for communication the user issues outside c10d.
``open_record`` does, each only when it applies:
- appends the compact record (``commviz.metadata.R_*``) to this rank's recorder;
- for an annotation while a profiler runs, opens a ``commviz::<name>`` profiler range with no
  args: the match step pairs it with its record after the job by time (its record's
  ``[t_begin, t_end]`` lies inside it), as it pairs a c10d call's own ``c10d::<op>`` event, and
  gives it the record's metadata (``commviz annotate``, the merge). Each arg a range carried
  would cost the job about a µs, as much again with a collective inside;
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
from typing import Any, Callable, NamedTuple

import torch
import typing_extensions
from torch.distributed import distributed_c10d as _c10d

from commviz import metadata as md
from commviz.record import capturing as _capture
from commviz.record import origins as _origins
from commviz.record import process_groups as _groups
from commviz.record import recorder as _rec
from commviz.record.ops import OPS

_profiler_enabled = torch._C._autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
_time_ns = time.time_ns
_getframe = sys._getframe

_META, _RANGE, _REGION = md.R_META, md.R_RANGE, md.R_REGION
_FILE, _LINE, _SEQ, _EXTRA, _GRAPH = md.R_FILE, md.R_LINE, md.R_SEQ, md.R_EXTRA, md.R_GRAPH


class Claim:
    """An ``annotate_collective`` block, until a c10d collective inside it runs: the block's
    record then stands for that call and takes its sequence number (one call, one record).
    A block with no c10d collective inside gets a number of its own kind (``commviz.user_seq``)
    and leaves the group's numbering, which is torch's, alone."""

    __slots__ = ("rec", "open")

    def __init__(self, rec: list[Any] | None) -> None:
        self.rec = rec
        self.open = rec is not None

    def claim(self, seq: int) -> None:
        """A c10d collective inside the block took its group's number ``seq`` (the boundary
        kernel calls this): the first one is the block's; later ones are nobody's."""
        if self.open:
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
    Its depth and innermost block are mirrored in the boundary kernel's thread-locals
    (``MIRROR``), which then handles a call inside without asking Python what is open.
    ``push_scope`` and ``pop_scope`` change it: functions, as a method looked up on a
    thread-local costs as much again as the change."""

    def __init__(self) -> None:
        self.stack: list[Claim | None] = []


def push_scope(claim: Claim | None) -> None:
    stack = SCOPE.stack
    stack.append(claim)
    MIRROR(len(stack), claim)


def pop_scope() -> None:
    stack = SCOPE.stack
    stack.pop()
    MIRROR(len(stack), stack[-1] if stack else None)


def _unmirrored(depth: int, top: Claim | None) -> None:
    """Until the boundary kernel is in, nothing mirrors the scope."""


SCOPE = _Scope()
MIRROR: Callable[[int, Claim | None], None] = _unmirrored   # the kernel's setter, once it is in


class unrecorded:  # noqa: N801 - a context manager used like a function
    """Collectives issued inside are not recorded (commviz's own gather and clock traffic).
    Their group's sequence numbers still advance, as torch's do."""

    def __enter__(self) -> None:
        push_scope(None)

    def __exit__(self, *exc: Any) -> None:
        pop_scope()


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
# a torch function or dispatch mode's hooks (a tensor subclass's too): never a call site, the
# call was made where the code they intercepted made it (boundary.cpp's ``mode_hook`` too)
MODE_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})
_skip_code: dict[CodeType, bool] = {}


def own_code(code: CodeType) -> bool:
    """Whether a frame of ``code`` is torch's or commviz's, or a mode's hook (cached per code
    object)."""
    skip = _skip_code.get(code)
    if skip is None:
        skip = _skip_code[code] = (code.co_filename.startswith(OWN_DIRS)
                                   or code.co_name in MODE_HOOKS)
    return skip


def callsite(depth: int = 2) -> tuple[str | None, int | None]:
    """File and line of the first frame outside torch and commviz (None: no such frame, as
    in DDP's reducer on an autograd thread)."""
    frame = _getframe(depth)
    while frame is not None:
        code = frame.f_code
        skip = _skip_code.get(code)                 # own_code's cache, read here: one call less
        if not (own_code(code) if skip is None else skip):
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None, None


# -- the origin: the unit a call serves (commviz.record.origins), per call shape ---------------

_STATE = _rec.RECORDER.origins
# per shape: its origin keys, and whether each call adds its micro-batch (Refresh.MICROBATCH)
_shapes = _STATE.shapes
_merged = _STATE.merged
_PIPELINING = _origins.pipelining.RESOLVER.name
Refresh = _origins.Refresh
_NOTHING = Refresh.NOTHING        # read on every call: an enum member's lookup costs a call
_PIPELINE = md.OriginKind.PIPELINE


def with_origin(extra: dict[str, Any] | None, op: str, kind: str, numel: int, nbytes: int,
                site: tuple[str | None, int | None], origin: int | None, depth: int,
                count: bool = True) -> tuple[dict[str, Any], Refresh]:
    """``extra`` with the call's origin keys, worked out once per (origin ranges, call site,
    op, size, p2p peer), and what of them a later call of its shape must work out again: ALL
    where they hold for this call only (DDP's buckets, numbered in the reducer's order),
    MICROBATCH where this call's micro-batch is in them (a 1F1B schedule's p2p calls). A
    collective's merged extra is one shared dict per content, so the journal and the shapes see
    a repeated call as such. ``depth``: frames between the caller of the c10d op and this
    function's caller; ``count``: False where the call is only being looked at (``shape``:
    ``begin`` records it)."""
    if origin is None:
        native = _STATE.native
        origin = native.current_origin() if native is not None else 0
    # a p2p call's peer is part of its shape: one pipeline call site sends forward to the
    # next stage and backward to the previous one
    key = (origin, site, op, kind, numel, extra.get(md.PEER) if extra and kind == "p2p" else None)
    cached = _shapes.get(key)
    if cached is None or cached[1]:
        try:
            frame: FrameType | None = _getframe(depth + 1)
        except ValueError:                  # no Python frame: an autograd device thread
            frame = None
    if cached is None:
        keys, refresh = _origins.resolve(_STATE, origin, op, kind, numel, nbytes, frame,
                                         own_code, count)
        if refresh is Refresh.ALL:
            return dict(extra or {}, **keys), Refresh.ALL
        cached = _shapes[key] = (keys, refresh is Refresh.MICROBATCH)
    keys, batched = cached
    if batched:
        keys = _STATE.caches[_PIPELINING].keys(keys, frame)
    if kind != "collective":
        return dict(extra or {}, **keys), Refresh.MICROBATCH if batched else Refresh.NOTHING
    content = (id(keys), *extra.items()) if extra else (id(keys),)
    merged = _merged.get(content)
    if merged is None:
        merged = _merged[content] = dict(extra or {}, **keys)
    return merged, _NOTHING


# -- open and finish ---------------------------------------------------------------------------

class _Expanded(NamedTuple):
    """An annotation call site's last shape, worked out once: the origin keys merged into its
    extra and its metadata at its start, expanded (``with_origin``, ``md.expand`` and the
    range's filter cost more than the rest of a block). A block of the same shape copies the
    metadata and sets its number."""

    fields: list[Any]            # the compact record's fields before R_SEQ
    given: dict[str, Any] | None  # the extra the block was given
    origin: int                  # the thread's origin ranges id
    steady: bool                 # the merged extra holds for every call of the shape
    extra: dict[str, Any] | None  # merged: ``with_origin``'s
    numbered: bool               # whether the record had a sequence number (then a key)
    meta: dict[str, Any]
    name: str                    # the profiler range's


_expanded: dict[tuple[str | None, int | None], _Expanded] = {}
_EXPANDED_LIMIT = 4096           # shapes remembered before starting afresh


def _expand(rec: list[Any], given: dict[str, Any] | None, origin: int, steady: bool
            ) -> _Expanded:
    """Expand an uncaptured annotation's shape and remember it for its call site."""
    meta = md.expand(rec)
    got = _Expanded(rec[:_SEQ], given, origin, steady, rec[_EXTRA], rec[_SEQ] is not None, meta,
                    "commviz::" + rec[md.R_OP])
    if len(_expanded) >= _EXPANDED_LIMIT:
        _expanded.clear()
    _expanded[rec[_FILE], rec[_LINE]] = got
    return got


def _repeated(rec: list[Any], site: tuple[str | None, int | None],
              given: dict[str, Any] | None, origin: int) -> _Expanded | None:
    """The site's last shape where this annotation repeats it, its origin keys included."""
    shape = _expanded.get(site)
    if (shape is None or not shape.steady or shape.origin != origin
            or shape.numbered is (rec[_SEQ] is None) or shape.fields != rec[:_SEQ]
            or (shape.given is not given and shape.given != given)):
        return None
    return shape


def _annotation(rec: list[Any], site: tuple[str | None, int | None], shape: _Expanded | None,
                given: dict[str, Any] | None, origin: int, steady: bool) -> dict[str, Any]:
    """An annotation's metadata dict, and while a profiler runs its range, opened: a copy of
    its shape's (``shape`` None: the site's last one where its record fields and merged extra
    are this one's, else expanded now); a captured one is expanded on its own (its graph and
    ordinal are its own)."""
    seq = rec[_SEQ]
    if rec[_GRAPH] is None:
        if shape is None:
            last = _expanded.get(site)
            if (last is None or last.numbered is (seq is None) or last.fields != rec[:_SEQ]
                    or (last.extra is not rec[_EXTRA] and last.extra != rec[_EXTRA])):
                shape = _expand(rec, given, origin, steady)
            else:                  # the same metadata, worked out under other origin ranges
                shape = _expanded[site] = last._replace(given=given, origin=origin,
                                                        steady=steady)
        meta = shape.meta.copy()
    else:
        shape, meta = None, md.expand(rec)
    if seq is not None:
        meta[md.SEQ] = seq
    rec[_META] = meta
    if _profiler_enabled():
        _open_range(rec, "commviz::" + rec[md.R_OP] if shape is None else shape.name)
    return meta


def _open_range(rec: list[Any], name: str) -> None:
    rng = rec[_RANGE] = _RecordFunctionFast(name)
    rng.__enter__()


def _begin(rec: list[Any], meta: dict[str, Any] | None) -> None:
    """Opening's last steps: the recorder's entry (an annotation's is its metadata dict,
    journaled as the compact record), then the begin time."""
    recorder = _rec.RECORDER
    if recorder.enabled:           # journaled as the compact record: its shape, once per site
        recorder.append(rec if meta is None else meta, journaled=rec)
    now = rec[md.R_T_BEGIN] = _time_ns()
    if meta is not None:
        meta[md.T_BEGIN] = now


# An annotation whose shape is known by the block's own terms (``annotate_collective``'s key:
# call site, origin ranges, name, group's id, sizes, dtype, device, numbered or not; no extras) ->
# its steady shape: a block repeating it opens its record without building and comparing the
# shape's fields (``open_repeated``), a third of the block's own work
_by_key: dict[tuple[Any, ...], _Expanded] = {}
_TAIL = (None,) * (md.R_REGION - _EXTRA)        # a record's fields after its extra


def open_repeated(key: tuple[Any, ...], info: md.GroupInfo, seq: int | None
                  ) -> list[Any] | None:
    """``open_record`` for an uncaptured annotation of a shape ``remember`` kept under ``key``
    (None: none kept, or kept for another group that had the id ``info`` has now). The caller
    leaves capture to ``open_record``."""
    shape = _by_key.get(key)
    if shape is None or shape.fields[md.R_INFO] is not info:
        return None
    rec = [*shape.fields, seq, shape.extra, *_TAIL]
    meta = rec[_META] = shape.meta.copy()
    if seq is not None:
        meta[md.SEQ] = seq
    if _profiler_enabled():
        _open_range(rec, shape.name)
    _begin(rec, meta)
    return rec


def remember(key: tuple[Any, ...], rec: list[Any]) -> None:
    """After ``open_record`` opened an annotation: its shape under ``key``, where it is steady
    (its merged extra holds for every call with its key)."""
    shape = _expanded.get((rec[_FILE], rec[_LINE]))
    if shape is not None and shape.steady and shape.fields == rec[:_SEQ] and \
            shape.extra is rec[_EXTRA]:
        if len(_by_key) >= _EXPANDED_LIMIT:
            _by_key.clear()
        _by_key[key] = shape


def open_record(op: str, kind: str, info: md.GroupInfo, in_n: int, out_n: int, dtype: str,
                esize: int, device: str, in_split: str, out_split: str, async_op: bool,
                extra: dict[str, Any] | None, site: tuple[str | None, int | None],
                seq: int | None, want_meta: bool = False, origin: int | None = None
                ) -> list[Any]:
    """Record a call that is about to run; returns its compact record for ``finish_record``.
    ``origin``: the boundary kernel's origin id (None: this thread's, read now);
    ``want_meta``: an annotation, whose caller gets the metadata dict (and, while a profiler
    runs, a range of its own: it has no c10d op event)."""
    rec = [op, kind, info, in_n, out_n, dtype, esize, in_split, out_split, async_op,
           site[0], site[1], info.my_rank, device, seq, None, None, None, None,
           None, None, None, None, None, None]
    shape = None
    if want_meta:                  # an annotation repeating its site's shape takes its extra
        if origin is None:
            native = _STATE.native
            origin = native.current_origin() if native is not None else 0
        shape = _repeated(rec, site, extra, origin)
    if shape is None:
        given = extra
        extra, refresh = with_origin(given, op, kind, in_n, in_n * esize, site, origin, 2)
        # a collective's merged extra is shared per content; a pipeline's micro-batch is not
        # in with_origin's answer for a collective, so its shapes are not kept
        steady = want_meta and refresh is _NOTHING and kind == "collective" and not (
            extra and extra.get(md.ORIGIN_KIND) == _PIPELINE)
    else:
        given, extra, steady = extra, shape.extra, True
    rec[_EXTRA] = extra
    if device == "cuda" and _capture.capture_possible():
        # a synchronous call costs least (its nodes are worked out after capture); work the
        # stream does not wait for and user code are walked
        rec[_REGION] = _capture.enter(rec, walk=async_op or want_meta)
    _begin(rec, _annotation(rec, site, shape, given, origin, steady) if want_meta else None)
    return rec


def finish_record(rec: list[Any], error: str | None = None) -> None:
    """Close what ``open_record`` opened; under capture this is where the region ends."""
    if rec[_REGION] is not None:
        _capture.exit(rec[_REGION], rec)
    now = rec[md.R_T_END] = _time_ns()
    if error is not None:
        rec[md.R_ERROR] = error
    meta = rec[_META]
    if meta is None:
        return
    meta[md.T_END] = now
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
_BY_NAME = _groups._BY_NAME                   # group name -> GroupInfo, filled by group_by_name
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


def _peers(spec: Any, info: md.GroupInfo, root: int) -> tuple[dict[str, Any], int | None,
                                                              int | None]:
    """A p2p call's peer keys and its global (source, destination); a receive from any source
    knows its source only when it completes."""
    me = info.my_rank
    peer = None if spec.any_source else info.global_rank(root)
    src, dst = (me, peer) if spec.op == "send" else (peer, me)
    return {md.PEER: peer, md.SRC: src, md.DST: dst}, src, dst


def _with_thread(extra: dict[str, Any] | None, tid: int) -> dict[str, Any]:
    return {**extra, md.TID: tid} if extra else {md.TID: tid}


PER_MICROBATCH = "per micro-batch"   # ``shape``'s answer: ask ``microbatch``, then again


def shape(code: int, pg_name: str, in_n: int, out_n: int, dtype: str, esize: int, cuda: bool,
          root: int, reduce_op: int, async_op: bool, file: str | None, line: int | None,
          origin: int, tid: int, microbatch: int
          ) -> tuple[int, md.GroupInfo, int, int | None, int | None] | bool | str | None:
    """The boundary kernel asks this once per call shape (what a call site repeats, on one
    thread) when no block or asynchronous captured work needs Python: (the shape's index, its
    group, the sequence numbers a call takes, and a p2p call's global source and destination,
    else None twice) to record such calls natively; False never to record them (a group this
    rank is not in, commviz's own group); ``PER_MICROBATCH`` to ask again with the call's
    micro-batch (``microbatch`` -1: not asked yet); None to ask ``begin`` every time (origins
    that change per call)."""
    spec = _SPECS[code]
    info = _BY_NAME.get(pg_name) or _groups.group_by_name(pg_name)
    if not info.member or info.desc == _SIDE:
        return False
    src = dst = None
    if spec.kind == "collective":
        in_n, out_n, dtype, esize, extra = _describe(spec, info, in_n, out_n, dtype, esize, root,
                                                     reduce_op)
    else:
        async_op = True      # c10d's send/recv only enqueue (torch's send() waits afterwards)
        extra, src, dst = _peers(spec, info, root)
    extra, refresh = with_origin(_with_thread(extra, tid), spec.op, spec.kind, in_n,
                                 in_n * esize, (file, line), origin, 1, count=False)
    if refresh is Refresh.ALL:
        return None
    if refresh is Refresh.MICROBATCH and microbatch == -1:
        return PER_MICROBATCH
    fields = [spec.op, spec.kind, info, in_n, out_n, dtype, esize, "[]", "[]", async_op, file,
              line, info.my_rank, "cuda" if cuda else "cpu"]
    return _rec.RECORDER.add_shape(fields, extra), info, _slots(spec, info, cuda), src, dst


def microbatch(code: int) -> int | None:
    """The micro-batch of the 1F1B p2p call being made (``pipelining.MicroBatches``), if
    any."""
    try:
        frame: FrameType | None = _getframe(1)
    except ValueError:                      # no Python frame: an autograd device thread
        return None
    return _STATE.caches[_PIPELINING].of(frame, _SPECS[code].op == "send")


def scoped(code: int, pg_name: str, cuda: bool) -> tuple[md.GroupInfo, int] | None:
    """What a c10d call inside a ``SCOPE`` block takes: a collective its group's sequence
    numbers (the kernel asks this once per group and op); a p2p call nothing."""
    spec = _SPECS[code]
    if spec.kind != "collective":
        return None
    info = _BY_NAME.get(pg_name) or _groups.group_by_name(pg_name)
    return info, _slots(spec, info, cuda)


def failed(ordinal: int, error: str) -> None:
    """A natively recorded call raised ``error``."""
    _rec.RECORDER.add_error(ordinal, error)


def begin(code: int, pg_name: str, in_n: int, out_n: int, dtype: str, esize: int, cuda: bool,
          root: int, reduce_op: int, async_op: bool, in_split: list[int] | None,
          out_split: list[int] | None, file: str | None, line: int | None, origin: int,
          tid: int) -> list[Any] | None:
    """The boundary kernel calls this before torch's kernel runs, with the call site it found
    (``callsite``'s rule, walked in C++) and the calling thread, for calls ``shape`` does not
    cover (outside any ``SCOPE`` block); None: nothing to record."""
    spec = _SPECS[code]
    info = _BY_NAME.get(pg_name) or _groups.group_by_name(pg_name)
    if not info.member or info.desc == _SIDE:
        return None
    op = spec.op
    if spec.kind == "collective":
        seq = info.take_seq(_slots(spec, info, cuda))
        in_n, out_n, dtype, esize, extra = _describe(spec, info, in_n, out_n, dtype, esize,
                                                     root, reduce_op)
    else:
        seq = None
        async_op = True      # c10d's send/recv only enqueue (torch's send() waits afterwards)
        extra, src, dst = _peers(spec, info, root)
        fr, pair = _STATE.native.take_p2p(info.name, -1 if src is None else src,
                                           -1 if dst is None else dst, _coalescing_block(info))
        extra[md.FR_P2P_SEQ] = fr
        if pair >= 0:
            extra[md.P2P_SEQ] = pair
    in_s = "[]" if in_split is None else str(in_split)
    out_s = "[]" if out_split is None else str(out_split)
    return open_record(op, spec.kind, info, in_n, out_n, dtype, esize, "cuda" if cuda else "cpu",
                       in_s, out_s, async_op, _with_thread(extra, tid), (file, line), seq,
                       origin=origin)


def _coalescing_block(info: md.GroupInfo) -> list[Any] | None:
    """The op list of the group's open ``_coalescing_manager`` block (``batch_isend_irecv`` on
    a backend that coalesces), None outside one: torch's own state, read, never changed."""
    return COALESCING.get(info.pg) if info.pg is not None else None


COALESCING = _c10d._world.pg_coalesce_state    # torch's, the same dict for the process's life


def finish(rec: list[Any], backend_seq: int, error: str | None) -> None:
    """The boundary kernel calls this when torch's kernel returned (or raised ``error``)."""
    if backend_seq > 0 and rec[md.R_SEQ] is not None and backend_seq != rec[md.R_SEQ]:
        info = rec[md.R_INFO]
        info.last_seq = backend_seq
        rec[md.R_SEQ] = backend_seq
        if rec[_META] is not None:
            rec[_META][md.SEQ] = backend_seq
    finish_record(rec, error)
