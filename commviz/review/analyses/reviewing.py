"""Reviewing a run: its matched ranks loaded once (``commviz.match.matched``: the per-rank
artifacts the merge also reads, on the same clock) and every analysis run over them into one
``Review``. Its verdict is the launch's: how each rank ended is read from the logs ``commviz
launch`` left in the run dir (``review.analyses.exits``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commviz.errors import SourceError
from commviz.match.artifact import PgInfo
from commviz.match.matched import MatchedRun, matched_run
from commviz.match.model import CommEvent
from commviz.merge import instances as inst_mod
from commviz.merge.instances import Instance, build_instances
from commviz.review.analyses.desync import Desync, find_desyncs
from commviz.review.analyses.exits import read_exits
from commviz.review.analyses.judge import build_verdict
from commviz.review.analyses.origins import OriginRow, rollup
from commviz.review.analyses.overlap import RankOverlap, overlap_table
from commviz.review.analyses.pipeline import StageWaits, stage_waits
from commviz.review.analyses.rollups import (CollectiveSummary, GroupSummary, RankSummary,
                                            collective_summaries, group_summaries, rank_summaries)
from commviz.review.analyses.streams import StreamRow, stream_table
from commviz.review.model.verdict import Verdict
from commviz.trace.gpu import GpuOp
from commviz.trace.run import Run, load_run


@dataclass
class Review:
    """Every analysis of one run."""

    run_dir: Path
    ranks: list[int]
    events: int
    instances: list[Instance]
    groups: list[GroupSummary]
    rank_rows: list[RankSummary]
    collectives: list[CollectiveSummary]
    desyncs: list[Desync]
    streams: list[StreamRow]
    overlap: list[RankOverlap]
    problems: list[str]
    pipeline: list[StageWaits] = field(default_factory=list)   # a pipeline's stages, if any
    by: str | None = None            # the rollup asked for (``origins.BY``), if any
    origins: list[OriginRow] = field(default_factory=list)
    verdict: Verdict | None = None   # why the job hung or died; None when it did not
    skipped: list[Path] = field(default_factory=list)   # run dir files that are no trace



def _matched(run_dir: str | Path, run: Run | None) -> MatchedRun:
    """The run's matched ranks (one error when there is nothing to review)."""
    matched = matched_run(run_dir, run)
    if not matched.ranks:
        why = "; ".join(matched.problems) or "no commviz records and no profiler traces"
        raise SourceError(str(run_dir), f"nothing to review: {why}")
    return matched


def _inputs(matched: MatchedRun) -> tuple[list[CommEvent], list[GpuOp], set[int], list[str]]:
    ranks = [matched.ranks[r] for r in sorted(matched.ranks)]
    events = [ev for art in ranks for ev in art.events]
    ops = [op for art in ranks for op in art.gpu_ops]
    return events, ops, set(matched.ranks), matched.problems


def load_inputs(run_dir: str | Path, run: Run | None = None
                ) -> tuple[list[CommEvent], list[GpuOp], set[int], list[str]]:
    """A run's collectives and GPU ops on the merged clock (its matched ranks, the same the
    merged trace is made of), the ranks with data, and the problems (``run``: the run dir
    already loaded)."""
    return _inputs(_matched(run_dir, run))


def analyse(events: list[CommEvent], ops: list[GpuOp], *, present: set[int] | None = None,
            run_dir: Path = Path("."), problems: list[str] | None = None,
            pgs: dict[str, PgInfo] | None = None,
            straggler_min_ns: int = inst_mod.STRAGGLER_MIN_NS,
            straggler_factor: float = inst_mod.STRAGGLER_FACTOR) -> Review:
    """Run every analysis on already loaded events and GPU ops (``pgs``: each group's
    description and ranks, as the ranks' matched runs have them)."""
    present = present if present is not None else {e.rank for e in events}
    instances = build_instances(events, present=present, straggler_min_ns=straggler_min_ns,
                                straggler_factor=straggler_factor)
    pipeline = stage_waits(instances)
    return Review(
        run_dir=Path(run_dir), ranks=sorted(present), events=len(events), instances=instances,
        groups=group_summaries(instances, pgs), rank_rows=rank_summaries(instances, pipeline),
        collectives=collective_summaries(instances),
        desyncs=find_desyncs(events, present=present), streams=stream_table(ops),
        overlap=overlap_table(ops), problems=list(problems or []), pipeline=pipeline)


def review_run(run_dir: str | Path, by: str | None = None, run: Run | None = None,
               **thresholds: Any) -> Review:
    """Load ``run_dir`` and analyse it (``thresholds``: ``straggler_min_ns``, ``straggler_factor``;
    ``by``: also roll communication up per origin or unit, ``origins.BY``; ``run``: the run dir
    already loaded)."""
    run = run if run is not None else load_run(run_dir)     # once: the match and the verdict
    matched = _matched(run_dir, run)
    events, ops, present, problems = _inputs(matched)
    pgs: dict[str, PgInfo] = {}
    for rank in sorted(matched.ranks):
        for pg, info in matched.ranks[rank].pgs.items():
            pgs.setdefault(pg, info)
    review = analyse(events, ops, present=present, run_dir=Path(run_dir), problems=problems,
                     pgs=pgs, **thresholds)
    if by is not None:
        review.by, review.origins = by, rollup(review.instances, by)
    review.verdict = build_verdict(run_dir, read_exits(Path(run_dir)), run=run)
    review.skipped = run.skipped
    return review
