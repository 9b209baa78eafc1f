"""Coalesced point-to-point calls: one NCCL ``SendRecv`` kernel for a group of sends and receives.

``batch_isend_irecv`` (and any send/recv inside torch's ``_coalescing_manager``) on NCCL only
enqueues each op between ``ncclGroupStart`` and ``ncclGroupEnd``; ProcessGroupNCCL launches the
one ``ncclDevKernel_SendRecv`` when the group ends (``endCoalescing``, profiler range
``nccl:coalesced``), after every c10d call of the group returned. Its launch therefore lies in
none of their ``commviz::<op>`` ranges, and the profiler writes no collective metadata for it.
What the trace does show (2 x H200, NCCL 2.28.9, torch 2.11, pipelining's GPipe): on the
issuing thread the group's ``commviz::send`` / ``commviz::recv`` ranges, none with a kernel
launch inside, then the SendRecv kernel's launch (``cuLaunchKernelEx``, same ``correlation`` as
the kernel), and no other NCCL launch in between.

So a SendRecv kernel launched outside every range owns the recorded p2p calls of its launching
thread whose ranges closed before its own launch and began after that thread's previous NCCL
launch and previous ``nccl:coalesced`` range (either bounds the group where the profiler lost
the other), and that launched no kernel themselves. Each of those calls becomes a CommEvent at the kernel's
time (its own instance key: group, src, dst, per-pair number, so a send meets its receive on
the peer), and the kernel is labelled with the group's metadata in the eager keys' format plus
every op it carries (``commviz.p2p_ops``).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from commviz import metadata as md
from commviz.match.index import NcclSpan, TraceIndex
from commviz.match.model import CommEvent, Source, instance_key
from commviz.match.ranges import TOLERANCE_NS, Pairing
from commviz.match.result import RankMatch, Unmatched
from commviz.kernels import SENDRECV, incompatibility

BATCH_OP = "batch_isend_irecv"


def op_text(meta: dict[str, Any]) -> str:
    """One p2p op as people read it: ``send→1 8 KiB`` / ``recv←0 8 KiB``."""
    return f"{md.p2p_op(meta.get(md.OP), meta.get(md.PEER))} {md.fmt_bytes(meta.get(md.BYTES_IN))}"


def with_ops(meta: dict[str, Any]) -> dict[str, Any]:
    """A lone p2p call's metadata with its op as people read it (``commviz.p2p_ops``), so its
    kernel reads like a coalesced one; other calls' unchanged."""
    return {**meta, md.P2P_OPS: op_text(meta)} if meta.get(md.KIND) == "p2p" else meta


def batch_args(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The kernel's label: one op's own metadata, or for several the group's eager keys (sizes
    summed: sent in, received out) with ``commviz.peers`` / ``commviz.p2p_seq`` in op order,
    as a ``batch`` of the project's key vocabulary."""
    ops = ", ".join(op_text(m) for m in metas)
    if len(metas) == 1:
        return with_ops(metas[0])
    first = metas[0]
    sends = [m for m in metas if m.get(md.OP) in ("send", "isend")]
    recvs = [m for m in metas if m not in sends]
    dtypes = {m.get(md.DTYPE) for m in metas}
    out = {k: first[k] for k in (md.GROUP_SIZE, md.PG_NAME, md.PG_DESC, md.PG_RANKS, md.RANK,
                                 md.LANE, md.DEVICE, md.CALLSITE, md.CAPTURED, md.GRAPH,
                                 md.ORDINAL) if k in first}
    out.update({k: first[k] for k in md.ORIGIN_KEYS     # the group's origin, where its ops share it
                if k in first and all(m.get(k) == first[k] for m in metas)})
    out.update({
        md.COLLECTIVE_NAME: BATCH_OP, md.OP: BATCH_OP, md.KIND: "batch",
        md.IN_NELEMS: sum(int(m.get(md.IN_NELEMS) or 0) for m in sends),
        md.OUT_NELEMS: sum(int(m.get(md.OUT_NELEMS) or 0) for m in recvs),
        md.IN_SPLIT: "[]", md.OUT_SPLIT: "[]", md.ASYNC: True,
        md.BYTES_IN: sum(int(m.get(md.BYTES_IN) or 0) for m in sends),
        md.BYTES_OUT: sum(int(m.get(md.BYTES_OUT) or 0) for m in recvs),
        md.PEERS: ",".join(f"{'send' if m in sends else 'recv'}:{m.get(md.PEER)}"
                           for m in metas),
        md.P2P_SEQ: ",".join(str(m.get(md.P2P_SEQ)) for m in metas),
        md.P2P_OPS: ops,
    })
    if len(dtypes) == 1:
        out[md.DTYPE] = first.get(md.DTYPE)
    fr = {m.get(md.FR_P2P_SEQ) for m in metas}
    if len(fr) == 1 and None not in fr:
        out[md.FR_P2P_SEQ] = fr.pop()
    return out


def _launch_times(index: TraceIndex, kernels: list[NcclSpan]) -> dict[Any, list[int]]:
    """Per launching thread, the sorted launch times of its eager NCCL kernels."""
    out: dict[Any, list[int]] = defaultdict(list)
    for k in kernels:
        launch = index.launch_of(k.span.index)
        if launch is not None:
            out[launch.thread].append(launch.start)
    for times in out.values():
        times.sort()
    return out


def _before(times: list[int], t: int) -> int:
    """The latest of sorted ``times`` before ``t`` (-1 if none)."""
    j = bisect.bisect_left(times, t)
    return times[j - 1] if j > 0 else -1


def match_coalesced(index: TraceIndex, collectives: list[dict[str, Any]], pairing: Pairing,
                    kernels: list[NcclSpan], strays: list[NcclSpan], matched: set[int],
                    result: RankMatch, *, rank: int) -> list[NcclSpan]:
    """Join stray SendRecv kernels with the p2p calls they carry (module docstring).

    ``kernels``: every eager NCCL kernel (their launches bound the groups); ``matched``: record
    positions that have a kernel already (grown here). Returns the strays still unowned."""
    calls: dict[Any, list[tuple[int, int, int]]] = defaultdict(list)   # thread -> (end, start, pos)
    for pos, span in pairing.range_of.items():
        meta = collectives[pos]
        if meta.get(md.KIND) == "p2p" and not meta.get(md.CAPTURED) and pos not in matched:
            calls[span.thread].append((span.end, span.start, pos))
    if not calls:
        return strays
    for items in calls.values():
        items.sort()
    launches = _launch_times(index, kernels)
    left: list[NcclSpan] = []
    for k in strays:
        launch = index.launch_of(k.span.index) if k.kernel.collective == SENDRECV else None
        items = calls.get(launch.thread) if launch is not None else None
        if not items:
            left.append(k)
            continue
        after = max((_before(launches[launch.thread], launch.start),
                     _before(index.group_ends.get(launch.thread, []), launch.start)))
        # calls that closed by the launch and began after ``after`` (so ended after it: a
        # range's end is never before its start); the thread's earlier calls are not read
        lo = bisect.bisect_right(items, (after, 1 << 62, 0))
        hi = bisect.bisect_right(items, (launch.start + TOLERANCE_NS, 1 << 62, 0))
        members = sorted((start, pos) for end, start, pos in items[lo:hi]
                         if pos not in matched and start > after)
        positions = [pos for _, pos in members]
        if not positions:
            left.append(k)
            continue
        metas = [collectives[p] for p in positions]
        why = next((w for w in (incompatibility(k.kernel, m) for m in metas) if w), None)
        if why is None and len({str(m.get(md.PG_NAME)) for m in metas}) > 1:
            why = "the p2p calls before its launch belong to several process groups"
        if why is not None:
            result.unmatched.append(Unmatched(f"kernel {index.name(k.span.index)}",
                                              k.span.index, why))
            continue
        matched.update(positions)
        _emit(index, k, positions, metas, result, rank=rank)
    return left


def _emit(index: TraceIndex, k: NcclSpan, positions: list[int], metas: list[dict[str, Any]],
          result: RankMatch, *, rank: int) -> None:
    label = batch_args(metas)
    result.label(k.span.index, index.events[k.span.index], label)
    result.bump("coalesced_kernels")
    result.bump("coalesced_p2p_ops", len(positions))
    stream = index.args(k.span.index).get("stream")
    for pos, meta in zip(positions, metas):
        args = {**meta, md.P2P_OPS: label[md.P2P_OPS]}
        result.events.append(CommEvent(
            rank=rank, pg=str(meta.get(md.PG_NAME)), op=str(meta.get(md.OP)),
            start_ns=k.span.start, end_ns=k.span.end, args=args, key=instance_key(meta),
            source=Source.KERNEL, stream=stream,
            extra={"trace_index": k.span.index, "record_index": pos,
                   "kernel_indices": [k.span.index]}))
