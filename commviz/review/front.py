"""``commviz.Run(run_dir)``: one front over a run dir for notebooks and the commands.

As Holistic Trace Analysis' ``TraceAnalysis`` stands over its analyzers: the run dir is read
once, when an analysis first needs it, and each analysis is a method that reads only what it
needs: the records and stacks for the verdict, the matched ranks for the review (instances,
stragglers, desyncs), the kept windows for ``windows``, each made once (per arguments); the
diff reads both runs' comm tables on each call. A ``Run`` is a snapshot: a job still running
is read again by a new one. The analyses themselves stay stateless functions (``review.analyses``); their
wording is ``review.render``. Nothing here imports torch.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

from commviz.merge import instances as inst_mod
from commviz.merge.instances import Instance
from commviz.review.analyses.desync import Desync
from commviz.review.analyses.exits import read_exits
from commviz.review.analyses.judge import build_verdict
from commviz.review.analyses.kept_windows import WholeRun, read_whole_run
from commviz.review.analyses.reviewing import Review, review_run
from commviz.review.diff import ORIGIN, Diff, NoiseRule, diff_runs
from commviz.review.model.verdict import Verdict
from commviz.review.render.report_formats import TOP, ReportResult, render, write_review
from commviz.trace import run as loaded


class Run:
    """A run dir, its analyses as methods: ``Run("runs/job").verdict()``,
    ``.stragglers()``, ``.desyncs()``, ``.diff("runs/last_week")``, ``.report()``,
    ``.windows()``."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._reviews: dict[tuple[str | None, int, float], Review] = {}
        self._verdicts: dict[bool, Verdict | None] = {}

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r})"

    @cached_property
    def files(self) -> loaded.Run:
        """The run dir's records (a killed rank's from its journal), traces and stacks, read
        once (``commviz.trace.run``)."""
        return loaded.load_run(self.run_dir)

    def review(self, by: str | None = None, *,
               straggler_min_ns: int = inst_mod.STRAGGLER_MIN_NS,
               straggler_factor: float = inst_mod.STRAGGLER_FACTOR) -> Review:
        """Every analysis of ``commviz report`` (``by``: also roll communication up per origin
        or unit, ``review.analyses.origins.BY``); once per set of arguments."""
        key = (by, straggler_min_ns, straggler_factor)
        if key not in self._reviews:
            self._reviews[key] = review_run(self.run_dir, by=by, run=self.files,
                                            straggler_min_ns=straggler_min_ns,
                                            straggler_factor=straggler_factor)
            self._verdicts.setdefault(False, self._reviews[key].verdict)
        return self._reviews[key]

    def verdict(self, *, live: bool = False) -> Verdict | None:
        """Why the job hung or died (None: every rank completed what it began and none died);
        ``live``: the job still runs (its records are its journals, no rank was killed). After
        the job, how each rank ended is read from the logs its launch left."""
        if live not in self._verdicts:
            exits = None if live else read_exits(self.run_dir)
            self._verdicts[live] = build_verdict(self.run_dir, exits, live=live, run=self.files)
        return self._verdicts[live]

    def instances(self) -> list[Instance]:
        """Every collective instance over its ranks (``merge.instances``), in time order."""
        return self.review().instances

    def stragglers(self) -> list[Instance]:
        """The instances a late rank held up (``Instance.straggler``), the longest skew first."""
        return sorted((i for i in self.instances() if i.straggler is not None),
                      key=lambda i: (-i.skew_ns, i.pg, i.seq))

    def desyncs(self) -> list[Desync]:
        """Each process group's first disagreement across its ranks (none: they agree)."""
        return self.review().desyncs

    def windows(self) -> WholeRun | None:
        """The windows a watcher kept while the job ran, and the slowdowns named in them
        (None: no watcher kept any)."""
        return self._windows

    @cached_property
    def _windows(self) -> WholeRun | None:
        return read_whole_run(self.run_dir)

    def diff(self, baseline: Run | str | os.PathLike[str], by: str = ORIGIN,
             rule: NoiseRule = NoiseRule()) -> Diff:
        """What changed from ``baseline`` to this run, per ``by`` (both merged: their comm
        tables are read), as ``commviz diff BASELINE RUN``."""
        base = baseline.run_dir if isinstance(baseline, Run) else Path(baseline)
        return diff_runs(base, self.run_dir, by, rule)

    def report(self, fmt: str = "markdown", *, top: int = TOP, by: str | None = None) -> str:
        """The report as text (``table``, ``markdown`` or ``json``), without its plots."""
        return render(self.review(by), fmt, top=top)

    def write_report(self, *, fmt: str = "table", plots_dir: str | Path | None = None,
                     out: str | Path | None = None, plots: bool = True, top: int = TOP,
                     by: str | None = None, **thresholds: Any) -> ReportResult:
        """``commviz report``: the report written into the run dir (or ``out``) with its plots."""
        return write_review(self.review(by, **thresholds), fmt=fmt, plots_dir=plots_dir,
                            out=out, plots=plots, top=top)
