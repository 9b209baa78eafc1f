"""GPU (2 GPUs, NCCL): issue 23's verdict on real broken NCCL jobs, against torch's Flight
Recorder on the same runs, and a hang inside CUDA-graph replays.

Every scenario of ``tests/jobs/broken_step.py`` is launched as a user does (``commviz launch
tests/jobs/broken_step.yaml --set workload.args.case=CASE``), all at once, each 2 ranks on the
same 2 GPUs: NCCL's watchdog (15 s, then torch 2.11 waits 60 s for the dumps) ends the eager
hangs and dumps the Flight Recorder; the graph hang, which no watchdog sees, is ended by a
Ctrl-C on the launch. ``tests/nccl_verdict.py`` holds the checks, which
``test_verdict_nccl_fixtures.py`` also runs on CPU, on run dirs kept from such a machine.
``COMMVIZ_GPU_KEEP=DIR`` keeps the run dirs in ``DIR/gpu_verdict`` (``scripts/gpu_verdict.sh``
packs them for ``tests/fixtures/gpu/verdict-2xh100``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nccl_verdict import (CASES, JOBS, JOB_NAME, STDOUT, check_agrees_with_flight_recorder,
                          check_verdict, flight, launch_all, launch_verdict, unrecorded)

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.timeout(420)]
JOB = JOBS / JOB_NAME


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from commviz.record import boundary

    keep = os.environ.get("COMMVIZ_GPU_KEEP")
    root = Path(keep) / "gpu_verdict" if keep else tmp_path_factory.mktemp("verdict")
    assert boundary.prebuild() is None          # built once here, not by seven launches at once
    codes = launch_all(root)
    # every scenario fails the job: NCCL runs a mismatch into its watchdog's timeout too
    assert all(codes[c] != 0 for c in CASES), \
        {c: (root / c / STDOUT).read_text()[-2000:] for c in CASES if codes[c] == 0}
    return root


@pytest.mark.parametrize("case", CASES)
def test_verdict_agrees_with_flight_recorder(runs: Path, case: str, tmp_path: Path) -> None:
    run_dir = runs / case
    check_agrees_with_flight_recorder(case, launch_verdict(run_dir),
                                      flight(run_dir, tmp_path / "fr"), run_dir, JOB)


@pytest.mark.parametrize("case", CASES)
def test_nothing_recorded_is_lost(runs: Path, case: str, tmp_path: Path) -> None:
    """Every Flight Recorder entry has its record, with the same op, sizes and group."""
    fl = flight(runs / case, tmp_path / "fr")
    assert fl.dumps and unrecorded(runs / case, fl.dumps) == {r: [] for r in fl.dumps}


@pytest.mark.parametrize("case", CASES)
def test_verdict_names_the_culprit_and_where_it_was(runs: Path, case: str) -> None:
    check_verdict(case, launch_verdict(runs / case), runs / case, JOB)
