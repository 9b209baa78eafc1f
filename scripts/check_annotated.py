"""Count the NCCL kernels of a merged trace that carry the eager collective metadata.

Usage: python scripts/check_annotated.py RUN_DIR_OR_PFTRACE
Prints, per rank, the NCCL kernels in the trace (graphed and eager) and how many carry every
eager key ("Collective name", "In msg nelems", ..., "Process Group Ranks"); exits 1 when a
graphed NCCL kernel lacks any of them.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from commviz import metadata as md
from commviz.kernels import parse_nccl
from commviz.verify import read_slices


def main(target: str) -> int:
    path = Path(target)
    if path.is_dir():
        path = path / "merged.pftrace"
    slices, report = read_slices(path)
    counts: Counter = Counter()
    for s in slices:
        if s.name is None or parse_nccl(s.name) is None or s.track.startswith(("PG ", "summary")):
            continue
        kind = "graphed" if md.REPLAY in s.args else "eager"
        counts[(s.process, kind, "all")] += 1
        if all(k in s.args for k in md.EAGER_KEYS):
            counts[(s.process, kind, "annotated")] += 1
    missing = 0
    for process in sorted({p for p, _, _ in counts}):
        for kind in ("eager", "graphed"):
            total = counts[(process, kind, "all")]
            done = counts[(process, kind, "annotated")]
            if total:
                print(f"{process}: {kind} NCCL kernels {total}, with every eager key {done}")
            if kind == "graphed":
                missing += total - done
    print(f"verify: {'OK' if report.ok else 'PROBLEMS'}")
    return 1 if missing or not report.ok else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
