"""``tests/jobs/broken_step.py``'s scenarios on NCCL, as a user launches them (``commviz launch
tests/jobs/broken_step.yaml``, 2 ranks, one GPU each), and the checks of their verdict against
torch's Flight Recorder on the same run.

``tests/test_gpu_verdict.py`` launches them on 2 GPUs and checks them; the CPU test
``tests/test_verdict_nccl_fixtures.py`` runs the same checks on the run dirs kept from such a
machine (``fixtures/gpu/verdict-2xh100``, ``scripts/gpu_verdict.sh``).

What is expected comes from the scenario (which rank breaks, how, on which line of the job)
and from torch: its analyzer (``python -m torch.distributed.flight_recorder.fr_trace``) on the
dumps in ``RUN_DIR/flight_recorder`` (NCCL's own, written on its watchdog's timeout, or the
launch's when a rank stops), or those dumps' raw entries. Never from commviz.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from fr_compare import differences, from_dump
from test_verdict import fr_entries, fr_findings

from commviz import metadata as md
from commviz.launch import outcome
from commviz.record import stacks as st
from commviz.review.analyses import flightrec
from commviz.review.model.verdict import FailureKind, Verdict
from commviz.review.analyses.judge import build_verdict
from commviz.review.render.verdict_text import verdict_text
from commviz.trace.run import load_run

JOBS = Path(__file__).parent / "jobs"
CONFIG = JOBS / "broken_step.yaml"
JOB_NAME = "broken_step.py"
CASES = ("stuck", "type", "size", "raise", "kill", "skip", "graph")
BAD, AT_SEQ = 1, 5                       # broken_step.yaml: rank 1 breaks in call 5
HANG_AFTER_S = 4                         # the launch's live hang watch (--hang-after)
MARK = "broke.txt"                       # broken_step.py writes it as the rank breaks
STDOUT = "stdout.txt"                    # what the launch printed
STATUS_LIVE = "status_live.txt"          # what `commviz status` said while the job hung
# the graph hang is stopped from outside (NCCL's watchdog never sees it): Ctrl-C on the
# launch (SIGINT to its process group) this long after the rank stopped replaying, time
# enough for the hang watch to speak if it can
GRAPH_STOP_AFTER_S = 3 * HANG_AFTER_S + 3
LAUNCH_TIMEOUT_S = 240
KIND = {"stuck": FailureKind.HANG, "type": FailureKind.TYPE_MISMATCH,
        "size": FailureKind.SIZE_MISMATCH, "raise": FailureKind.CRASH,
        "kill": FailureKind.KILLED, "skip": FailureKind.NEVER_ARRIVED,
        "graph": FailureKind.HANG}
# the line of broken_step.py each broken rank was on: the scenario's own
LINE = {"stuck": "# stuck in its own code", "raise": "raise RuntimeError(",
        "graph": "# stops replaying"}


# -- launching (GPU) ---------------------------------------------------------------------------
def launch_all(root: Path, scenarios: tuple[str, ...] = CASES, *sets: str,
               config: Path = CONFIG, status_after_s: dict[str, float] | None = None
               ) -> dict[str, int]:
    """Launch every scenario at once into ``root/CASE`` (each on the same GPUs) and wait for
    all; the launches' exit codes. ``sets``: more ``--set`` overrides for each.
    ``status_after_s``: for a scenario, ``commviz status`` is asked that long after its rank
    broke, while the job still runs; what it printed lands in ``RUN_DIR/status_live.txt``."""
    procs = {}
    for case in scenarios:
        run_dir = root / case
        run_dir.mkdir(parents=True)
        with open(run_dir / STDOUT, "w") as out:
            procs[case] = subprocess.Popen(
                [sys.executable, "-m", "commviz", "launch", str(config),
                 "--hang-after", str(HANG_AFTER_S), "--set", f"output.dir={root}",
                 "--set", f"output.run_name={case}", "--set", f"workload.args.case={case}",
                 "--set", f"workload.args.mark={run_dir / MARK}", *sets],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for case, after in (status_after_s or {}).items():
        _ask_status(procs[case], root / case, after, deadline)
    if "graph" in procs:
        _stop_graph_hang(procs["graph"], root / "graph", deadline)
    codes = {}
    for case, proc in procs.items():
        try:
            codes[case] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc, root / case)
            codes[case] = proc.wait()
    return codes


def _wait_for_mark(proc: subprocess.Popen, run_dir: Path, deadline: float) -> None:
    while not (run_dir / MARK).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)


def _ask_status(proc: subprocess.Popen, run_dir: Path, after_s: float, deadline: float) -> None:
    """``commviz status RUN_DIR`` as a user asks it while the job hangs, ``after_s`` after
    the rank broke; its output (and when it was asked) in ``RUN_DIR/status_live.txt``."""
    _wait_for_mark(proc, run_dir, deadline)
    time.sleep(after_s)
    asked = time.time()
    done = subprocess.run([sys.executable, "-m", "commviz", "status", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    (run_dir / STATUS_LIVE).write_text(
        f"# asked {asked:.3f} ({after_s} s after the mark), job still running: "
        f"{proc.poll() is None}, rc {done.returncode}\n{done.stdout}{done.stderr}")


def _stop_graph_hang(proc: subprocess.Popen, run_dir: Path, deadline: float) -> None:
    """Once the rank has stopped replaying: Ctrl-C, as a user (or an outer timeout) would."""
    _wait_for_mark(proc, run_dir, deadline)
    time.sleep(GRAPH_STOP_AFTER_S)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)


def _kill(proc: subprocess.Popen, run_dir: Path) -> None:
    """A launch past its time: the launch, torchrun and the ranks (in sessions of their own,
    found by the pids their stack files name)."""
    for pid in st.live_pids(run_dir).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)


# -- kept runs (CPU) ---------------------------------------------------------------------------
# what names the GPU machine's paths: stacks, failure files, logs
RELOCATED = ("stacks_rank*.txt", "logs/*.json", "*.log", "*.txt")


def relocated_copy(kept: Path, name: str, scratch: Path, repo: Path) -> Path:
    """A copy of the kept run ``kept/name`` (nothing is written into the fixtures), its paths
    into the GPU machine's checkout (``kept/repo.txt``) made this checkout's: what is commviz's
    own code there is here too, so the verdict tells it from the job's as it did there."""
    there = (kept / "repo.txt").read_text().strip()
    run = shutil.copytree(kept / name, scratch / name)
    # once per file: a file two patterns match, rewritten twice, would name ``repo`` twice over
    # where ``there`` is in ``repo`` (/work/main in /check/work/main)
    # The runs kept before the launcher moved into the package (it stood at the checkout's top,
    # launch/) name its files there: they are its files at commviz/launch/ now.
    for path in {path for pattern in RELOCATED for path in run.glob(pattern)}:
        text = path.read_text().replace(f"{there}/launch/", f"{there}/commviz/launch/")
        path.write_text(text.replace(there, str(repo)))
    return run


# -- what torch's Flight Recorder says --------------------------------------------------------
class Flight(NamedTuple):
    """torch's Flight Recorder on one run: its analyzer's findings, where it could run
    (``fr_findings``: (group desc, seq) -> (missing ranks, mismatched ranks)), and the raw
    entries of every rank that left a dump."""

    findings: dict[tuple[str, int], tuple[set[int], set[int]]] | None
    entries: dict[int, list[dict]]
    dumps: dict[int, dict]


def flight(run_dir: Path, scratch: Path) -> Flight:
    """The dumps in ``RUN_DIR/flight_recorder``, copied under the names ``fr_findings`` reads;
    the analyzer is run where every rank left a dump (with one rank's alone it has nothing to
    line up), and its findings kept where it ran to its end: it raises on a pipeline's dumps
    (torch 2.11 and 2.13: in ``match_coalesced_groups_with_non_p2p``, a ``KeyError`` on the
    ``batch_isend_irecv`` blocks of ranks whose peer's block never ended, or a ``NameError``
    first where ``tabulate``, which it draws their ops with, is not installed)."""
    scratch.mkdir(parents=True, exist_ok=True)
    dumps = {}
    for path in sorted(flightrec.folder(run_dir).glob(f"{flightrec.PREFIX}*")):
        rank = path.name.removeprefix(flightrec.PREFIX)
        if rank.isdigit():
            shutil.copy(path, scratch / f"fr_rank{rank}")
            dumps[int(rank)] = pickle.loads(path.read_bytes())
    findings = None
    if len(dumps) > 1:
        try:
            findings = fr_findings(scratch, scratch / "db.pkl")
        except subprocess.CalledProcessError as err:
            if b"match_coalesced_groups_with_non_p2p" not in (err.stderr or b""):
                raise                                      # only the known failure
    return Flight(findings, fr_entries(scratch), dumps)


# -- the verdict, as the launch printed it ----------------------------------------------------
def launch_verdict(run_dir: Path) -> Verdict | None:
    """The verdict the launch built after the job: the ranks' failures (their failure files,
    torchrun's results, the launch's log) as their exits. A launch stopped by Ctrl-C built
    none; this is then what ``commviz report`` says."""
    found = outcome.failures(run_dir / "logs", (run_dir / "launch.log").read_text())
    return outcome.judge(run_dir, found) if found else build_verdict(run_dir)


def printed_verdict(run_dir: Path) -> list[str]:
    """The launch's verdict after the job (from its last ``VERDICT:`` line on: the hang watch
    may have printed one before), as the user saw it."""
    lines = (run_dir / STDOUT).read_text().splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("VERDICT:")]
    return lines[heads[-1]:] if heads else []


def scenario_line(job: Path, case: str) -> int:
    """The line number of the scenario's own line in the job (as it ran)."""
    text = job.read_text()
    at = text.index(LINE[case])
    return text.count("\n", 0, at) + 1


def unrecorded(run_dir: Path, dumps: dict[int, dict]) -> dict[int, list[str]]:
    """Per rank with a dump: where commviz's record and torch's Flight Recorder differ
    (``fr_compare.differences``: an entry with no record, a different op, size, dtype or
    group). Calls made after the dump was taken (past each group's last enqueued collective in
    its ``pg_status``: NCCL's watchdog dumps at its timeout, and the ranks go on) are not in
    it: left out."""
    run = load_run(run_dir)
    out = {}
    for rank, dump in dumps.items():
        record = run.ranks[rank].record
        assert record is not None, f"rank {rank} left a Flight Recorder dump but no record"
        # pg_status is keyed by each group's id on the rank (its entries' pg_id), not its name
        names = {str(e["pg_id"]): str(e["process_group"][0]) for e in dump["entries"]}
        horizon = {names[pg]: s["last_enqueued_collective"]
                   for pg, s in dump.get("pg_status", {}).items() if pg in names}
        before = [r for r in record["collectives"]
                  if r.get(md.SEQ) is None or r.get(md.KIND) != "collective"
                  or r[md.SEQ] <= horizon.get(str(r[md.PG_NAME]), r[md.SEQ])]
        out[rank] = differences(from_dump(dump, before))[0]
    return out


# -- the checks (both tests) ------------------------------------------------------------------
def root_key(case: str) -> tuple[str, int]:
    """The collective the scenario breaks: the subgroup's for a skip, the world's otherwise."""
    return ("sub" if case == "skip" else "default_pg", AT_SEQ)


def check_agrees_with_flight_recorder(case: str, v: Verdict | None, fl: Flight,
                                      run_dir: Path, job: Path) -> None:
    """Flight Recorder finds the scenario's collective (group, sequence number) and its
    missing or mismatched rank; the verdict's root is that collective, with those ranks, and
    each rank's state there as its dump has it. A graph hang: neither has a word of it; the
    stacks say where each rank stopped."""
    if case == "graph":
        _check_graph_hang(v, fl, run_dir, job)
        return
    key = root_key(case)
    if fl.findings is None:      # the killed rank left no dump: the other's own entries
        (have,) = fl.entries
        assert BAD not in fl.entries, fl.entries.keys()
        last = [e for e in fl.entries[have] if e["process_group"][1] == key[0]][-1]
        assert (last["collective_seq_id"], last["state"]) == (AT_SEQ, "scheduled"), last
        # It waits in its first collective that never completed: the world's #5, which the
        # killed rank never called, or, where that rank died before its GPU finished the
        # subgroup's #5 it had queued just before its SIGKILL (a race the job leaves open),
        # that one, which the job's code has it call: it is then no missing rank
        first = min((e for e in fl.entries[have] if e["state"] != "completed"
                     and not e.get("is_p2p")), key=lambda e: e["time_created_ns"])
        found = (first["process_group"][1], first["collective_seq_id"])
        assert found in (key, ("sub", AT_SEQ)), first
        key, missing = found, {BAD} if found == key else set()
    else:
        missing, mismatched = fl.findings[key]
        assert (missing, mismatched) == ((set(), {BAD}) if case in ("type", "size")
                                         else ({BAD}, set())), fl.findings
    assert v is not None and v.root is not None, fl.findings
    root = v.root
    assert (root.pg_desc, root.seq) == key and set(root.missing) == missing, verdict_text(v)
    expected = {r: next((e["state"] for e in es if e["process_group"][0] == root.pg
                         and e["collective_seq_id"] == root.seq and not e.get("is_p2p")), None)
                for r, es in fl.entries.items() if r in root.members}
    assert expected and v.flight_states(root) == expected, (expected, verdict_text(v))


def _check_graph_hang(v: Verdict | None, fl: Flight, run_dir: Path, job: Path) -> None:
    """A replay makes no Flight Recorder entry: the dumps hold the first, eager call's
    entries, completed; and commviz's verdict has no collective to blame either. The stacks
    (Ctrl-C) hold where each rank was: rank 1 at its sleep, rank 0 waiting for the GPU."""
    states = {e["state"] for es in fl.entries.values() for e in es}
    assert states == {"completed"} and not fl.findings, (fl.findings, states)
    assert v is None or v.root is None, verdict_text(v)
    stuck = st.read_stacks(st.stacks_path(run_dir, BAD))
    assert stuck is not None and _where(stuck.user_frame()) == (JOB_NAME, scenario_line(job, "graph"))
    waiting = st.read_stacks(st.stacks_path(run_dir, 0))
    assert waiting is not None and waiting.main_thread is not None
    assert waiting.main_thread.frames[0].func == "synchronize", waiting.main_thread


def _where(frame: st.Frame | None) -> tuple[str, int] | None:
    return None if frame is None else (Path(frame.file).name, frame.line)


def check_verdict(case: str, v: Verdict | None, run_dir: Path, job: Path,
                  printed: bool = True) -> None:
    """Beyond Flight Recorder: why (the kind), who (the culprit), and where the culprit was
    (its stack: the scenario's line of the job); and (``printed``) the launch printed that
    verdict (not for a kept run dir: its launch ran an earlier commviz)."""
    assert v is not None, f"no verdict on {run_dir}"
    text = verdict_text(v)
    assert v.kind is KIND[case], text
    if case in ("type", "size"):     # two ranks, two calls: nothing tells which is wrong
        assert v.culprits == (0, BAD), text
        sigs = {r: c.signature for r, c in v.root.calls.items()}
        if case == "type":
            assert (sigs[0].op, sigs[BAD].op) == ("all_reduce", "broadcast"), text
        else:
            assert (sigs[0].in_nelems, sigs[BAD].in_nelems) == (16, 8), text
    else:
        assert v.culprits == (BAD,), text
    stopped = v.ranks[BAD].stopped_at
    if case == "kill":               # SIGKILL: nothing could be written
        assert stopped is None and v.ranks[BAD].stacks is None, text
    elif case in LINE:
        assert _where(stopped) == (JOB_NAME, scenario_line(job, case)), text
    if printed and case != "graph":  # the launch printed it (a Ctrl-C'd launch prints none)
        assert printed_verdict(run_dir)[:1] == text.splitlines()[:1], text
