"""Issue 13 on real gloo jobs through `commviz launch`: dead ranks, lying inputs, full disks.

Each row of the issue's table is one real run (launched once per module and shared) or an
input derived from a real run; every merged trace is checked by `commviz verify` and read back
with perfetto's own protobuf classes: a flow id always has at least two ends.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from commviz import load_record
from commviz import metadata as md
from commviz.verify import read_slices, verify_pftrace
from independent import flow_ends

JOBS = Path(__file__).parent / "jobs"      # failing_job.py: the entrypoint these launch


def commviz_cli(*args: str, cwd: Path, timeout: float = 240, wrap: list[str] | None = None
                ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "commviz", *args]
    return subprocess.run((wrap or []) + cmd, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def launch_job(base: Path, how: str, out_dir: str = "out", wrap: list[str] | None = None
               ) -> tuple[subprocess.CompletedProcess, Path]:
    base.mkdir(parents=True, exist_ok=True)
    (base / "fail.yaml").write_text(textwrap.dedent(f"""
        name: fail
        job: {{nproc_per_node: 2, timeout_s: 60}}
        workload:
          steps: 3
          entrypoint: failing_job:build
          args: {{rank: 1, at: 3, how: {how}}}
          pythonpath: ["{JOBS}"]
        output: {{dir: "{out_dir}", run_name: run}}
        """))
    return commviz_cli("launch", str(base / "fail.yaml"), cwd=base, wrap=wrap), \
        Path(out_dir if out_dir.startswith("/") else base / out_dir) / "run"


def assert_verifies(path: Path, linked: bool = True) -> None:
    """``commviz verify`` passes and no flow id has one end (``linked``: and some flow exists:
    both ranks have records, so their collectives are linked)."""
    report = verify_pftrace(path)
    assert report.ok, report.errors[:5]
    ends = flow_ends(path)
    assert ends or not linked, "no flows at all"
    lone = [f for f, n in ends.items() if n < 2]
    assert not lone, f"{len(lone)} flow ids with one end"


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result, run_dir = launch_job(tmp_path_factory.mktemp("healthy"), "none")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def _copy(run_dir: Path, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("merged*", "shard_rank*",
                                                                 "report.md", "plots", *drop))
    return dest


def merge(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return commviz_cli("merge", str(run_dir), *extra, cwd=run_dir.parent)


# -- rank 1's record missing (as after SIGKILL without a journal) -------------------------------

def test_missing_record_is_missing_not_a_desync(healthy: Path, tmp_path: Path) -> None:
    run = _copy(healthy, tmp_path / "run", drop=("commviz_rank1.pkl",))
    result = merge(run)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out
    assert "commviz_rank1.pkl: missing" in out
    assert_verifies(run / "merged.pftrace", linked=False)
    from commviz.review.analyses.reviewing import review_run

    review = review_run(run)
    assert review.desyncs == [], [d.message for d in review.desyncs]
    # rank 1's trace still shows the collectives it ran: its lane is there
    assert any(ev for ev in review.instances if 1 in ev.ranks)


def test_one_rank_trace_alone_and_annotate_verify(healthy: Path, tmp_path: Path) -> None:
    run = _copy(healthy, tmp_path / "run", drop=("*rank1*",))
    result = merge(run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_verifies(run / "merged.pftrace", linked=False)   # every collective on one rank only
    trace = next(run.glob("trace_rank0*.json.gz"))
    out = tmp_path / "annotated.pftrace"
    result = commviz_cli("annotate", str(trace), str(run / "commviz_rank0.pkl"), "-o", str(out),
                         cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ".commviz-" not in result.stdout, result.stdout     # no internal temp path
    report = verify_pftrace(out)
    assert report.ok, report.errors[:5]
    assert all(n >= 2 for n in flow_ends(out).values())


# -- a rank killed, raising, or SIGTERMed by something other than torchrun ----------------------

@pytest.fixture(scope="module", params=["kill", "raise", "term"])
def failed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, subprocess.CompletedProcess, Path]:
    result, run_dir = launch_job(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, result, run_dir


def test_failed_rank_named_first_and_trace_verifies(failed) -> None:
    how, result, run_dir = failed
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    verdict = next(line for line in out.splitlines() if line.startswith("FAILED:"))
    reason = {"kill": "exit code -9", "raise": "RuntimeError: injected failure in call 3",
              "term": "stopped by SIGTERM"}[how]
    assert verdict.startswith("FAILED: rank 1") and reason in verdict, out
    assert "rank 0 stopped because rank 1 failed" in out, out
    # the elastic agent's own results, kept in the run dir: the rank and how it ended
    results = json.loads((run_dir / "logs" / "elastic_node0.json").read_text())
    ended = {f["rank"]: f for f in results["failures"]}
    expected = {"kill": (-9, "SIGKILL"), "raise": (1, None), "term": (1, None)}[how]
    assert (ended[1]["exitcode"], ended[1]["signal"]) == expected, results
    # rank 1 ran 3 steps of 2 collectives before failing (warmup step included: 1 + 3 steps)
    record = load_record(run_dir / "commviz_rank1.pkl")
    assert [c[md.OP] for c in record["collectives"]] == ["all_reduce", "broadcast"] * 3
    if how == "kill":
        assert record["exit"] == "journal" and "rebuilt from its journal (6 collectives)" in out
    assert "records: 2/2 ranks" in out, out
    assert_verifies(run_dir / "merged.pftrace")


def test_report_opens_with_the_launchs_verdict(failed, tmp_path: Path) -> None:
    """``commviz report`` on the failed job's run dir (and the launch's own report.md) opens
    with the verdict the launch printed: the scenario's culprit, rank 1, and for a raise or a
    SIGKILL the scenario's kind. Also with rank 1's stacks gone (as on NCCL, where a rank that
    raised leaves none of its raise): how it ended is read from the launch's logs."""
    how, result, run_dir = failed
    printed = next(line for line in result.stdout.splitlines() if line.startswith("VERDICT:"))
    kind = {"raise": "crash", "kill": "killed"}.get(how)
    assert printed.endswith(" - culprit rank(s) 1"), result.stdout
    assert kind is None or printed.startswith(f"VERDICT: {kind} -"), result.stdout
    assert (run_dir / "report.md").read_text().startswith(f"# Verdict\n\n```\n{printed}\n")
    run = _copy(run_dir, tmp_path / "run", drop=("stacks_rank1*",))
    assert (run / "logs").is_dir() and not list(run.glob("stacks_rank1*"))
    got = commviz_cli("report", str(run), "--no-plots", cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.splitlines()[0] == printed, got.stdout[:3000]


# -- a desynced rank: rank 1 skips a collective the other rank waits in (3 s gloo timeout) -----

def _desync_job(rank: int, world: int, run_dir: str) -> int:
    import datetime

    import torch

    import commviz
    import commviz.distributed as dist

    commviz.start(run_dir, flush_interval=None)
    skip = dist.new_group([0, 1], group_desc="skip", timeout=datetime.timedelta(seconds=3))
    t = torch.ones(8)
    with commviz.profile(run_dir):
        dist.all_reduce(t, group=skip)
        works = [dist.all_reduce(t, group=skip, async_op=True)] if rank == 0 else []
        works.append(dist.broadcast(torch.ones(4), src=0, group=skip, async_op=True))
        failed = 0
        for w in works:
            try:
                w.wait()
            except RuntimeError:                   # the mismatched calls time out
                failed += 1
    commviz.flush()
    return failed


def test_desynced_rank_merges_and_verifies(tmp_path: Path) -> None:
    from harness import run_ranks

    from commviz.review.analyses.reviewing import review_run

    run = tmp_path / "run"
    assert all(run_ranks(_desync_job, 2, str(run), timeout=90))
    result = merge(run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_verifies(run / "merged.pftrace")
    desyncs = review_run(run).desyncs
    assert [(d.pg_desc, d.seq, d.kind) for d in desyncs] == [("skip", 2, "missing")]


# -- inputs that lie --------------------------------------------------------------------------

def _rewrite_trace(run: Path, rank: int, edit) -> Path:
    path = next(run.glob(f"trace_rank{rank}*.json.gz"))
    doc = json.loads(gzip.decompress(path.read_bytes()))
    edit(doc["traceEvents"])
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_timestamps_of_1e30_are_named_and_not_believed(healthy: Path, tmp_path: Path) -> None:
    run = _copy(healthy, tmp_path / "run")

    def lie(events: list) -> None:
        for e in events:
            if "ts" in e and e.get("ph") != "M":
                e["ts"] = 1e30
    path = _rewrite_trace(run, 1, lie)
    result = merge(run)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out
    assert f"{path}: rank 1: no profiler event has a believable time" in out, out
    assert_verifies(run / "merged.pftrace")
    from commviz.review.analyses.reviewing import review_run

    review = review_run(run)
    assert review.instances and max(i.skew_ns for i in review.instances) < 10e9


def test_one_event_with_huge_dur_and_negative_ts_is_skipped(healthy: Path, tmp_path: Path
                                                             ) -> None:
    run = _copy(healthy, tmp_path / "run")
    named: list[str] = []

    def lie(events: list) -> None:
        slices = [e for e in events if e.get("ph") == "X"]
        slices[5]["dur"], slices[9]["ts"] = 1e30, -1e18
        named.extend([slices[5]["name"], slices[9]["name"]])
    path = _rewrite_trace(run, 0, lie)
    from commviz.trace.load import load_trace

    trace = load_trace(path)
    assert len(trace.problems) == 1 and "2 events with unbelievable times" in trace.problems[0]
    assert all(repr(name[:60]) in trace.problems[0] for name in named), trace.problems
    result = merge(run)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr
    assert_verifies(run / "merged.pftrace")
    verify = commviz_cli("verify", str(run / "merged.pftrace"), "--run", str(run), cwd=tmp_path)
    assert "Traceback" not in verify.stdout + verify.stderr



def _json_flow_ends(path: Path) -> dict[tuple, list[str]]:
    """(cat, id) -> the phases of its flow events, read from the JSON with the stdlib."""
    ends: dict[tuple, list[str]] = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("ph") in ("s", "t", "f"):
            ends.setdefault((e.get("cat"), e.get("id")), []).append(e["ph"])
    return ends


def test_json_merge_draws_no_flow_with_one_end(healthy: Path, tmp_path: Path) -> None:
    """Rank 1's record missing, and rank 0's trace cut mid-flow (a start whose finish was never
    written, a finish whose start was): ``merge --format json`` keeps the whole flow and only
    it."""
    run = _copy(healthy, tmp_path / "run", drop=("commviz_rank1.pkl",))

    def cut(events: list) -> None:
        ops = [e for e in events if e.get("ph") == "X" and isinstance(e.get("pid"), int)
               and e.get("cat") != "Trace"]
        a, b, c = ops[0], ops[len(ops) // 2], ops[-1]
        point = lambda ph, e, fid: {"ph": ph, "cat": "fwdbwd", "id": fid, "name": "fwdbwd",  # noqa: E731
                                    "pid": e["pid"], "tid": e["tid"], "ts": e["ts"],
                                    **({"bp": "e"} if ph == "f" else {})}
        events += [point("s", a, 901), point("f", b, 901), point("s", c, 902),
                   point("f", a, 903)]
    _rewrite_trace(run, 0, cut)
    result = merge(run, "--format", "json")
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out
    assert "commviz_rank1.pkl: missing" in out
    ends = _json_flow_ends(run / "merged.json")
    assert sorted(sorted(ph) for ph in ends.values()) == [["f", "s"]], ends


def test_trace_shifted_by_days_is_named_not_believed(healthy: Path, tmp_path: Path) -> None:
    """Rank 1's trace moved three days on, every time still consistent within the file: the
    merge names the file and rank, leaves the trace out (its record still gives its lanes),
    and the merged trace verifies."""
    run = _copy(healthy, tmp_path / "run")
    path = next(run.glob("trace_rank1*.json.gz"))
    doc = json.loads(gzip.decompress(path.read_bytes()))
    doc["baseTimeNanoseconds"] += 3 * 86_400 * 10**9
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    result = merge(run)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out
    assert f"{path}: rank 1: starts 3.0 days from its rank's own record" in out, out
    assert_verifies(run / "merged.pftrace")
    slices, _ = read_slices(run / "merged.pftrace")
    assert max(s.ts for s in slices) - min(s.ts for s in slices) < 86_400 * 10**9
    assert any(s.process.startswith("rank 1") for s in slices)

# -- full and read-only disks (a mount namespace: works as root, where chmod stops nothing) ----

def _namespace(script: str) -> list[str]:
    """``script`` runs in a new user + mount namespace; it ends with ``exec "$0" "$@"`` to run
    the command appended after it."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory: pytest.TempPathFactory) -> None:
    probe = tmp_path_factory.mktemp("probe")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot make a small or read-only mount")
    got = subprocess.run(_namespace(f"mount -t tmpfs -o size=1m tmpfs {probe} && "
                                    f"mount -o remount,ro,bind {probe}"), capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"mount namespaces unavailable here: {got.stderr.decode().strip()}")


def test_read_only_run_dir_merge_report_and_launch(can_mount, healthy: Path, tmp_path: Path) -> None:
    run = _copy(healthy, tmp_path / "run")
    ro = f"mount --bind {run} {run} && mount -o remount,ro,bind {run} && exec \"$0\" \"$@\""
    got = subprocess.run(_namespace(ro) + [sys.executable, "-m", "commviz", "merge", str(run)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=240)
    out = got.stdout + got.stderr
    assert got.returncode != 0 and "Traceback" not in out, out
    assert "Read-only file system [EROFS]" in out and str(run) in out, out
    assert not (run / "merged.pftrace").exists()
    got = subprocess.run(_namespace(ro) + [sys.executable, "-m", "commviz", "report", str(run)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=240)
    out = got.stdout + got.stderr
    assert got.returncode == 2 and "Traceback" not in out, out
    assert "Read-only file system [EROFS]" in out and str(run) in out, out
    out_dir = tmp_path / "ro-out"
    out_dir.mkdir()
    got, _ = launch_job(tmp_path / "job", "none", out_dir=str(out_dir), wrap=_namespace(
        f"mount --bind {out_dir} {out_dir} && mount -o remount,ro,bind {out_dir} && "
        "exec \"$0\" \"$@\""))
    out = got.stdout + got.stderr
    assert got.returncode != 0 and "Traceback" not in out, out
    assert "Read-only file system" in out and str(out_dir) in out, out


def test_full_disk_named_by_ranks_and_launch(can_mount, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    got, run_dir = launch_job(tmp_path / "job", "none", out_dir=str(small), wrap=_namespace(
        f"mount -t tmpfs -o size=2m tmpfs {small} && "
        f"head -c {2048 * 1024 - 40 * 1024} /dev/zero > {small}/ballast; exec \"$0\" \"$@\""))
    out = got.stdout + got.stderr
    assert got.returncode != 0, out
    assert "Traceback" not in out, out          # launch's own stderr included: a crash is there
    assert "No space left on device" in out, out
    verdict = [line for line in out.splitlines() if line.startswith("FAILED:")]
    assert verdict and "No space left on device" in verdict[0] and str(small) in verdict[0], out
    for step in ("merge", "report"):     # each says it could not write, naming where, or worked
        line = next(line for line in got.stdout.splitlines() if line.startswith(step))
        assert "No space left on device [ENOSPC]" in line or "failed" not in line, line
