"""Issue 33's verdict on real 4-rank NCCL runs where the groups chain, checked without a GPU.

``fixtures/gpu/verdict-4xh100/``: the run dirs of every scenario of
``tests/jobs/broken_mesh.py`` launched on 4 x H100 by ``scripts/gpu_verdict.sh 4x`` (its README
says how), the job as it ran, and ``repo.txt``. The checks are ``tests/test_gpu_verdict_4x.py``'s
(``tests/mesh_verdict.py``); torch's analyzer runs here on the dumps NCCL wrote there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mesh_verdict as mv
from nccl_verdict import flight, launch_verdict, relocated_copy, unrecorded

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "tests" / "fixtures" / "gpu" / "verdict-4xh100"


@pytest.fixture
def run_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return relocated_copy(KEPT, request.param, tmp_path, REPO)


@pytest.mark.parametrize("run_dir", mv.CASES, indirect=True)
def test_verdict_agrees_with_flight_recorder(run_dir: Path, tmp_path: Path) -> None:
    mv.check_agrees_with_flight_recorder(run_dir.name, launch_verdict(run_dir),
                                         flight(run_dir, tmp_path / "fr"))


@pytest.mark.parametrize("run_dir", mv.CASES, indirect=True)
def test_nothing_recorded_is_lost(run_dir: Path, tmp_path: Path) -> None:
    """Every Flight Recorder entry has its record, with the same op, sizes and group."""
    fl = flight(run_dir, tmp_path / "fr")
    assert fl.dumps and unrecorded(run_dir, fl.dumps) == {r: [] for r in fl.dumps}


@pytest.mark.parametrize("run_dir", mv.CASES, indirect=True)
def test_verdict_names_the_culprit_and_where_it_was(run_dir: Path) -> None:
    mv.check_verdict(run_dir.name, launch_verdict(run_dir), run_dir, KEPT / mv.JOB_NAME)


@pytest.mark.parametrize("run_dir", mv.CASES, indirect=True)
def test_told_live(run_dir: Path) -> None:
    mv.check_live(run_dir.name, run_dir)


@pytest.mark.parametrize("run_dir", mv.CASES, indirect=True)
def test_report_opens_with_the_verdict(run_dir: Path) -> None:
    got = subprocess.run([sys.executable, "-m", "commviz", "report", str(run_dir), "--no-plots"],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.splitlines()[0] == \
        f"VERDICT: {mv.KIND[run_dir.name]} - culprit rank(s) {mv.BAD}", got.stdout[:3000]
