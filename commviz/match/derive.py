"""CommEvents from the profiler's own collective metadata, for collectives commviz did not record.

A plain profiler directory (no commviz record), or NCCL kernels a record does not cover (DDP's
reducer, FSDP), still carry the eager keys Kineto copies from ``record_param_comms``. Each
becomes a CommEvent with commviz's keys derived from them. Its instance key is the profiler's
``Seq`` where the trace has it, else the k-th collective of its process group in this trace:
the same on every rank when every rank's trace covers the same steps, as a profiler schedule
driven by the training loop gives.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from commviz import metadata as md
from commviz.match.index import NcclSpan, Span, TraceIndex
from commviz.match.model import CommEvent, InstanceKey, KeyKind, Source
from commviz.match.result import RankMatch, Unmatched

PROFILER_SEQ = "Seq"
PROFILER_SRC = "Src Rank"
PROFILER_DST = "Dst Rank"
_P2P_NAMES = frozenset({"send", "recv"})
# the enum members read per event, as globals (why: ``model._TRANSFERS``)
_PROFILER, _PROFILER_P2P = KeyKind.PROFILER, KeyKind.PROFILER_P2P
_KERNEL, _CPU = Source.KERNEL, Source.CPU
# Eager "Collective name" -> the torch.distributed function that issues it (first one wins).
_OPS: dict[str, str] = {}
for _op, _name in md.COLLECTIVE_NAMES.items():
    _OPS.setdefault(_name, _op)


def group_table(trace: Any) -> dict[str, dict[str, Any]]:
    """Process group name -> its eager keys (ranks, description, size) from ``distributedInfo``."""
    info = getattr(trace, "distributed_info", None) or {}
    out: dict[str, dict[str, Any]] = {}
    for pg in info.get("pg_config") or ():
        if not isinstance(pg, dict) or pg.get("pg_name") is None:
            continue
        ranks = pg.get("ranks")
        row = {md.PG_RANKS: str(list(ranks)) if isinstance(ranks, list) else ranks,
               md.PG_DESC: pg.get("pg_desc"), md.GROUP_SIZE: pg.get("pg_size")}
        out[str(pg["pg_name"])] = {k: v for k, v in row.items() if v is not None}
    return out


def has_metadata(args: dict[str, Any]) -> bool:
    return md.COLLECTIVE_NAME in args and md.PG_NAME in args


def commviz_args(args: dict[str, Any], *, rank: int, groups: dict[str, dict[str, Any]],
                 reduction: str | None) -> dict[str, Any]:
    """The eager keys as the profiler wrote them (gaps filled from ``distributedInfo``), plus
    the commviz keys they imply."""
    out = {k: args[k] for k in md.EAGER_KEYS if k in args}
    pg = str(out[md.PG_NAME])
    known = groups.get(pg, {})
    for key, value in known.items():
        out.setdefault(key, value)
    if md.PG_RANKS in known and "..." in str(out[md.PG_RANKS]):    # truncated past 30 ranks
        out[md.PG_RANKS] = known[md.PG_RANKS]
    name = str(out[md.COLLECTIVE_NAME])
    out[md.OP] = _OPS.get(name, name)
    out[md.KIND] = "p2p" if name in _P2P_NAMES else "collective"
    out[md.RANK] = rank
    out[md.LANE] = md.lane_id(pg)
    if reduction is not None:
        out[md.REDUCE_OP] = reduction
    size = md.DTYPE_BYTES.get(str(out.get(md.DTYPE)))
    if size is not None:
        for nelems, key in ((md.IN_NELEMS, md.BYTES_IN), (md.OUT_NELEMS, md.BYTES_OUT)):
            if isinstance(out.get(nelems), int):
                out[key] = out[nelems] * size
    if PROFILER_SRC in args and PROFILER_DST in args:
        out[md.SRC], out[md.DST] = args[PROFILER_SRC], args[PROFILER_DST]
    return out


def derive(index: TraceIndex, kernels: list[NcclSpan], result: RankMatch, *, rank: int,
           recorded: bool = False) -> None:
    """CommEvents for eager NCCL kernels from their own metadata; the rest are Unmatched.

    Without a record, in a trace with no NCCL kernel at all (a CPU-only profile),
    ``record_param_comms`` ops stand in for them. ``recorded``: a record exists, and these are
    the kernels none of its calls owns.
    """
    bare = ("launched outside every recorded call, and the profiler wrote no collective "
            "metadata for it" if recorded else
            "no commviz record, and the profiler wrote no collective metadata for it")
    groups = group_table(index.trace)
    items: list[tuple[int, Span, str | None, dict]] = []   # (launch time, span, reduction, args)
    for k in kernels:
        args = index.args(k.span.index)
        if not has_metadata(args):
            result.unmatched.append(Unmatched(f"kernel {index.name(k.span.index)}",
                                              k.span.index, bare))
            continue
        launch = index.launch_of(k.span.index)
        items.append(((launch or k.span).start, k.span, k.kernel.reduction, args))
    if not index.nccl and not recorded:
        for span in index.param_comms.values():
            args = index.args(span.index)
            if has_metadata(args):
                items.append((span.start, span, None, args))
    counters: dict[InstanceKey, int] = {}
    events = index.events
    for _, span, reduction, raw in sorted(items, key=itemgetter(0)):
        args = commviz_args(raw, rank=rank, groups=groups, reduction=reduction)
        pg = str(args[md.PG_NAME])
        p2p = args[md.KIND] == "p2p"
        kind, src, dst = ((_PROFILER_P2P, args.get(md.SRC), args.get(md.DST)) if p2p
                          else (_PROFILER, None, None))
        lane = InstanceKey(kind, pg, None, src, dst)
        n = counters[lane] = counters.get(lane, 0) + 1
        seq = raw.get(PROFILER_SEQ)
        known_peers = not p2p or None not in (src, dst)
        key = InstanceKey(kind, pg, int(seq) if seq is not None else n, src, dst) \
            if known_peers else None
        event = events[span.index]
        is_kernel = event.get("cat") == "kernel"
        result.events.append(CommEvent(
            rank=rank, pg=pg, op=str(args[md.OP]), start_ns=span.start,
            end_ns=span.end, args=args, key=key,
            source=_KERNEL if is_kernel else _CPU,
            stream=raw.get("stream") if is_kernel else None,
            extra={"trace_index": span.index,
                   "key_source": "profiler seq" if seq is not None else "order in trace"}))
        result.label(span.index, event, args)
    if items:
        result.bump("derived_from_profiler", len(items))
