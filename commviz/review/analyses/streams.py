"""Which work ran on which GPU stream: kernel classes with count and GPU time per rank and stream.

Classes are ``commviz.kernels.classify``'s (communication, gemm, memcpy/memset, other).
Graphed kernels count like eager ones; ``graphed`` says how many of a stream's ops ran inside
CUDA graph replays, so a stream fed only by graphs is visible as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from commviz.trace.gpu import GpuOp
from commviz.kernels import KERNEL_CLASSES, classify


@dataclass(slots=True)
class StreamRow:
    rank: int
    stream: int
    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KERNEL_CLASSES, 0))
    time_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KERNEL_CLASSES, 0))
    graphed: int = 0

    @property
    def total_ns(self) -> int:
        return sum(self.time_ns.values())


def stream_table(ops: Iterable[GpuOp]) -> list[StreamRow]:
    """One row per (rank, stream), the busiest stream first."""
    rows: dict[tuple[int, int], StreamRow] = {}
    for op in ops:
        row = rows.get((op.rank, op.stream))
        if row is None:
            row = rows[(op.rank, op.stream)] = StreamRow(op.rank, op.stream)
        cls = classify(op.name, op.cat)
        row.count[cls] += 1
        row.time_ns[cls] += op.duration_ns
        row.graphed += op.graphed
    return sorted(rows.values(), key=lambda r: (-r.total_ns, r.rank, r.stream))

