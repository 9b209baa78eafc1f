"""A run dir built in process: every rank's record as the recorder writes it
(``commviz.record.store.dump_record``), no profiler trace, with faults planted by the test.

One process group of ``world`` ranks makes ``calls`` all_reduces, one every ``STEP_NS``; each
rank arrives ``JITTER_NS * rank`` after the first and every rank leaves ``COMM_NS`` after the
last one arrived, as a collective does. What a test plants is what it expects back:

- ``late``: ``{seq: (rank, ns)}``: that rank arrives ``ns`` later at that collective;
- ``size``: ``(seq, rank, nelems)``: that rank's call has other sizes (a desync);
- ``stuck``: ``(seq, rank)``: that rank never reaches collective ``seq``; the others are inside
  it when the job is torn down (their records rebuilt from their journals).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from commviz import metadata as md
from commviz.record.journal import EXIT as JOURNAL_EXIT, NEVER_RETURNED
from commviz.record.store import dump_record

T0_NS = 1_800_000_000_000_000_000
STEP_NS = 10_000_000
JITTER_NS = 50_000
COMM_NS = 1_000_000
NELEMS = 1024
CALLSITE = "train.py:12"


def _call(rank: int, world: int, seq: int, begin: int, end: int | None,
          nelems: int) -> dict[str, Any]:
    ranks = str(list(range(world)))
    meta: dict[str, Any] = {
        "Collective name": "allreduce", "In msg nelems": nelems, "Out msg nelems": nelems,
        "Group size": world, "dtype": "Float", "In split size": "[]", "Out split size": "[]",
        md.PG_NAME: "0", md.PG_DESC: "default_pg", md.PG_RANKS: ranks,
        md.OP: "all_reduce", md.KIND: "collective", "commviz.rank": rank,
        "commviz.async_op": False, "commviz.bytes_in": 4 * nelems,
        "commviz.bytes_out": 4 * nelems, md.CALLSITE: CALLSITE, "commviz.device": "cpu",
        md.SEQ: seq, md.ORIGIN: CALLSITE, "commviz.origin_kind": "user",
        md.T_BEGIN: begin, md.T_END: end}
    if end is None:
        meta[md.ERROR] = NEVER_RETURNED
    return meta


def write_run(run_dir: Path, *, world: int = 4, calls: int = 12,
              late: dict[int, tuple[int, int]] | None = None,
              size: tuple[int, int, int] | None = None,
              stuck: tuple[int, int] | None = None) -> Path:
    """Write the run dir's records (see the module's docstring) and return it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    per_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world)}
    for seq in range(1, calls + 1):
        if stuck is not None and seq > stuck[0]:
            break
        starts = {r: T0_NS + seq * STEP_NS + JITTER_NS * r for r in range(world)}
        if late and seq in late:
            starts[late[seq][0]] += late[seq][1]
        arrived = [r for r in starts if stuck is None or (seq, r) != stuck]
        end = None if len(arrived) < world else max(starts.values()) + COMM_NS
        for r in arrived:
            nelems = size[2] if size is not None and (seq, r) == size[:2] else NELEMS
            per_rank[r].append(_call(r, world, seq, starts[r], end, nelems))
    for r, collectives in per_rank.items():
        exit_ = JOURNAL_EXIT if stuck is not None else "normal"
        dump_record(run_dir / f"commviz_rank{r}.pkl", {
            "schema": "commviz.record", "version": 1, "rank": r, "world_size": world,
            "process_groups": [{"name": "0", "desc": "default_pg", "ranks": list(range(world)),
                                "backend": "gloo", "lane": 1}],
            "collectives": collectives, "local_rank": r, "host": "vm", "pid": 1000 + r,
            "device": "cpu", "backend": "gloo", "torch_version": "2.13.0+cpu",
            "nccl_version": None, "exit": exit_,
            "clock": {"offset_ns": 0, "offset_source": "none",
                      "wall_ns": T0_NS + (calls + 2) * STEP_NS},
            "capacity": 100000, "recorded": len(collectives), "dropped": 0, "graphs": [],
            "replays": [], "marks": [], "traces": []})
    return run_dir
