"""Collective instances across ranks: arrival skew, the late rank, waits, stragglers.

An *instance* is one collective as every rank of its group saw it: the ``CommEvent`` s that
share an instance key (process group + sequence number; p2p: group, src, dst, sequence).
Times are ns on the merged clock. Per instance:

- ``skew`` = last start - first start: how far apart the ranks arrived;
- ``late_rank``: the rank that started last; ``wait[r]`` = time rank ``r`` spent in the call
  before the late rank arrived (``min(last start, r's end) - r's start``: a rank that left
  before the late one arrived, like a broadcast root, waited only while it was inside);
- ``span`` = first start -> last end (what the merged trace's summary slice covers);
- ``comm`` = last start -> last end: the time the collective ran with every rank present, the
  time the bandwidth is computed over (``bandwidth.py``), free of the waiting;
- ``straggler``: the late rank, only when the skew stands out (``mark_stragglers``): some rank
  always arrives last by a few microseconds, and that is noise, not a straggler;
- ``warmup``: a group's first collective, whose skew is the ranks' start-up (process start,
  imports, connecting the group), not anyone holding the others up: never a straggler, and
  left out of the group's normal skew;
- ``pipeline``: a transfer of a pipeline schedule (``commviz.origin`` of pipelining): a stage
  waiting for its neighbour is the schedule's bubble (``commviz.review.analyses.pipeline``), never a
  straggler, and left out of its group's normal skew.

An instance some rank of the run never joined (``missing``: a hang, a rank that died or
skipped it) never ran with all its ranks: it has no ``comm`` time, and each rank whose call
failed or never returned waited in it its whole call, for the missing ones.

A CPU span (the record or the profiler range, not a GPU kernel) covers only the launch
(``launch_only``) when the call does not block: ``async_op=True``, or a group whose collectives
run as GPU kernels on that rank (other calls of the same rank and group matched kernels: an
NCCL call returns once enqueued, so its record outside the profiled window is a launch). Such
an instance keeps its skew (the CPU arrival skew) but gets no ``comm`` time, no bandwidth, no
wait (all 0) and no straggler; ``launch_reason`` says why (``LaunchOnly``). A call that raised
on some rank (``commviz.error``: a timeout, an op the backend lacks) keeps its times but gets no
comm time or bandwidth.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable

from commviz import metadata as md
from commviz.match.model import CommEvent, InstanceKey, KeyKind, Source
from commviz.metadata import StrEnum
from commviz.merge import bandwidth as bw

# Set by the wrappers on a call that raised (a timeout, an unsupported op): it moved no data.
# A skew counts as a straggler when it is at least this long ...
STRAGGLER_MIN_NS = 1_000_000
# ... and at least this many times the group's median skew.
STRAGGLER_FACTOR = 5.0
# A group's first this many collectives are its warm-up (``Instance.warmup``).
WARMUP = 1
# The enum members read per event and per instance, as globals (why: ``model._TRANSFERS``)
_P2P, _BATCH, _COLLECTIVE = KeyKind.P2P, KeyKind.BATCH, KeyKind.COLLECTIVE
_KERNEL = Source.KERNEL


class LaunchOnly(StrEnum):
    """Why a call's span covers only its launch (``is_launch_only``), as the report says it."""

    ASYNC = "async"            # async_op=True, isend/irecv, a functional collective; no kernel
    NO_KERNEL = "no kernel"    # a GPU group's call whose kernel the trace does not hold


# What each reason means for the time that was not measured (the report's notes).
LAUNCH_ONLY_WHY = {
    LaunchOnly.ASYNC: "async_op=True, isend/irecv or a functional collective (DTensor, compiled "
                      "code) on CPU: the call returns once its work is queued, the transfer runs "
                      "after it (a collective on gloo's worker thread: gloo:<op> in the trace) "
                      "and its wait() comes later; nothing in the trace ties that range to its "
                      "call (no group, no sequence number), so its time is not counted",
    LaunchOnly.NO_KERNEL: "a GPU (NCCL) call whose kernel is not in the trace (made outside the "
                          "profiled steps): the call only enqueued it",
}


class Span:
    """Timing shared by every cross-rank view of an instance (the report's ``Instance``, the
    overview's folded one): the skew between the first and last start, the time spent
    communicating once the last rank arrived."""

    __slots__ = ()
    first_start_ns: int
    last_start_ns: int
    last_end_ns: int
    launch_only: bool
    failed: bool

    @property
    def skew_ns(self) -> int:
        return self.last_start_ns - self.first_start_ns

    @property
    def comm_ns(self) -> int | None:
        if self.launch_only or self.failed:
            return None
        return max(0, self.last_end_ns - self.last_start_ns)


@dataclass(slots=True)
class Instance(Span):
    """One collective (or p2p transfer) across the ranks that took part."""

    key: InstanceKey
    pg: str
    pg_desc: str
    seq: int | None
    op: str
    ctype: str                           # nccl-tests type (bandwidth.COLLECTIVE_TYPES)
    kind: str                            # md.KIND: collective | p2p | batch
    events: dict[int, CommEvent]         # rank -> its event
    ranks: tuple[int, ...]               # ranks that should take part
    missing: tuple[int, ...]             # of those, ranks present in the run without this one
    first_start_ns: int
    last_start_ns: int
    last_end_ns: int
    late_rank: int
    wait_ns: dict[int, int]
    launch_only: bool
    failed: bool                         # raised on some rank (md.ERROR)
    size_bytes: int | None
    bandwidth: bw.Bandwidth | None
    straggler: int | None = None
    warmup: bool = False                 # among its group's first WARMUP: start-up skew
    pipeline: bool = False               # a pipeline schedule's transfer: its waits are bubbles
    launch_reason: LaunchOnly | None = None   # why it is launch only (None: it is not)

    @property
    def comm_ns(self) -> int | None:
        """None also where a rank never joined: it never ran with all its ranks (``Span``'s
        read directly: a slotted dataclass has no ``super()``)."""
        return None if self.missing else Span.comm_ns.fget(self)   # type: ignore[attr-defined]

    @property
    def span_ns(self) -> int:
        return self.last_end_ns - self.first_start_ns

    @property
    def total_wait_ns(self) -> int:
        return sum(self.wait_ns.values())

    @property
    def label(self) -> str:
        return instance_label(self.key, self.op, self.seq)

    @property
    def origin(self) -> str | None:
        """The ``commviz.origin`` its ranks recorded (the most common; None: none did)."""
        found = [o for ev in self.events.values() if (o := ev.args.get(md.ORIGIN))]
        if not found or all(o == found[0] for o in found):
            return found[0] if found else None
        return Counter(found).most_common(1)[0][0]


def instance_label(key: InstanceKey, op: str, seq: int | None) -> str:
    """How an instance is named in tables and on summary slices ("all_reduce #3")."""
    kind = key.kind
    if kind is _P2P:
        text = f"{op} {key.src}->{key.dst} #{key.seq}"
    elif kind is _BATCH:
        text = f"{op} " + " ".join(f"{p.src}->{p.dst}#{p.seq}" for p in key.pairs)
    else:
        seq = seq if seq is not None else (key.seq if kind is _COLLECTIVE else None)
        text = op if seq is None else f"{op} #{seq}"
    if key.replay is not None:               # one CUDA graph replay's copy of the call
        replay = key.replay
        replay = " ".join(map(str, replay)) if isinstance(replay, tuple) else replay
        text += f" replay {replay}"
    return text


def expected_ranks(key: InstanceKey, args: dict) -> tuple[int, ...]:
    """The ranks that should take part in an instance: its two p2p ends, else its group's."""
    if key.kind is _P2P:
        return tuple(sorted({int(key.src), int(key.dst)}))
    if key.kind is _BATCH:
        return tuple(sorted({int(r) for p in key.pairs for r in (p.src, p.dst)}))
    return md.group_ranks(args.get(md.PG_RANKS))


def bandwidth_ranks(key: InstanceKey, expected: int) -> int:
    """The rank count in the bus bandwidth factor: a transfer's two ends, else the group's
    ``expected`` ranks (whatever numbers the instance: commviz, an annotation, the profiler)."""
    return 2 if key.kind.p2p else expected


def _make(key: InstanceKey, evs: dict[int, CommEvent], present: set[int],
          gpu: set[tuple[int, str]]) -> Instance:
    late_rank, first = next(iter(evs.items()))
    args = first.args
    last_start = first.start_ns
    first_start, last_end = last_start, first.end_ns
    failed = pipeline = False
    reason = None
    size = None
    p2p = key.kind.p2p
    for r, e in evs.items():            # one pass: a run has hundreds of thousands of these
        start = e.start_ns
        if start > last_start or start == last_start and r > late_rank:
            late_rank, last_start = r, start
        if start < first_start:
            first_start = start
        if e.end_ns > last_end:
            last_end = e.end_ns
        eargs = e.args
        if reason is None:
            reason = launch_only_reason(e, gpu)
        failed = failed or md.ERROR in eargs
        pipeline = pipeline or p2p and is_pipeline_transfer(eargs)
        s = bw.size_bytes(eargs)
        if s is not None and (size is None or s > size):
            size = s
    launch_only = reason is not None
    expected = expected_ranks(key, args) or tuple(sorted(evs))
    missing = tuple(r for r in expected if r in present and r not in evs)
    wait = {r: 0 if launch_only else e.duration_ns if missing and held(e)
            else max(0, min(last_start, e.end_ns) - e.start_ns) for r, e in evs.items()}
    ctype = bw.collective_type(args)
    inst = Instance(
        key=key, pg=first.pg, pg_desc=str(args.get(md.PG_DESC, "")), seq=first.seq,
        op=first.op, ctype=ctype, kind=str(args.get(md.KIND, "collective")), events=evs,
        ranks=expected, missing=missing, first_start_ns=first_start, last_start_ns=last_start,
        last_end_ns=last_end, late_rank=late_rank, wait_ns=wait, launch_only=launch_only,
        failed=failed, size_bytes=size, bandwidth=None, pipeline=pipeline, launch_reason=reason)
    inst.bandwidth = bw.bandwidth(ctype, size, inst.comm_ns, bandwidth_ranks(key, len(expected)))
    return inst


def is_pipeline_transfer(args: dict) -> bool:
    """Whether a transfer's call (its args) was a pipeline schedule's: its waits are the
    schedule's bubbles, never a straggler's."""
    return args.get(md.ORIGIN_KIND) == md.OriginKind.PIPELINE


def held(ev: CommEvent) -> bool:
    """Whether the call did not complete: it failed, or its record has it begun and never
    returned (the rank was still inside when it stopped)."""
    return md.ERROR in ev.args or (md.T_BEGIN in ev.args and md.T_END not in ev.args)


def kernel_groups(events: Iterable[CommEvent]) -> set[tuple[int, str]]:
    """(rank, pg) pairs whose collectives ran as GPU kernels on that rank."""
    return {(ev.rank, ev.pg) for ev in events if ev.source is _KERNEL}


def is_launch_only(ev: CommEvent, gpu: set[tuple[int, str]]) -> bool:
    """Whether the event's span covers only the call's launch (see the module docstring)."""
    return launch_only_reason(ev, gpu) is not None


def launch_only_reason(ev: CommEvent, gpu: set[tuple[int, str]]) -> LaunchOnly | None:
    """Why the event's span covers only the call's launch, or None when it covers the transfer
    (a GPU kernel, or a synchronous CPU call: the boundary kernel waits for its work). A GPU
    group's call is ``NO_KERNEL`` first: its kernel, not a wait, would have measured it."""
    if ev.source is _KERNEL:
        return None
    if (ev.rank, ev.pg) in gpu:
        return LaunchOnly.NO_KERNEL
    if not ev.args.get(md.ASYNC):
        return None
    return LaunchOnly.NO_KERNEL if ev.args.get(md.DEVICE) == "cuda" else LaunchOnly.ASYNC


def build_instances(events: Iterable[CommEvent], *, present: set[int] | None = None,
                    straggler_min_ns: int = STRAGGLER_MIN_NS,
                    straggler_factor: float = STRAGGLER_FACTOR) -> list[Instance]:
    """Group events by instance key, in order of first start.

    ``present``: the ranks the run has data for (default: the ranks seen in ``events``);
    ``Instance.missing`` lists only those, so a rank with no record at all is one problem
    reported once, not a "missing" on every collective.
    """
    events = list(events)
    groups: dict[InstanceKey, dict[int, CommEvent]] = defaultdict(dict)
    ranks_seen: set[int] = set()
    gpu = kernel_groups(events)
    for ev in events:
        ranks_seen.add(ev.rank)
        if ev.key is None:
            continue
        groups[ev.key].setdefault(ev.rank, ev)
    present = ranks_seen if present is None else present
    out = [_make(key, evs, present, gpu) for key, evs in groups.items()]
    out.sort(key=lambda i: (i.first_start_ns, i.pg, i.seq or 0))
    mark_stragglers(out, min_ns=straggler_min_ns, factor=straggler_factor)
    return out


def mark_stragglers(instances: list[Instance], *, min_ns: int = STRAGGLER_MIN_NS,
                    factor: float = STRAGGLER_FACTOR) -> None:
    """Set ``straggler`` where the skew is >= ``min_ns`` and >= ``factor`` x the median of the
    group's other skews (``straggler_thresholds``).

    The median of a process group's skews is its normal jitter (launch noise, clock error);
    a late arrival that is many times that, and long in absolute terms, is a straggler.
    Launch-only instances name none: nobody was measured waiting for them; nor do a group's
    warm-up collectives (``WARMUP``), whose skew is start-up, nor a pipeline schedule's
    transfers (``Instance.pipeline``), whose waits are its bubbles.
    """
    by_pg: dict[str, list[Instance]] = defaultdict(list)
    numbered: dict[str, list[Instance]] = defaultdict(list)
    for inst in instances:
        inst.straggler = None
        if inst.kind == "collective" and inst.seq is not None:
            numbered[inst.pg].append(inst)
    for insts in numbered.values():
        first = sorted({i.seq for i in insts})[:WARMUP]
        for inst in insts:
            inst.warmup = inst.seq in first
    for inst in instances:
        if len(inst.events) > 1 and not inst.launch_only and not inst.warmup \
                and not inst.pipeline:
            by_pg[inst.pg].append(inst)
    for insts in by_pg.values():
        skews = [i.skew_ns for i in insts]
        for inst, threshold in zip(insts, straggler_thresholds(skews, min_ns, factor)):
            inst.straggler = inst.late_rank if inst.skew_ns >= threshold else None


def straggler_thresholds(skews: list[int], min_ns: int = STRAGGLER_MIN_NS,
                         factor: float = STRAGGLER_FACTOR) -> list[float]:
    """Per skew of one group, the skew from which its late rank is a straggler: ``factor`` x
    the median of the group's *other* skews (at least ``min_ns``). Leaving the skew itself out
    keeps a group of few collectives honest: one long wait among three must not raise the
    median it is judged by (O(n log n): the others' median read off the sorted skews)."""
    ordered = sorted(skews)
    m = len(ordered) - 1                      # how many others each skew has

    def others_median(k: int) -> float:       # the median of ``ordered`` without index k
        if m == 0:
            return 0.0
        mid = [ordered[p] if p < k else ordered[p + 1] for p in {m // 2, (m - 1) // 2}]
        return sum(mid) / len(mid)
    return [max(min_ns, factor * others_median(bisect.bisect_left(ordered, s))) for s in skews]

