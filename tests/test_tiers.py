"""The fast tier (``pytest -m "not slow"``) holds no test that starts a process: conftest marks
each test that reaches one, in its code or its fixtures', through its module's functions and the
helpers of tests/ it imports."""

from __future__ import annotations

from pathlib import Path

from conftest import starting_names

TESTS = Path(__file__).resolve().parent


def test_a_job_through_a_fixture_or_a_helper_is_slow() -> None:
    verdict = starting_names(TESTS / "test_verdict.py")
    assert {"scenario", "test_first_rank_can_be_the_culprit"} <= verdict   # harness.torchrun
    assert "test_launch_prints_the_verdict_of_a_stuck_rank" in verdict     # subprocess.run
    assert {"run_ranks", "torchrun"} <= starting_names(TESTS / "harness.py")
    assert "real_record" in starting_names(TESTS / "test_records.py")     # imported in the def


def test_in_process_tests_stay_fast() -> None:
    assert starting_names(TESTS / "test_layering.py") == frozenset()
    journal = starting_names(TESTS / "test_journal.py")
    assert "test_flush_interrupting_add_does_not_deadlock" not in journal
    assert "free_port" not in starting_names(TESTS / "harness.py")
