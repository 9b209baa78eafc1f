"""``tests/jobs/broken_mesh.py``'s scenarios (4 ranks where the groups chain: tp pairs [0, 1],
[2, 3], dp pairs [0, 2], [1, 3]) as a user launches them, and the checks of their verdict
against torch's Flight Recorder analyzer on the same runs.

``tests/test_gpu_verdict_4x.py`` launches them on 4 GPUs (NCCL) and checks them;
``tests/test_verdict_mesh_fixtures.py`` runs the same checks on CPU on the run dirs kept from
such a machine (``fixtures/gpu/verdict-4xh100``, ``scripts/gpu_verdict.sh 4x``).

What is expected comes from the scenario (which rank breaks, how, on which line of the job)
and from torch: its analyzer (``python -m torch.distributed.flight_recorder.fr_trace``) on the
dumps in ``RUN_DIR/flight_recorder``, or those dumps' raw entries. Never from commviz.
"""

from __future__ import annotations

from pathlib import Path

from nccl_verdict import STATUS_LIVE, STDOUT, Flight, printed_verdict

from commviz.review.model.verdict import FailureKind, Verdict
from commviz.review.render.verdict_text import verdict_text

JOBS = Path(__file__).parent / "jobs"
CONFIG = JOBS / "broken_mesh.yaml"
JOB_NAME = "broken_mesh.py"
CASES = ("tp_stuck", "pp_raise", "a2a_splits")
BAD, AT_STEP = 1, 5                      # broken_mesh.yaml: rank 1 breaks in step 5
KIND = {"tp_stuck": FailureKind.HANG, "pp_raise": FailureKind.CRASH,
        "a2a_splits": FailureKind.SIZE_MISMATCH}
# the line of broken_mesh.py each broken rank was on: the scenario's own
LINE = {"tp_stuck": "# stuck in its own code", "pp_raise": "raise RuntimeError(",
        "a2a_splits": "ctx.dist.all_to_all_single(out, x, recv, send"}
STATUS_AFTER_S = {"tp_stuck": 6.0}       # asked live, before NCCL's watchdog (job.timeout_s 20)


def scenario_line(case: str, job: Path = JOBS / JOB_NAME) -> int:
    text = job.read_text()
    return text.count("\n", 0, text.index(LINE[case])) + 1


def check_agrees_with_flight_recorder(case: str, v: Verdict | None, fl: Flight) -> None:
    """Flight Recorder's analyzer names the broken collective (group, number) and its missing
    or mismatched ranks; the verdict's root is that collective."""
    assert v is not None and v.root is not None, fl.findings
    if case == "tp_stuck":
        # the tp pair [0, 1]'s all_reduce of step 5: rank 1 never called it
        assert fl.findings is not None
        key = ("tp", AT_STEP)
        assert fl.findings.get(key, (set(), set()))[0] == {BAD}, fl.findings
        assert (v.root.pg_desc, v.root.seq, set(v.root.missing)) == ("tp", AT_STEP, {BAD}), \
            verdict_text(v)
    elif case == "a2a_splits":
        # the world's dispatch all_to_all of step 5 (each step: counts, then tokens)
        assert fl.findings is not None
        key = ("default_pg", 2 * AT_STEP)
        assert key in fl.findings, fl.findings
        assert (v.root.pg_desc, v.root.seq) == key, verdict_text(v)


def check_verdict(case: str, v: Verdict | None, run_dir: Path, job: Path = JOBS / JOB_NAME
                  ) -> None:
    """Beyond Flight Recorder: why (the kind), who (the culprit) and where the culprit was
    (``job``: the job as it ran, whose lines the stacks name)."""
    assert v is not None, f"no verdict on {run_dir}"
    text = verdict_text(v)
    assert v.kind is KIND[case] and v.culprits == (BAD,), text
    stopped = v.ranks[BAD].stopped_at
    assert stopped is not None and (Path(stopped.file).name, stopped.line) == \
        (JOB_NAME, scenario_line(case, job)), text
    if case == "tp_stuck":            # the other pair waits in dp, on the first pair
        waiting = {r for inc in v.consequences if inc.pg_desc == "dp" for r in inc.calls}
        assert {2, 3} <= waiting, text


def check_live(case: str, run_dir: Path) -> None:
    """The hang, told while the job still ran: the launch's hang watch (``--hang-after``)
    printed a verdict naming the culprit before NCCL's watchdog ended the job, and ``commviz
    status`` named it too."""
    if case != "tp_stuck":
        return
    out = (run_dir / STDOUT).read_text()
    first = out.index("VERDICT:")
    assert "culprit rank(s) 1" in out[first:first + 200], out[first:first + 500]
    status = (run_dir / STATUS_LIVE).read_text()
    assert "job still running: True" in status and "rank 1" in status, status


def check_printed(case: str, v: Verdict, run_dir: Path) -> None:
    assert printed_verdict(run_dir)[:1] == verdict_text(v).splitlines()[:1]
