"""Communication vs computation time per rank, with Holistic Trace Analysis' definitions.

So the numbers can be held against HTA's on the same traces, this follows
``hta/analyzers/communication_analysis.py`` (``get_comm_comp_overlap``) and
``hta/analyzers/breakdown_analysis.py`` (``get_temporal_breakdown``), ``hta/utils/utils.py``:

- GPU events: every event with a stream (kernels, memcpys, memsets), graphed ones included.
- Kernel type by name: communication ``^nccl.*Kernel``; memory ``^Memcpy|^Memset|^dma``;
  computation: not ``(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)`` (HTA's regex, quirks
  kept); anything else is "other".
- Each type's intervals are merged (union) before measuring.
- overlap % = |comm ∩ computation| / |comm| x 100 (HTA's ``comp_comm_overlap_pctg``: the share
  of communication time hidden under computation).
- temporal breakdown: kernel time = last end - first start of all GPU events; idle = kernel
  time - |union of all GPU events|; compute = |computation|; non-compute = the rest.

A rank without GPU events (gloo on CPU) has no row: HTA has nothing to measure there either.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from commviz.trace.gpu import GpuOp

COMMUNICATION, MEMORY, COMPUTATION, OTHER = "COMMUNICATION", "MEMORY", "COMPUTATION", "OTHER"
_COMM_RE = re.compile(r"^nccl.*Kernel")
_MEMORY_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


def hta_kernel_type(name: str) -> str:
    if _COMM_RE.match(name):
        return COMMUNICATION
    if _MEMORY_RE.match(name):
        return MEMORY
    if not _NOT_COMPUTE_RE.match(name):
        return COMPUTATION
    return OTHER


Interval = tuple[int, int]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(merged: list[Interval]) -> int:
    return sum(e - s for s, e in merged)


def intersection(a: list[Interval], b: list[Interval]) -> int:
    """Total length of the overlap of two merged interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True, slots=True)
class RankOverlap:
    rank: int
    comm_ns: int              # |union of communication kernels|
    compute_ns: int           # |union of computation kernels|
    overlap_ns: int           # |comm ∩ compute|
    kernel_ns: int            # last end - first start of all GPU events
    idle_ns: int
    non_compute_ns: int

    @property
    def overlap_pct(self) -> float | None:
        """HTA's comp_comm_overlap_pctg (None when the rank ran no communication kernel)."""
        return 100.0 * self.overlap_ns / self.comm_ns if self.comm_ns else None


def rank_overlap(rank: int, ops: Iterable[GpuOp]) -> RankOverlap | None:
    by_type: dict[str, list[Interval]] = defaultdict(list)
    everything: list[Interval] = []
    for op in ops:
        by_type[hta_kernel_type(op.name)].append((op.start_ns, op.end_ns))
        everything.append((op.start_ns, op.end_ns))
    if not everything:
        return None
    busy = merge(everything)
    comm, comp = merge(by_type[COMMUNICATION]), merge(by_type[COMPUTATION])
    kernel = busy[-1][1] - busy[0][0]
    idle = kernel - length(busy)
    compute = length(comp)
    return RankOverlap(rank=rank, comm_ns=length(comm), compute_ns=compute,
                       overlap_ns=intersection(comm, comp), kernel_ns=kernel, idle_ns=idle,
                       non_compute_ns=kernel - compute - idle)


def overlap_table(ops: Iterable[GpuOp]) -> list[RankOverlap]:
    """One row per rank with GPU events, by rank."""
    by_rank: dict[int, list[GpuOp]] = defaultdict(list)
    for op in ops:
        by_rank[op.rank].append(op)
    rows = (rank_overlap(rank, rank_ops) for rank, rank_ops in sorted(by_rank.items()))
    return [r for r in rows if r is not None]
