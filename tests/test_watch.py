"""``commviz watch`` against live jobs: the late rank and the line it was late to, named while
the job runs, from the always-on record alone; nobody named in a healthy run; a watcher killed
mid-run changes nothing for the job; a corrupt or half-written journal is one line.

The job (``tests/jobs/late_allreduce.py``, 4 gloo ranks, no profiler, 120 steps of three
all_reduces on three lines) makes one rank sleep 20 ms before one all_reduce from step 60 on,
and writes down itself which rank, which line, and when it first slept (``late.json``). Every
expected value comes from that file or from counting what the program does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO, free_port

from commviz.live.cause import MIN_LATE

JOB = REPO / "tests" / "jobs" / "late_allreduce.py"
COMMVIZ = [sys.executable, "-m", "commviz"]
STEPS, LATE_RANK, LATE_FROM, STEP_S = 120, 2, 60, 0.1
CALLS_PER_STEP = 3                 # the program's three all_reduce lines
WINDOW_S = 2.0


def _start_job(run_dir: Path, late_rank: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
           f"--master_port={free_port()}", str(JOB), str(run_dir), str(STEPS), str(late_rank),
           str(LATE_FROM), str(STEP_S), "3"]       # flush every 3 s: journals rotate meanwhile
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _watch_once(run_dir: Path) -> dict:
    proc = subprocess.run([*COMMVIZ, "watch", str(run_dir), "--once", "--format", "json",
                           "--interval", str(WINDOW_S)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _watch_during(job: subprocess.Popen, run_dir: Path, snapshot: Path | None = None
                  ) -> list[dict]:
    """``watch --once`` again and again while the job runs (real subprocesses against the
    live run dir); a continuous watcher runs beside them, hangs (SIGSTOP) and is killed mid-run
    (a healthy run never changes: it runs to the end); ``snapshot``:
    a copy of the live journals is taken there once they hold calls."""
    seen: list[dict] = []
    keeper = None
    stopped = False
    while job.poll() is None:
        if not any(run_dir.glob("commviz_rank*.journal")) and not seen:
            time.sleep(0.2)                            # not recording yet
            continue
        if keeper is None:
            keeper = subprocess.Popen([*COMMVIZ, "watch", str(run_dir), "--interval", "1",
                                       "--format", "json"], cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not stopped and _changed_for(run_dir, 4.0):
            keeper.send_signal(signal.SIGSTOP)         # hung mid-run, its files held open
            stopped = True
        if keeper.poll() is None and _changed_for(run_dir, 6.0):
            keeper.send_signal(signal.SIGKILL)         # then killed: the job goes on
            keeper.wait()
        if snapshot is not None and not snapshot.exists() and len(seen) > 2:
            _copy_journals(run_dir, snapshot)
        out = _watch_once(run_dir)
        if out["ranks"]:
            seen.append(out)
    if keeper is not None and keeper.poll() is None:
        keeper.kill()
        keeper.wait()
    return seen


def _changed_for(run_dir: Path, seconds: float) -> bool:
    """Whether the late rank began sleeping at least ``seconds`` ago (healthy: never)."""
    try:
        return time.time_ns() - json.loads((run_dir / "late.json").read_text())["time_ns"] \
            >= seconds * 1e9
    except (FileNotFoundError, ValueError):
        return False


def _copy_journals(run_dir: Path, to: Path) -> None:
    to.mkdir()
    for path in run_dir.glob("commviz_rank*.*"):
        if path.suffix in (".journal", ".calls"):
            try:
                shutil.copy(path, to / path.name)
            except FileNotFoundError:           # a generation dropped meanwhile
                pass


def _records(run_dir: Path) -> dict[int, list[dict]]:
    from commviz.record.store import load_record

    return {r: load_record(run_dir / f"commviz_rank{r}.pkl")["collectives"] for r in range(4)}


def _instances(out: dict, line: str) -> int:
    """The window's instances of the collective issued at ``line``."""
    return sum(r["window"]["instances"] for r in out["origins"]
               if r["origin"] and r["origin"].endswith(line))


def _named(out: dict) -> set[tuple[int, str]]:
    return {(s["rank"], s["origin"]) for s in out["stragglers"]}


@pytest.mark.slow
def test_watch_names_the_late_rank_and_line_while_the_job_runs(tmp_path):
    run_dir = tmp_path / "late"
    job = _start_job(run_dir, LATE_RANK)
    seen = _watch_during(job, run_dir, snapshot=tmp_path / "snapshot")
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out.decode()            # the killed watcher changed nothing

    late = json.loads((run_dir / "late.json").read_text())   # the program's own account
    assert late["rank"] == LATE_RANK
    line = f"{Path(late['file']).name}:{late['line']}"
    assert Path(late["file"]).read_text().splitlines()[late["line"] - 1].strip().startswith(
        "dist.all_reduce(x)")
    change, window_ns = late["time_ns"], WINDOW_S * 1e9
    before = [o for o in seen if o["end_ns"] < change]
    # the windows from the second after the change on (each lies wholly after it), with
    # enough instances of that line to name anyone (a --once reads the journals' current
    # generations: just after a flush it has less than a window): every one names the rank
    later = [o for o in seen if o["start_ns"] >= change + window_ns
             and _instances(o, line) >= MIN_LATE]
    assert before and later, [((o["start_ns"] - change) / 1e9, _instances(o, line)) for o in seen]
    assert all(not o["stragglers"] for o in before), [o["stragglers"] for o in before]
    for o in later:
        assert any(r == LATE_RANK and origin.endswith(line) for r, origin in _named(o)), (
            (o["start_ns"] - change) / 1e9, o["stragglers"], [
                (r["origin"], r["window"]["instances"], r["window"]["skew_p50_ns"])
                for r in o["origins"]])
    assert all(r == LATE_RANK and origin.endswith(line)     # nobody else, nothing else
               for o in seen for r, origin in _named(o)), [o["stragglers"] for o in seen]
    first = later[0]
    s = next(s for s in first["stragglers"] if s["rank"] == LATE_RANK)
    assert s["skew_ns"] >= 15_000_000 and s["cost_ns"] >= s["late_in"] * 15_000_000
    assert first["times"] == "cpu"

    # every rank's record: 3 all_reduces a step, numbered 1..360, as the program made them
    for rank, calls in _records(run_dir).items():
        seqs = sorted(c["commviz.seq"] for c in calls if c["commviz.op"] == "all_reduce")
        assert seqs == list(range(1, STEPS * CALLS_PER_STEP + 1)), rank

    # the windows the killed watcher kept, and the report's "over the whole run"
    kept = run_dir / "windows.jsonl"
    assert len(kept.read_bytes().split(b"\n")) > 3
    with kept.open("ab") as f:                # a watcher killed mid-line leaves a torn line
        f.write(b'{"schema": "commviz.window", "vers')
    report = subprocess.run([*COMMVIZ, "report", str(run_dir), "--format", "markdown"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode in (0, 1), report.stderr
    text = (run_dir / "report.md").read_text()
    whole = text[text.index("## Over the whole run"):]
    assert f"rank {LATE_RANK}" in whole and line in whole and "torn last line" in whole
    assert (run_dir / "plots" / "windows.png").stat().st_size > 0

    _corrupt_journals_are_one_line(tmp_path / "snapshot", tmp_path)


def _corrupt_journals_are_one_line(snapshot: Path, tmp_path: Path) -> None:
    """A journal cut inside an entry, and one with bytes overwritten: each one line naming
    the file; the other ranks are still read."""
    assert sorted(p.name for p in snapshot.glob("*.journal"))
    for how in ("cut", "garbage"):
        run = tmp_path / how
        shutil.copytree(snapshot, run)
        victim = max(run.glob("commviz_rank1.*.journal"), key=lambda p: int(p.name.split(".")[1]))
        data = bytearray(victim.read_bytes())
        length = struct.unpack_from("<I", data, 0)[0]      # the first entry: <u32 length><u8>
        second = 5 + length
        if how == "cut":
            victim.write_bytes(bytes(data[:second + 5 + 3]))     # 3 bytes into the 2nd body
        else:
            data[second:second + 5] = b"\xff\xff\xff\x7fZ"
            victim.write_bytes(bytes(data))
        proc = subprocess.run([*COMMVIZ, "watch", str(run), "--once", "--format", "json",
                               "--interval", "3600"], capture_output=True, text=True,
                              timeout=60, cwd=REPO)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        out = json.loads(proc.stdout)
        assert len(out["problems"]) == 1 and victim.name in out["problems"][0], out["problems"]
        assert out["ranks"] == [0, 2, 3]                  # rank 1's newest journal given up
        assert out["groups"] and out["groups"][0]["window"]["instances"] > 0


@pytest.mark.slow
def test_watch_names_nobody_in_a_healthy_run(tmp_path):
    run_dir = tmp_path / "healthy"
    job = _start_job(run_dir, -1)
    seen = _watch_during(job, run_dir)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out.decode()
    assert len(seen) >= 3
    assert [o["stragglers"] for o in seen if o["stragglers"]] == []
    kept = [json.loads(line) for line in (run_dir / "windows.jsonl").read_text().splitlines()]
    assert kept and [w["stragglers"] for w in kept if w["stragglers"]] == []
    assert sum(o["groups"][0]["window"]["instances"] for o in seen if o["groups"]) > 0


@pytest.mark.slow
def test_launch_shows_the_watch_and_keeps_its_windows(tmp_path):
    """``commviz launch`` with ``live.watch``: the late rank and its line said while torchrun
    runs, and every instance of the job in the windows it kept (a last look once the job
    ended reads the journals' last calls through the files still open)."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*COMMVIZ, "launch", str(REPO / "tests" / "jobs" / "late_allreduce.yaml"),
         "--set", f"output.dir={tmp_path}", "--set", "output.run_name=run",
         "--set", f"workload.args.out={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    late = json.loads((run_dir / "late.json").read_text())
    line = f"{Path(late['file']).name}:{late['line']}"
    assert f"LATE: rank {late['rank']} to {line} in default_pg" in out, out
    from commviz.live import series

    kept, notes = series.read(run_dir / "windows.jsonl")
    assert not notes
    assert all(not w["stragglers"] for w in kept if w["end_ns"] < late["time_ns"])
    first = next(w for w in kept if w["stragglers"])
    assert first["end_ns"] - late["time_ns"] <= 2 * 1e9              # live.watch_interval_s: 1
    assert {(s["rank"], s["origin"]) for w in kept for s in w["stragglers"]} == {
        (late["rank"], line)}
    world = sum(r["window"]["instances"] for w in kept for r in w["groups"]
                if r["label"] == "default_pg")
    assert world == 120 * CALLS_PER_STEP                    # steps x the program's all_reduces
    report = subprocess.run([*COMMVIZ, "report", str(run_dir), "--format", "json"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode in (0, 1), report.stderr
    (down,) = json.loads((run_dir / "report.json").read_text())["whole_run"]["slowdowns"]
    assert (down["rank"], down["origin"], down["began_window"]) == (
        late["rank"], line, first["index"])
