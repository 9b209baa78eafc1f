"""The fault suite (``scripts/faults``) as tests: real 4-rank gloo jobs, a fault of each kind
injected from outside the program at a seed-chosen rank and onset, two seeds a kind (a planted
sleep, a cgroup CPU quota cut, a tbf-shaped veth in a network namespace, SIGSTOP/SIGCONT, a
shaped pipeline link), read by ``commviz watch``'s own windows while the job runs. The expected
name is the planted fault's rank and cause (``Plan.expected``), never commviz's output; no fault
planted: nobody named. The bench's "within 2 windows" is not asserted here (load can cross
it): a trial with a fault watches ``PATIENCE`` windows past the onset's and the rank must be
named in one of them. ``scripts/bench_faults.py`` runs the same trials ten seeds a kind and
counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "scripts"))

from faults import trial  # noqa: E402
from faults.inject import can_inject  # noqa: E402

WHY_NOT = can_inject()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
SEEDS = (1, 2)
PATIENCE = trial.DEADLINE + 2
SLOW = {"compute"}          # a DDP job: twice the others' time, one seed
# A throttled DDP rank runs in bursts and is last in fewer instances than a late rank: the
# watcher names it in 8 of 10 bench trials (docs/faults.md), short of the 0.95 target (issue 52
# stays open); a miss here is that known shortfall, a pass is counted as one
SHORT = {"compute": "a CPU-throttled DDP rank is named in 8 of 10 bench trials (docs/faults.md)"}
FAULTS = [pytest.param(k.name, s, marks=[pytest.mark.xfail(reason=SHORT[k.name], strict=False)]
                       if k.name in SHORT else [])
          for k in trial.KINDS.values() if k.cause
          for s in SEEDS[:1 if k.name in SLOW else None]]
NO_FAULT = [(k.name, s) for k in trial.KINDS.values() if not k.cause for s in SEEDS]


@pytest.fixture(scope="module")
def launcher():
    with trial.Launcher() as launcher:
        yield launcher


def _show(res: trial.Result) -> list:
    return [(i, w["stragglers"]) for i, w in enumerate(res.windows)]


@pytest.mark.parametrize("kind,seed", FAULTS)
def test_the_planted_rank_and_cause_are_named(launcher, tmp_path: Path, kind: str, seed: int):
    res = trial.run(launcher, kind, seed, tmp_path / "run", after=PATIENCE)
    assert res.injected and res.onset_window is not None
    assert res.latency is not None, (res.plan.expected, res.onset_window, _show(res))
    assert not res.wrong_names and not res.false_names, (res.plan.expected, res.onset_window,
                                                         _show(res))


@pytest.mark.parametrize("kind,seed", NO_FAULT)
def test_nobody_is_named_without_a_slow_rank(launcher, tmp_path: Path, kind: str, seed: int):
    res = trial.run(launcher, kind, seed, tmp_path / "run")
    assert res.injected and res.onset_window is not None    # "shaped": every shaper bit
    assert not res.false_names, _show(res)
