"""The journal on a real gloo job killed with SIGKILL: every record made before the kill is kept.

``tests/jobs/stuck_rank.py`` notes each call it issues in a side file (its own count, not
commviz's), writes its record once midway, and leaves rank 1 hanging in a collective rank 0
never joins. Both ranks are then SIGKILLed: no handler runs, and only the journal can tell.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commviz import load_record
from commviz import metadata as md
from commviz.record import journal
from commviz.verify import verify_pftrace
from harness import REPO, free_port
from independent import flow_ends

JOB = REPO / "tests" / "jobs" / "stuck_rank.py"


def _issued(run_dir: Path, rank: int) -> list[str]:
    path = run_dir / f"issued_rank{rank}.txt"
    return path.read_text().split() if path.exists() else []


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("stuck")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(JOB), str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while len(_issued(run_dir, 1)) < 6 or not (run_dir / "ready_rank0").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "job ended early"
            time.sleep(0.1)
        time.sleep(1.0)                      # rank 1 is now inside the all_reduce nobody joins
        # rank 1 first: killed after rank 0, it could see its peer's connection close and
        # return from the call with gloo's error before its own kill arrives
        for rank in (1, 0):
            os.kill(int((run_dir / f"ready_rank{rank}").read_text()), signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir


def test_sigkill_keeps_every_record_made_before_it(killed: Path) -> None:
    for rank in (0, 1):
        issued = _issued(killed, rank)
        assert journal.journal_paths(killed, rank), f"rank {rank} left no journal"
        base = load_record(killed / f"commviz_rank{rank}.pkl")
        assert base["exit"] == "running" and len(base["collectives"]) == 2   # the midway write
        record, added = journal.recover(killed, rank, base)
        got = record["collectives"]
        assert added == len(issued) - 2
        assert [c[md.OP] for c in got] == issued            # every call, in order, none twice
        assert [c[md.SEQ] for c in got] == list(range(1, len(issued) + 1))
        assert all(c[md.RANK] == rank and c[md.PG_RANKS] == "[0, 1]" for c in got)
        assert all(md.T_BEGIN in c for c in got)
    stuck = journal.recover(killed, 1, load_record(killed / "commviz_rank1.pkl"))[0]
    # the call rank 1 hangs in is there; if it had not returned (c10d may return before the
    # collective completes), it ends when the process was last seen alive, and says so
    last = stuck["collectives"][-1]
    assert last[md.OP] == "all_reduce"
    assert all(c[md.T_END] >= c[md.T_BEGIN] for c in stuck["collectives"])
    if md.ERROR in last:
        assert last[md.ERROR] == journal.NEVER_RETURNED
        assert last[md.T_END] - last[md.T_BEGIN] >= 0.5e9     # it hung a second before the kill


def test_merge_rebuilds_killed_ranks_and_verifies(killed: Path, tmp_path: Path) -> None:
    from commviz.merge import merge_run

    run = tmp_path / "run"
    shutil.copytree(killed, run)
    result = merge_run(run, workers=1, progress=False)
    assert sum("rebuilt from its journal" in p for p in result.problems) == 2, result.problems
    report = verify_pftrace(result.out)
    assert report.ok, report.errors[:5]
    ends = flow_ends(result.out)
    assert ends and min(ends.values()) >= 2
    # every call is merged, the one rank 1 died in included
    assert result.stats["comm_events"] == len(_issued(run, 0)) + len(_issued(run, 1))


def test_write_recovered_leaves_pickles_only(killed: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    added = journal.write_recovered(run)
    assert added == {0: len(_issued(run, 0)) - 2, 1: len(_issued(run, 1)) - 2}
    assert not list(run.glob("*.journal"))
    for rank in (0, 1):
        record = load_record(run / f"commviz_rank{rank}.pkl")
        assert record["exit"] == journal.EXIT
        assert [c[md.OP] for c in record["collectives"]] == _issued(run, rank)


def test_torn_or_hostile_journal_reads_what_is_whole(killed: Path, tmp_path: Path) -> None:
    newest = journal.journal_paths(killed, 1)[-1]
    whole = journal.read_journal(newest).calls
    assert len(whole) >= 2
    torn = tmp_path / newest.name
    shutil.copy(newest, torn)
    # plain all_reduces are recorded by the boundary kernel: their entries are in the calls file
    entries = journal.calls_path(newest).read_bytes().rstrip(b"\0")
    journal.calls_path(torn).write_bytes(entries[:-5])   # the last call entry cut short
    assert [o for o, _ in journal.read_journal(torn).calls] == [o for o, _ in whole[:-1]]
    torn.write_bytes(newest.read_bytes().rstrip(b"\0")[:-3])   # the journal's tail cut too
    got = [o for o, _ in journal.read_journal(torn).calls]    # calls whose shape is whole
    assert got == [o for o, _ in whole[:len(got)]]
    evil = tmp_path / "commviz_rank7.1.journal"
    payload = b"cos\nsystem\n(S'touch /tmp/commviz-pwned'\ntR."      # a pickle, not JSON
    evil.write_bytes(journal.HEAD.pack(len(payload), journal.T_SHAPE) + payload)
    assert journal.read_journal(evil).calls == []
    assert not Path("/tmp/commviz-pwned").exists()


@pytest.mark.timeout(60)       # a deadlock waits forever: no bar on a loaded machine's time
def test_signal_flush_while_the_lock_is_held_writes_the_record(tmp_path: Path) -> None:
    """SIGTERM's whole flush (the record's payload too) on the thread that holds the
    recorder's lock, as when the signal lands while it records a call or flushes at exit."""
    import pickle

    from commviz.record.recorder import Recorder

    rec = Recorder(16)
    rec.run_dir = tmp_path
    done: list[Path | None] = []
    with rec._lock:                          # as if interrupted inside append or records()
        done.append(rec.flush("SIGTERM"))
    (path,) = done
    assert path is not None and pickle.loads(path.read_bytes())["exit"] == "SIGTERM"


@pytest.mark.timeout(60)
def test_flush_interrupting_add_does_not_deadlock(tmp_path: Path) -> None:
    """SIGTERM's flush runs on the thread that may be inside ``add``, holding the lock."""
    import threading

    lock = threading.Lock()
    j = journal.Journal(tmp_path, lock)
    with lock:                               # as if interrupted inside Recorder.append
        j.rotate()
        j.flushed(tmp_path)
    j.close()
