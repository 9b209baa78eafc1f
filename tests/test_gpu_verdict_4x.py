"""GPU (4 GPUs, NCCL): the verdict on 4 ranks where the groups chain (issue 33), against
torch's Flight Recorder analyzer on the same runs, live and after the teardown.

Every scenario of ``tests/jobs/broken_mesh.py`` is launched as a user does (``commviz launch
tests/jobs/broken_mesh.yaml --set workload.args.case=CASE --hang-after 4``), all at once, each
4 ranks on the same 4 GPUs; ``commviz status`` is asked while the hang goes on. The checks are
``tests/mesh_verdict.py``'s, which ``test_verdict_mesh_fixtures.py`` also runs on CPU on run
dirs kept from such a machine (``COMMVIZ_GPU_KEEP=DIR`` keeps them in ``DIR/gpu_verdict_4x``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mesh_verdict as mv
from nccl_verdict import flight, launch_all, launch_verdict

pytestmark = [pytest.mark.gpu(count=4), pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from commviz.record import boundary

    keep = os.environ.get("COMMVIZ_GPU_KEEP")
    root = Path(keep) / "gpu_verdict_4x" if keep else tmp_path_factory.mktemp("verdict4")
    assert boundary.prebuild() is None
    codes = launch_all(root, mv.CASES, config=mv.CONFIG, status_after_s=mv.STATUS_AFTER_S)
    assert all(codes[c] != 0 for c in mv.CASES), codes
    return root


@pytest.mark.parametrize("case", mv.CASES)
def test_verdict_agrees_with_flight_recorder(runs: Path, case: str, tmp_path: Path) -> None:
    mv.check_agrees_with_flight_recorder(case, launch_verdict(runs / case),
                                         flight(runs / case, tmp_path / "fr"))


@pytest.mark.parametrize("case", mv.CASES)
def test_verdict_names_the_culprit_and_where_it_was(runs: Path, case: str) -> None:
    mv.check_verdict(case, launch_verdict(runs / case), runs / case)


@pytest.mark.parametrize("case", mv.CASES)
def test_told_live_and_printed(runs: Path, case: str) -> None:
    v = launch_verdict(runs / case)
    mv.check_live(case, runs / case)
    mv.check_printed(case, v, runs / case)
