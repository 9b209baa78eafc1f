"""Eager NCCL kernels <- commviz's record: keep the profiler's metadata, add commviz's keys.

A kernel belongs to the recorded call whose event (the profiler's ``c10d::<op>`` event, or an
annotation's ``commviz::<op>`` range) was open on the launching thread when its CPU launch ran
(runtime/driver event with the kernel's ``correlation``); failing a launch event, the
``record_param_comms`` op it is linked to (``External id``) stands in. A
kernel outside every range is joined to the one recorded call whose ``[t_begin, t_end]`` holds
its launch, if exactly one of the right kind does. Each join is checked against what the
kernel's name says (collective type, dtype, reduction); where the profiler wrote an eager key
and the record says otherwise, the profiler's value stays and the disagreement is reported.
"""

from __future__ import annotations

from typing import Any

from commviz import metadata as md
from commviz.match.coalesced import with_ops
from commviz.match.derive import has_metadata
from commviz.match.index import Intervals, NcclSpan, Span, TraceIndex
from commviz.match.model import CommEvent, Source, instance_key
from commviz.match.ranges import TOLERANCE_NS, Pairing
from commviz.match.result import Conflict, RankMatch, Unmatched
from commviz.kernels import incompatibility



def _norm(value: Any) -> str:
    return str(value).replace(" ", "")


def _truncated(value: Any) -> bool:
    """The profiler writes "[0, 1, ..., 63]" for a group of more than 30 ranks."""
    return "..." in str(value)


def agrees(profiler: Any, record: Any) -> bool:
    """Whether an eager key's profiler value and record value say the same."""
    p, r = _norm(profiler), _norm(record)
    if _truncated(p):
        head, _, tail = p.partition("...")
        return r.startswith(head) and r.endswith(tail)
    return p == r


def _owning_range(index: TraceIndex, kernel: Span, paired: dict[int, int]) -> Span | None:
    """The innermost recorded call around this kernel's launch (or its record_param_comms op):
    a c10d call inside an ``annotate_collective`` block is the block's, whose range is outside
    the call's own (unpaired) c10d op event."""
    where = index.launch_of(kernel.index)
    if where is None:
        where = index.param_comms.get(index.args(kernel.index).get("External id"))
    if where is None:
        return None
    return next((span for span in index.enclosing_ranges(where.thread, where.start)
                 if span.index in paired), None)


def _by_call_time(index: TraceIndex, k: NcclSpan, collectives: list[dict[str, Any]],
                  calls: Intervals, free: set[int]) -> int | None:
    """The one unmatched recorded call whose time holds this kernel's launch, if exactly one."""
    launch = index.launch_of(k.span.index)
    if launch is None:
        return None
    args = index.args(k.span.index)
    found = []
    for pos in calls.holding(launch.start, TOLERANCE_NS):
        meta = collectives[pos]
        if pos not in free or incompatibility(k.kernel, meta) is not None:
            continue
        if has_metadata(args) and _norm(args[md.PG_NAME]) != _norm(meta.get(md.PG_NAME)):
            continue
        found.append(pos)
    return found[0] if len(found) == 1 else None


def match_eager(index: TraceIndex, collectives: list[dict[str, Any]], pairing: Pairing,
                kernels: list[NcclSpan], result: RankMatch, *, rank: int) -> tuple[set[int], list[NcclSpan]]:
    """Label eager NCCL kernels with their recorded call; one CommEvent per call with kernels.

    Returns the record positions that got kernels, and the kernels no recorded call owns
    (left for ``derive`` when they carry the profiler's metadata).
    """
    owned: dict[int, list[NcclSpan]] = {}
    strays: list[NcclSpan] = []
    for k in kernels:
        rng = _owning_range(index, k.span, pairing.entry_of)
        pos = pairing.entry_of[rng.index] if rng is not None else None
        if pos is None:               # outside every range, or in one no recorded call pairs
            strays.append(k)
        else:
            owned.setdefault(pos, []).append(k)
    free = {p for p, meta in enumerate(collectives)
            if p not in owned and not meta.get(md.CAPTURED)}
    calls = Intervals([(meta[md.T_BEGIN], meta[md.T_END], p) for p, meta in enumerate(collectives)
                       if meta.get(md.T_BEGIN) is not None and meta.get(md.T_END) is not None]
                      if strays else [])
    leftover = []
    for k in strays:
        pos = _by_call_time(index, k, collectives, calls, free)
        if pos is None:
            leftover.append(k)
            continue
        free.remove(pos)
        owned[pos] = [k]
        result.bump("joined_by_call_time")
    matched = set()
    for pos, ks in owned.items():
        meta = collectives[pos]
        good = []
        for k in ks:
            why = incompatibility(k.kernel, meta)
            if why is None:
                good.append(k)
            else:
                result.unmatched.append(Unmatched(f"kernel {index.name(k.span.index)}",
                                                  k.span.index, why))
        if good:
            _emit(index, pos, meta, good, result, rank=rank)
            matched.add(pos)
    return matched, leftover


def _emit(index: TraceIndex, pos: int, meta: dict[str, Any], kernels: list[NcclSpan],
          result: RankMatch, *, rank: int) -> None:
    first = min(kernels, key=lambda k: k.span.start)
    own = index.args(first.span.index)
    args = dict(meta)
    label = with_ops(meta)                # the kernel reads like a coalesced p2p one
    for k in kernels:
        kargs = index.args(k.span.index)
        for key in md.EAGER_KEYS:
            if key in kargs and key in meta and not agrees(kargs[key], meta[key]):
                result.conflicts.append(Conflict(k.span.index, key, kargs[key], meta[key]))
        result.label(k.span.index, index.events[k.span.index], label)
        result.bump("eager_matched")
        if not has_metadata(kargs):
            result.bump("eager_filled")       # the profiler left this kernel bare
    # the profiler's values, except a rank list it truncated: the event needs every member
    args.update({key: own[key] for key in md.EAGER_KEYS if key in own
                 and not (key == md.PG_RANKS and _truncated(own[key]))})
    result.events.append(CommEvent(
        rank=rank, pg=str(args.get(md.PG_NAME)), op=str(args.get(md.OP)),
        start_ns=first.span.start,
        end_ns=max(k.span.end for k in kernels),
        args=args, key=instance_key(args), source=Source.KERNEL, stream=own.get("stream"),
        extra={"trace_index": first.span.index, "record_index": pos,
               "kernel_indices": [k.span.index for k in kernels]}))
