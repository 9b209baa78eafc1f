"""A run's matched ranks on the merged clock, for the tools that need every rank at once.

Each rank's saved matched run (``artifact``, written by the merge's worker or by ``write_shard``
on the rank's node) is used when it was built from the rank's current inputs; otherwise (a run
dir never merged) the rank is matched here, once, in memory: reading a run writes nothing. The clock plan is the one the merge uses (``clock.plan_clock`` + ``clock.align``), so the
report and the merged trace put every rank at the same times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from commviz.match import artifact
from commviz.match.artifact import RankArtifact
from commviz.match.merged_clock import ClockPlan, align, plan_clock
from commviz.trace.run import RankInput, Run, load_run


@dataclass
class MatchedRun:
    run_dir: Path
    ranks: dict[int, RankArtifact]
    plan: ClockPlan
    problems: list[str]          # the run's and every rank's, each once


def fingerprints(inp: RankInput) -> tuple[str, str | None]:
    """(all inputs, the record alone) of one rank: what its matched run must have been built from."""
    return (artifact.inputs_fingerprint(inp.record, inp.trace_paths),
            artifact.inputs_fingerprint(inp.record, []) if inp.record is not None else None)


def rank_artifact(inp: RankInput, path: Path, plan: ClockPlan,
                  problems: list[str]) -> RankArtifact:
    """The rank's matched run: loaded when fresh, else built."""
    inputs, record_inputs = fingerprints(inp)
    art = artifact.load_fresh(path, inputs, record_inputs, bool(inp.trace_paths), problems)
    if art is not None:
        return art
    found: list[str] = []
    traces = list(inp.load_traces(found))
    return artifact.build(inp.rank, traces, inp.record, inputs=inputs,
                          record_inputs=record_inputs, clock=plan.clock(inp.rank),
                          host=inp.host, problems=found)


def matched_run(run_dir: str | os.PathLike[str], run: Run | None = None) -> MatchedRun:
    """Every rank of ``run_dir`` matched once and put on the merged clock (``run``: the run
    dir already loaded)."""
    run = run if run is not None else load_run(run_dir)
    plan = plan_clock(run)
    problems = list(run.problems)
    ranks = {rank: rank_artifact(inp, artifact.matched_path(run.run_dir, rank), plan, problems)
             for rank, inp in sorted(run.ranks.items())}   # one rank's traces at a time
    ranks, found = align(plan, ranks)
    problems.extend(found)
    for rank in sorted(ranks):
        problems.extend(p for p in ranks[rank].problems if p not in problems)
    return MatchedRun(run.run_dir, ranks, plan, problems)
