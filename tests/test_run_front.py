"""``commviz.Run``, the front over a run dir, in process on synthetic run dirs
(``synthetic_run``): each method names what was planted (a late rank, a rank with other sizes,
a rank that never arrived), each analysis is made once, and ``commviz report`` writes what
``Run.report`` renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from synthetic_run import CALLSITE, JITTER_NS, write_run

import commviz
from commviz.cli import main
from commviz.review.analyses.desync import DesyncKind
from commviz.review.diff import Change
from commviz.review.model.verdict import FailureKind

LATE_NS = 30_000_000


@pytest.fixture
def planted(tmp_path: Path) -> commviz.Run:
    """Rank 2 arrives 30 ms late at #8; rank 3 calls #10 with twice the elements."""
    return commviz.Run(write_run(tmp_path / "planted", late={8: (2, LATE_NS)},
                                 size=(10, 3, 2048)))


def test_the_front_is_served_lazily_by_commviz() -> None:
    assert commviz.Run.__module__ == "commviz.review.front" and "Run" in commviz.__all__


def test_stragglers_name_the_planted_late_rank(planted: commviz.Run) -> None:
    (late,) = planted.stragglers()
    assert (late.seq, late.straggler, late.late_rank) == (8, 2, 2)
    assert late.skew_ns == LATE_NS + 2 * JITTER_NS       # the planted lateness over rank 0
    assert len(planted.instances()) == 12


def test_desyncs_and_the_verdict_name_the_planted_sizes(planted: commviz.Run) -> None:
    (d,) = planted.desyncs()
    assert (d.seq, d.kind, sorted(s.ranks for s in d.sides)) == \
        (10, DesyncKind.SIZE, [(0, 1, 2), (3,)])
    v = planted.verdict()
    assert v is not None and (v.kind, v.culprits, v.root.seq) == \
        (FailureKind.SIZE_MISMATCH, (3,), 10)


def test_the_rank_that_never_arrived_is_the_culprit(tmp_path: Path) -> None:
    run = commviz.Run(write_run(tmp_path / "stuck", stuck=(9, 1)))
    v = run.verdict()
    assert v is not None and v.culprits == (1,)
    assert (v.root.seq, v.root.missing) == (9, (1,))


def test_a_clean_run_has_nothing_to_tell(tmp_path: Path) -> None:
    run = commviz.Run(write_run(tmp_path / "clean"))
    assert (run.verdict(), run.desyncs(), run.stragglers(), run.windows()) == (None, [], [], None)


def test_each_analysis_is_made_once(planted: commviz.Run) -> None:
    review = planted.review()
    assert planted.review() is review and planted.files is planted.files
    assert planted.verdict() is review.verdict               # the review's, not judged again
    assert planted.review(by="origin") is not review and planted.review(by="origin").origins


def test_diff_names_the_late_rank_against_a_baseline(tmp_path: Path) -> None:
    """Rank 2 late by 30 ms in every collective after the first: B's waiting grew at the
    planted call site, and for rank 2."""
    base = write_run(tmp_path / "base")
    slow = commviz.Run(write_run(tmp_path / "slow",
                                 late={s: (2, LATE_NS) for s in range(2, 13)}))
    d = slow.diff(base)
    (row,) = d.of(Change.REGRESSION)
    assert (row.key, row.late_ranks, row.cause) == (CALLSITE, [2], "waiting")
    assert d.a.run_dir == base and d.b.run_dir == slow.run_dir


def test_the_report_command_writes_what_the_front_renders(planted: commviz.Run,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert main(["report", str(planted.run_dir), "--format", "json", "-o", str(out),
                 "--no-plots"]) == 0
    assert json.loads(out.read_text()) == json.loads(planted.report("json"))
