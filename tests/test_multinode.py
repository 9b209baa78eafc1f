"""Multi-node jobs simulated on one machine: two `commviz launch` processes started together meet
at one c10d rendezvous (gloo), each with its own run dir (node-local disks) or one shared dir.

Which launch gets rank 0 is made deterministic the way torch decides it: c10d numbers the nodes
by their rendezvous descriptors sorted (``_NodeDesc(addr, pid, local_id)``, addr first), so the
launch given ``job.local_addr: 127.0.0.1`` gets rank 0 over the one given ``127.0.0.2`` (both
are this machine's loopback); ``--node-rank`` plays no part, as on a cluster. Both placements are
run. What ran where is taken from the workers themselves (tests/jobs/placed_job.py writes each
rank's ``RANK``/``GROUP_RANK``/``LOCAL_RANK`` with the test's label of its launch), never from
commviz's output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from commviz import load_record
from commviz.launch import config as C
from commviz.launch import rendezvous, slurm

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "jobs"
FIRST, SECOND = "127.0.0.1", "127.0.0.2"     # c10d gives rank 0 to the address sorting first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp: Path, port: int, nproc: int, *, fail_rank: int | None = None,
           job: str = "") -> Path:
    path = tmp / "two.yaml"
    path.write_text(textwrap.dedent(f"""
        name: two
        job: {{nproc_per_node: {nproc}, timeout_s: 60{job}}}
        workload:
          steps: 3
          entrypoint: placed_job:build
          pythonpath: [{JOBS}]
          args: {{where_dir: {tmp / 'where'}{'' if fail_rank is None else f', fail_rank: {fail_rank}'}}}
        profile: {{warmup: 1, active: 2}}
        """))
    return path


@dataclass
class Node:
    label: str
    out: str
    code: int


def run_nodes(tmp: Path, cfg: Path, nodes: dict[str, list[str]],
              env: dict[str, dict[str, str]] | None = None, timeout: float = 200) -> dict[str, Node]:
    """Start one launch per entry of ``nodes`` (label -> extra arguments) at once; wait for all."""
    procs = {}
    for label, extra in nodes.items():
        node_env = dict(os.environ, TEST_NODE=label, **(env or {}).get(label, {}))
        procs[label] = subprocess.Popen(
            [sys.executable, "-m", "commviz", "launch", str(cfg), *extra], cwd=tmp,
            env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outs = {label: p.communicate(timeout=timeout)[0] for label, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return {label: Node(label, outs[label], procs[label].returncode) for label in nodes}


def where(tmp: Path) -> dict[int, dict[str, str]]:
    """rank -> what that worker's torchrun environment said (RANK, GROUP_RANK, ...)."""
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text())
            for p in (tmp / "where").glob("rank*.json")}


def ranks_of(placed: dict[int, dict[str, str]], label: str) -> list[int]:
    return sorted(r for r, w in placed.items() if w["TEST_NODE"] == label)


def check_merged(run_dir: Path, out: str, world: int) -> None:
    from commviz.verify import verify_pftrace

    merged = run_dir / "merged.pftrace"
    assert f"merged:  {merged}" in out, out
    assert verify_pftrace(merged).ok
    assert sorted(load_record(run_dir / f"commviz_rank{r}.pkl")["rank"]
                  for r in range(world)) == list(range(world))


@pytest.mark.slow
def test_rank0_on_the_second_launch_with_node_local_dirs(tmp_path):
    """--node-rank 1 is given the address torch sorts first: rank 0 runs there (2 ranks per
    node). That launch merges all 4 ranks; --node-rank 0 merges nothing and says where the run
    is; both exit 0; every rank shown is the one torch gave."""
    port = free_port()
    cfg = config(tmp_path, port, 2, job=f", nnodes: 2, rdzv_endpoint: '127.0.0.1:{port}', "
                                      f"rdzv_id: sep-{port}")
    nodes = run_nodes(tmp_path, cfg, {
        "a": ["--node-rank", "0", "--set", "output.dir=a", "--set", f"job.local_addr={SECOND}"],
        "b": ["--node-rank", "1", "--set", "output.dir=b", "--set", f"job.local_addr={FIRST}"]})
    placed = where(tmp_path)
    assert sorted(placed) == [0, 1, 2, 3]
    assert ranks_of(placed, "b") == [0, 1] and ranks_of(placed, "a") == [2, 3]   # as arranged
    assert {placed[r]["GROUP_RANK"] for r in (0, 1)} == {"0"}
    assert [n.code for n in nodes.values()] == [0, 0], nodes
    run_a, run_b = (tmp_path / d / f"two-sep-{port}" for d in "ab")   # {name}-{rdzv_id}
    check_merged(run_b, nodes["b"].out, 4)
    a = nodes["a"].out
    assert "merged:" not in a and not (run_a / "merged.pftrace").exists(), a
    assert not (run_a / "report.md").exists()
    assert f"rank 0 ran on {socket.gethostname()}: " in a and f":{run_b}" in a, a
    assert f"ran ranks {ranks_of(placed, 'a')}" in a
    assert f"torch's node rank {placed[2]['GROUP_RANK']}" in a
    assert f"ran ranks {ranks_of(placed, 'b')}" in nodes["b"].out


@pytest.mark.slow
def test_a_failed_rank_fails_every_node_naming_torchs_rank(tmp_path):
    """Rank 2 (torch's number: it runs on --node-rank 0, whose launch holds ranks 2-3) raises:
    both launches exit 1; the one that ran it names rank 2 and its own log file."""
    port = free_port()
    cfg = config(tmp_path, port, 2, fail_rank=2,
                 job=f", nnodes: 2, rdzv_endpoint: '127.0.0.1:{port}', rdzv_id: fail-{port}")
    nodes = run_nodes(tmp_path, cfg, {
        "a": ["--node-rank", "0", "--set", "output.dir=a", "--set", f"job.local_addr={SECOND}"],
        "b": ["--node-rank", "1", "--set", "output.dir=b", "--set", f"job.local_addr={FIRST}"]})
    placed = where(tmp_path)
    assert ranks_of(placed, "a") == [2, 3], placed
    assert [n.code for n in nodes.values()] == [1, 1], nodes
    a = nodes["a"].out
    assert "FAILED: rank 2" in a and "planned failure on rank 2" in a, a
    logs = dict(line.strip().removeprefix("rank ").split(" log: ")
                for line in a.splitlines() if " log: " in line)
    assert sorted(map(int, logs)) == [2, 3], a
    assert "planned failure on rank 2" in Path(logs["2"]).read_text()
    assert "planned failure" not in Path(logs["3"]).read_text()


def slurm_env(job_id: int, node: int) -> dict[str, str]:
    """What srun --nodes=2 --ntasks-per-node=1 sets for its task on node ``node``."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node),
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "127.0.0.[1-2]", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}


def free_slurm_job_id() -> int:
    """A job id whose rendezvous port (29400 + id mod 1000) is free here."""
    for job_id in range(424242, 425242):
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", slurm.PORT_BASE + job_id % 1000))
            return job_id
        except OSError:
            continue
    pytest.skip("no free port in 29400-30399")


@pytest.mark.slow
def test_slurm_step_with_one_shared_dir(tmp_path):
    """Under srun (simulated: its variables): no --node-rank, nnodes, endpoint or rdzv_id given.
    Both launches meet, write one run dir named by the job id in the shared dir; rank 0 runs
    on Slurm's node 0 here (it has the address sorting first); one merge, by that launch."""
    job_id = free_slurm_job_id()
    cfg = config(tmp_path, 0, 1)
    nodes = run_nodes(tmp_path, cfg, {"n0": ["--set", f"job.local_addr={FIRST}"],
                                      "n1": ["--set", f"job.local_addr={SECOND}"]},
                      env={"n0": slurm_env(job_id, 0), "n1": slurm_env(job_id, 1)})
    placed = where(tmp_path)
    assert ranks_of(placed, "n0") == [0] and ranks_of(placed, "n1") == [1], placed
    assert [n.code for n in nodes.values()] == [0, 0], nodes
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == [f"two-{job_id}"]
    run_dir = tmp_path / "runs" / runs[0]
    check_merged(run_dir, nodes["n0"].out, 2)
    assert "merged:" not in nodes["n1"].out and "rank 0 ran on " in nodes["n1"].out
    assert (run_dir / "launch_node0.log").exists() and (run_dir / "launch_node1.log").exists()
    resolved = C.load(run_dir / "config.yaml").config
    assert resolved.job.nnodes == 2 and resolved.job.rdzv_id == str(job_id)
    assert resolved.job.rdzv_endpoint == f"127.0.0.1:{slurm.PORT_BASE + job_id % 1000}"


@pytest.mark.slow
def test_a_lone_node_says_it_waits_then_names_who_never_joined(tmp_path):
    """Only --node-rank 0 starts: a waiting line every few seconds, then, at the join timeout,
    one error naming node 1; exit 1."""
    port = free_port()
    cfg = config(tmp_path, port, 1, job=f", nnodes: 2, rdzv_endpoint: '127.0.0.1:{port}', "
                                      f"rdzv_id: lone-{port}, join_timeout_s: 8")
    node = run_nodes(tmp_path, cfg, {"a": ["--node-rank", "0"]}, timeout=120)["a"]
    assert node.code == 1, node.out
    assert not where(tmp_path)              # no rank ever ran
    waiting = [ln for ln in node.out.splitlines() if ln.startswith("waiting for nodes: ")]
    assert waiting and f"1 of 2 joined at 127.0.0.1:{port}, id lone-{port}" in waiting[-1], \
        node.out
    failed = [ln for ln in node.out.splitlines() if ln.startswith("FAILED: ")]
    assert len(failed) == 1 and "join_timeout_s = 8 s" in failed[0], node.out
    assert "never reached it: node 1" in failed[0] and "node 0" not in failed[0]


# -- without processes -------------------------------------------------------------------------
def test_set_takes_values_as_typed():
    loaded = C.load_text("name: x\n", "x.yaml", Path("."), [
        "output.run_name={name}-{rdzv_id}", "job.rdzv_id=007", "job.nnodes=2",
        "job.rdzv_endpoint=node0:29500", "job.env.NCCL_SOCKET_IFNAME=eth0:1",
        "workload.collectives=[{op: all_reduce}]"])
    cfg = loaded.config
    assert cfg.output.run_name == "{name}-{rdzv_id}" and cfg.job.rdzv_id == "007"
    assert cfg.job.rdzv_endpoint == "node0:29500" and cfg.job.nnodes == 2
    assert cfg.job.env == {"NCCL_SOCKET_IFNAME": "eth0:1"}
    assert cfg.workload.collectives[0].op == "all_reduce"
    assert C.render_run_name(cfg, time="t") == "x-007"


def test_multinode_run_names():
    base = "name: x\njob: {nnodes: 2, rdzv_endpoint: 'n0:1', rdzv_id: j7}\n" \
           "workload: {collectives: [{op: barrier}]}\n"
    assert C.load_text(base, "x.yaml", Path(".")).config.output.run_name == C.MULTINODE_RUN_NAME
    with pytest.raises(Exception) as err:
        C.load_text(base + "output: {run_name: '{name}-{time}'}\n", "x.yaml", Path("."))
    msg = str(err.value)
    assert "x.yaml:4 output.run_name" in msg and "output.run_name={name}-{rdzv_id}" in msg
    # the embedded default's {time} is not the user's choice: a multi-node default launch works
    cfg = C.load(None, ["job.nnodes=2", "job.rdzv_endpoint=n0:1"]).config
    assert cfg.output.run_name == C.MULTINODE_RUN_NAME


def test_slurm_hostlists():
    assert slurm.hostnames("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07",
                                                       "login1"]
    assert slurm.hostnames("a[9-10]-ib,b") == ["a9-ib", "a10-ib", "b"]
    assert slurm.step({"SLURM_JOB_ID": "5"}) is None            # not inside srun


def test_slurm_dry_run_takes_the_shape_from_the_environment(monkeypatch, capsys, tmp_path):
    from commviz import cli

    for k, v in slurm_env(1234, 1).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
    code = cli.main(["launch", "--dry-run", "--set", f"output.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"run dir: {tmp_path / 'default-1234'}" in out
    line = next(ln for ln in out.splitlines() if "commviz.launch.elastic" in ln
                and "--node_rank 1" in ln)
    assert "--nnodes 2" in line and "--rdzv_endpoint gpu07:29634" in line
    assert "--rdzv_id 1234" in line and "--rdzv_conf join_timeout=600" in line
    # a config's own values stay; null hands one back to Slurm
    code = cli.main(["launch", str(REPO / "configs" / "multinode.yaml"), "--dry-run",
                     "--set", "job.rdzv_endpoint=null"])
    first = capsys.readouterr().out.splitlines()[0]
    assert code == 0 and "at gpu07:29634 (id multinode-001)" in first, first
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    assert cli.main(["launch", "--dry-run"]) == 2
    assert "--ntasks-per-node=1" in capsys.readouterr().err


def test_rendezvous_state_is_read_without_running_foreign_code():
    import base64
    import datetime
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (_NodeDesc,
                                                                         _RendezvousState)

    state = _RendezvousState()
    for addr, pid in (("10.0.0.2", 11), ("10.0.0.1", 12)):     # as torch's join writes them
        node = _NodeDesc(addr, pid, 0)
        state.participants[node] = 0
        state.last_heartbeats[node] = datetime.datetime.now(datetime.timezone.utc)
    state.deadline = datetime.datetime.now(datetime.timezone.utc)
    raw = base64.b64encode(pickle.dumps(state))
    assert rendezvous.decode_state(raw) == (["10.0.0.1", "10.0.0.2"], False)

    class Hostile:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    assert rendezvous.decode_state(base64.b64encode(pickle.dumps(Hostile()))) is None
    assert rendezvous.decode_state(b"Y2FuaW1hZGFt") is None      # torch's "no state" sentinel


# -- commviz status from one node ----------------------------------------------------------------
# Another host, as a signal sees it: a launch started in a PID namespace of its own (a user
# namespace makes that unprivileged). Its processes keep the file system, loopback and host name,
# but the pids its ranks write in their stacks files mean nothing outside, and nothing outside
# can signal them: only that node's launch can.
OTHER_HOST = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
              "--kill-child"]
FAILING_JOB = JOBS / "failing_job.py"


def _other_host_works() -> bool:
    try:
        got = subprocess.run([*OTHER_HOST, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return got.returncode == 0


def _line_of(path: Path, text: str) -> int:
    """The 1-based line of ``path`` holding ``text`` (what the scenario stops on)."""
    (n,) = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    return n


def _two_nodes(tmp_path: Path, hang_after: float, out: dict[str, Path] | None = None
               ) -> dict[str, subprocess.Popen]:
    """Two launches of failing_job's stuck rank 1 sharing one run dir: rank 0's here, rank 1's
    as another host (its own PID namespace). ``out``: files for their output (else pipes)."""
    if not _other_host_works():
        pytest.skip("no unprivileged PID namespaces here (unshare --user --pid)")
    port = free_port()
    cfg = tmp_path / "stuck.yaml"
    cfg.write_text(textwrap.dedent(f"""
        name: stuck
        job: {{nproc_per_node: 1, nnodes: 2, timeout_s: 120, rdzv_endpoint: '127.0.0.1:{port}',
               rdzv_id: st-{port}}}
        workload:
          steps: 3
          entrypoint: failing_job:build
          args: {{rank: 1, at: 2, how: stuck, sleep_s: 120}}
          pythonpath: [{JOBS}]
        output: {{dir: {tmp_path / 'runs'}, run_name: run, merge: false, report: false}}
        """))
    launch = [sys.executable, "-m", "commviz", "launch", str(cfg), "--hang-after", str(hang_after)]
    sinks = {k: open(v, "w") for k, v in (out or {}).items()}      # noqa: SIM115 - the launches hold them
    kw = lambda label: dict(cwd=tmp_path, stdout=sinks.get(label, subprocess.PIPE),  # noqa: E731
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return {   # c10d gives rank 0 to the address sorting first
        "here": subprocess.Popen([*launch, "--node-rank", "0", "--set", f"job.local_addr={FIRST}"],
                                 **kw("here")),
        "other": subprocess.Popen([*OTHER_HOST, *launch, "--node-rank", "1",
                                   "--set", f"job.local_addr={SECOND}"], **kw("other"))}


def _end(procs: dict[str, subprocess.Popen]) -> dict[str, str]:
    """The other node goes at once (its namespace with it), then Ctrl-C here; their output."""
    for p, how in ((procs["other"], signal.SIGKILL), (procs["here"], signal.SIGINT)):
        if p.poll() is None:
            os.killpg(p.pid, how)
    outs = {}
    for label, p in procs.items():
        try:
            outs[label] = p.communicate(timeout=60)[0] or ""
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outs[label] = p.communicate()[0] or ""
    return outs


@pytest.mark.slow
def test_status_from_one_node_gets_every_ranks_stacks(tmp_path):
    """Two launches share one run dir; the one holding rank 1 runs as another host (its own PID
    namespace). Rank 1 sleeps before its 2nd all_reduce, rank 0 waits in it. `commviz status`,
    run beside rank 0, signals rank 0 itself and gets rank 1's stacks through rank 1's launch:
    both ranks' live stacks files hold a dump, and the verdict names rank 1 at its sleep. With
    that launch stopped (SIGSTOP), status names its node as not answering."""
    from commviz.record import stacks
    from commviz.review.analyses.judge import build_verdict

    procs = _two_nodes(tmp_path, 0)
    run_dir = tmp_path / "runs" / "run"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:     # until rank 0 waits in the 2nd all_reduce
            time.sleep(0.5)
            if any(p.poll() is not None for p in procs.values()):
                break                          # a launch ended: its output says why, below
            try:
                v = build_verdict(run_dir, live=True)
            except Exception:                  # journals not there yet
                continue
            if v is not None and v.root is not None and sorted(v.root.calls) == [0]:
                break
        status = [sys.executable, "-m", "commviz", "status", str(run_dir)]
        got = subprocess.run(status, capture_output=True, text=True, timeout=60)
        assert all(p.poll() is None for p in procs.values())    # status stopped nothing
        os.killpg(procs["other"].pid, signal.SIGSTOP)       # that node's launch hangs
        try:
            stuck = subprocess.run([*status, "--wait", "1"], capture_output=True, text=True,
                                   timeout=60)
        finally:
            os.killpg(procs["other"].pid, signal.SIGCONT)
    finally:
        outs = _end(procs)
    out = got.stdout
    assert got.returncode == 1, out + got.stderr + "\n".join(outs.values())
    # rank 0 was signalled from here; rank 1 only by its own launch (nothing here can reach it)
    assert "  stacks asked here of ranks 0\n" in out, out
    assert "): its launch asked ranks 1\n" in out, out
    assert "stacks asked from " in outs["other"], outs["other"]
    live = {r: stacks.read_stacks(stacks.stacks_path(run_dir, r, live=True)) for r in (0, 1)}
    assert all(s is not None and s.threads for s in live.values()), live
    sleep_line = _line_of(FAILING_JOB, "time.sleep(ctx.args")
    reduce_line = _line_of(FAILING_JOB, "ctx.dist.all_reduce(t")
    at = {r: s.user_frame() for r, s in live.items()}
    assert (at[1].file, at[1].line) == (str(FAILING_JOB), sleep_line), at
    assert (at[0].file, at[0].line) == (str(FAILING_JOB), reduce_line), at
    assert "VERDICT: hang - culprit rank(s) 1" in out, out
    stopped = next(line for line in out.splitlines() if "stopped at" in line)
    assert f"failing_job.py:{sleep_line} in step: time.sleep(" in stopped, out
    # asked again while rank 1's launch hangs: rank 0 is signalled from here, rank 1's node named
    assert "  stacks asked here of ranks 0\n" in stuck.stdout, stuck.stdout
    assert ", ranks 1): no answer in 1 s: its launch is gone or stuck" in stuck.stdout, stuck.stdout


@pytest.mark.slow
def test_hang_watch_of_rank_0s_launch_gets_every_nodes_stacks(tmp_path):
    """The same two nodes with ``--hang-after 2``: rank 0's launch, seeing the hang, asks rank
    1 through its node's launch too and prints the verdict with rank 1 stopped at its sleep;
    rank 1's launch asks only its own rank."""
    out = {"here": tmp_path / "here.log", "other": tmp_path / "other.log"}
    procs = _two_nodes(tmp_path, 2, out)
    sleep_line = _line_of(FAILING_JOB, "time.sleep(ctx.args")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "VERDICT" not in out["here"].read_text():
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.5)
    finally:
        _end(procs)
    here, other = out["here"].read_text(), out["other"].read_text()
    hang = here[here.index("HANG?"):] if "HANG?" in here else here
    assert "(stacks asked of ranks 0-1; the job goes on)" in hang, here + other
    assert "): its launch asked ranks 1\n" in hang, here + other
    stopped = next(line for line in hang.splitlines() if "stopped at" in line)
    assert f"failing_job.py:{sleep_line} in step: time.sleep(" in stopped, here
    assert "stacks asked from " in other and "stacks asked from " not in here, here + other
