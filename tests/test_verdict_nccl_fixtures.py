"""Issue 23's verdict on real NCCL runs, checked without a GPU.

``fixtures/gpu/verdict-2xh100/``: the run dirs (records, journals, stacks, torch's Flight
Recorder dumps, the launch's logs and output) of every scenario of ``tests/jobs/broken_step.py``
launched on 2 x H100 by ``scripts/gpu_verdict.sh`` (its README says how), the job as it ran, and
``repo.txt``, where the repository was on that machine. The checks are
``tests/test_gpu_verdict.py``'s (``tests/nccl_verdict.py``); torch's analyzer runs here on the
dumps NCCL wrote there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nccl_verdict import (BAD, CASES, JOB_NAME, KIND, check_agrees_with_flight_recorder,
                          check_verdict, flight, launch_verdict, relocated_copy, unrecorded)

from commviz.review.model.verdict import CallState
from commviz.review.analyses.judge import build_verdict

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "tests" / "fixtures" / "gpu" / "verdict-2xh100"
RACES = REPO / "tests" / "fixtures" / "gpu" / "verdict-4xh200"
JOB = KEPT / JOB_NAME
# run dir -> scenario: the second GPU run's, the first run's size mismatch, in which the
# 16-element rank's watchdog acted first (the second run's: the other's), and a kill on
# 4 x H200 in which the killed rank died before its GPU finished the subgroup's #5 it had
# queued (its own folder: that machine's checkout was elsewhere)
RUNS = {**{case: case for case in CASES}, "size-run1": "size", "kill-race": "kill"}
WHERE = {"kill-race": RACES}


@pytest.fixture
def run_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return relocated_copy(WHERE.get(request.param, KEPT), request.param, tmp_path, REPO)


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_verdict_agrees_with_flight_recorder(run_dir: Path, tmp_path: Path) -> None:
    check_agrees_with_flight_recorder(RUNS[run_dir.name], launch_verdict(run_dir),
                                      flight(run_dir, tmp_path / "fr"), run_dir, JOB)


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_nothing_recorded_is_lost(run_dir: Path, tmp_path: Path) -> None:
    """Every Flight Recorder entry has its record, with the same op, sizes and group."""
    fl = flight(run_dir, tmp_path / "fr")
    assert fl.dumps and unrecorded(run_dir, fl.dumps) == {r: [] for r in fl.dumps}


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_verdict_names_the_culprit_and_where_it_was(run_dir: Path) -> None:
    check_verdict(RUNS[run_dir.name], launch_verdict(run_dir), run_dir, JOB, printed=False)


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_report_opens_with_the_verdict(run_dir: Path) -> None:
    """``commviz report RUN_DIR`` opens with the scenario's kind and culprit: a mismatch of two
    ranks names both. In ``raise`` rank 1 left no stacks of its raise (only live ones): how it
    ended comes from the logs the launch left (its failure file), as the launch's did."""
    case = RUNS[run_dir.name]
    got = subprocess.run([sys.executable, "-m", "commviz", "report", str(run_dir), "--no-plots"],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    culprits = f"0-{BAD}" if case in ("type", "size") else f"{BAD}"
    assert got.stdout.splitlines()[0] == f"VERDICT: {KIND[case]} - culprit rank(s) {culprits}", \
        got.stdout[:3000]


@pytest.mark.parametrize("run_dir", RUNS, indirect=True)
def test_no_collective_of_a_rank_without_a_dump_reads_completed(run_dir: Path,
                                                                 tmp_path: Path) -> None:
    """NCCL returns once a collective is queued. Where torch's Flight Recorder left no dump of
    a rank (it was killed, or died first), nothing says its queued collectives ran: none of them
    reads "completed" (in kill-race rank 0's dump has the subgroup's #5 never started, so rank
    1's #5, which its record has returned, cannot have completed). A rank with a dump reads
    what the dump says."""
    dumps = flight(run_dir, tmp_path / "fr").dumps          # torch's own dumps, as written
    verdict = build_verdict(run_dir)
    assert verdict is not None
    dumpless = [r for r in verdict.ranks if r not in dumps]
    assert bool(dumpless) == (RUNS[run_dir.name] in ("kill", "graph")), (dumpless, sorted(dumps))
    for r, s in verdict.ranks.items():
        if s.last is None or s.last.channel is not None:
            continue
        if r in dumps:
            assert s.last.state is not CallState.QUEUED
        else:
            assert s.last.state not in (CallState.COMPLETED, CallState.ENQUEUED), (r, s.last)
