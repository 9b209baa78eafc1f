"""Real launches from YAML through the `commviz launch` CLI and torchrun (gloo, 2 and 4 ranks).

Each test runs the real command in a subprocess, then reads back what the ranks left in the run
dir: records (through the safe loader), profiler traces, the resolved config, and the merged
trace (verified) once commviz.merge is installed.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from commviz import load_record
from commviz import metadata as md
from commviz.launch import torchrun
from independent import flow_ends

REPO = Path(__file__).resolve().parents[1]


def launch(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commviz", "launch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path, world: int) -> list[dict]:
    return [load_record(run_dir / f"commviz_rank{r}.pkl") for r in range(world)]


def check_merged(run_dir: Path, out: str) -> None:
    """The launch merged the run and the merged trace verifies."""
    merged = run_dir / "merged.pftrace"
    assert merged.exists() and f"merged:  {merged}" in out, out
    from commviz.verify import verify_pftrace

    report = verify_pftrace(merged)
    assert report.ok, report.errors[:5]


def by_group(record: dict) -> dict[tuple[str, str], list[dict]]:
    """This rank's recorded collectives by (group description, op)."""
    out = collections.defaultdict(list)
    for c in record["collectives"]:
        out[(c[md.PG_DESC], c[md.OP])].append(c)
    return out


def test_default_config_two_ranks_with_overrides(tmp_path):
    result = launch("--set", f"output.dir={tmp_path}", "--set", "output.run_name=run",
                    "--set", "workload.steps=4", "--set", "profile.active=3",
                    "--set", "workload.collectives[0].repeat=2", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    run_dir = tmp_path / "run"
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["workload"]["steps"] == 4 and resolved["profile"]["active"] == 3
    assert resolved["workload"]["collectives"][0]["repeat"] == 2
    assert (run_dir / "launch.log").read_text().count("-m commviz.launch.elastic") >= 1
    recs = records(run_dir, 2)
    calls = 1 + 4                                    # warmup step + profiled steps
    for rank, rec in enumerate(recs):
        assert rec["rank"] == rank and rec["world_size"] == 2 and rec["exit"] == "gathered"
        groups = by_group(rec)
        assert len(groups[("default_pg", "all_reduce")]) == 2 * calls     # repeat 2 (--set)
        assert len(groups[("default_pg", "broadcast")]) == calls
        assert {c[md.ROOT] for c in groups[("default_pg", "broadcast")]} == {1}
        # batch_isend_irecv reaches c10d as its send and its receive
        assert len(groups[("tp", "send")]) == len(groups[("tp", "recv")]) == calls
        tp_ar = groups[("tp", "all_reduce")]
        assert len(tp_ar) == calls and all(c[md.ASYNC] for c in tp_ar)
        assert [c[md.PG_RANKS] for c in groups[("dp", "all_reduce")]] == [f"[{rank}]"] * calls
        traces = sorted(p.name for p in run_dir.glob(f"trace_rank{rank}*.json.gz"))
        assert traces and traces == sorted(rec["traces"])
    # the same collective has the same sequence number on both ranks
    seqs = [[c[md.SEQ] for c in by_group(r)[("default_pg", "all_to_all_single")]] for r in recs]
    assert seqs[0] == seqs[1] and len(seqs[0]) == calls
    assert "records: 2/2 ranks" in out
    check_merged(run_dir, out)


FOUR_RANKS = """
name: tp-dp-cpu
job: {nproc_per_node: 4, backend: gloo, timeout_s: 120}
groups:
  tp: {size: 2}              # [[0, 1], [2, 3]]
  dp: {size: 2, stride: 2}   # [[0, 2], [1, 3]]
workload:
  steps: 3
  transformer: {layers: 1, batch: 1, seq: 8, hidden: 32, heads: 2, ffn_mult: 2,
                tp_group: tp, dp_group: dp}
  collectives:
    - {op: all_gather_into_tensor, group: tp, size: 64}
    - {op: broadcast, group: dp, size: 64, root: 1}
    - {op: reduce_scatter_tensor, group: world, size: 256}
profile: {warmup: 1, active: 2}
output: {dir: out, run_name: four}
"""


def test_four_ranks_tp_dp_from_yaml(tmp_path):
    (tmp_path / "tpdp.yaml").write_text(FOUR_RANKS)
    result = launch("tpdp.yaml", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    run_dir = tmp_path / "out" / "four"
    recs = records(run_dir, 4)
    tp = {0: "[0, 1]", 1: "[0, 1]", 2: "[2, 3]", 3: "[2, 3]"}
    dp = {0: "[0, 2]", 1: "[1, 3]", 2: "[0, 2]", 3: "[1, 3]"}
    calls = 1 + 3
    for rank, rec in enumerate(recs):
        tables = {(g["desc"], str(g["ranks"])) for g in rec["process_groups"]}
        assert ("tp", tp[rank]) in tables and ("dp", dp[rank]) in tables
        groups = by_group(rec)
        # transformer: an all_reduce after attention and after the MLP, one dp all_reduce
        assert len(groups[("tp", "all_reduce")]) == 2 * calls
        assert len(groups[("dp", "all_reduce")]) == calls
        assert {c[md.PG_RANKS] for c in groups[("tp", "all_reduce")]} == {tp[rank]}
        assert {c[md.PG_RANKS] for c in groups[("dp", "broadcast")]} == {dp[rank]}
        # root 1 of a dp group is its second rank, as a global rank
        assert {c[md.ROOT] for c in groups[("dp", "broadcast")]} == {int(dp[rank][-2])}
        assert any(p.name.startswith(f"trace_rank{rank}") for p in run_dir.iterdir())
    for desc, members in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]])):
        for group in members:
            seqs = [[c[md.SEQ] for c in recs[r]["collectives"] if c[md.PG_DESC] == desc]
                    for r in group]
            assert seqs[0] == seqs[1] and seqs[0]
    check_merged(run_dir, out)


def failing_job(tmp_path: Path, how: str) -> Path:
    (tmp_path / "fail.yaml").write_text(textwrap.dedent(f"""
        name: fail
        job: {{nproc_per_node: 2, timeout_s: 60}}
        workload:
          steps: 4
          entrypoint: failing_job:build
          args: {{rank: 1, at: 3, how: {how}, broadcast: false}}
          pythonpath: ["{REPO / 'tests' / 'jobs'}"]
        output: {{dir: out, run_name: run}}
        """))
    return tmp_path / "out" / "run"


def test_a_stop_during_the_trace_export_keeps_the_trace(tmp_path):
    """torchrun's SIGTERM arriving while a rank exports its trace (a survivor unwinding from a
    collective its failed peer broke; seen once in the suite on a loaded machine): the trace is
    written whole, then the rank stops as told. A real profiler and a real signal, through the
    worker's own handlers."""
    import gzip
    import json
    import os
    import signal

    import pytest
    import torch
    from torch.profiler import ProfilerActivity, profile

    from commviz.launch import worker
    from commviz.record.profiler import trace_handler

    def stop_as_it_exports(prof) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        trace_handler(tmp_path)(prof)

    before = signal.signal(signal.SIGTERM, worker._stop)
    try:
        with pytest.raises(worker.Stopped, match="SIGTERM"):
            with profile(activities=[ProfilerActivity.CPU],
                         on_trace_ready=worker._whole(stop_as_it_exports)):
                torch.ones(8).sum()
    finally:
        signal.signal(signal.SIGTERM, before)
    traces = list(tmp_path.glob("trace_rank*.json.gz"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]}
    assert "aten::sum" in names


def test_rank_failing_mid_run(tmp_path):
    run_dir = failing_job(tmp_path, "raise")
    result = launch("fail.yaml", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "FAILED: rank 1" in out and "RuntimeError: injected failure in call 3" in out
    assert "rank 0 stopped because rank 1 failed" in out
    survivor = load_record(run_dir / "commviz_rank0.pkl")
    failed = load_record(run_dir / "commviz_rank1.pkl")
    assert failed["exit"] == "failed" and len(failed["collectives"]) == 3
    # rank 0 recorded every call it made, the one left hanging by rank 1 included
    assert len(survivor["collectives"]) == 4 and survivor["exit"] == "failed"
    assert any(run_dir.glob("trace_rank0*.json.gz"))
    assert "records: 2/2 ranks" in out
    # the run is merged all the same, the trace verifies, and read without commviz every
    # flow has two ends
    check_merged(run_dir, out)
    ends = flow_ends(run_dir / "merged.pftrace")
    assert ends and all(n >= 2 for n in ends.values()), {f: n for f, n in ends.items() if n < 2}


def test_rank_killed_without_a_word(tmp_path):
    run_dir = failing_job(tmp_path, "kill")
    result = launch("fail.yaml", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    # rank 0 saw its peer vanish and says so in its own file; rank 1 died silently and is blamed
    assert "FAILED: rank 1" in out and "exit code -9" in out, out
    assert (run_dir / "logs" / "failed_rank0.json").exists()
    assert not (run_dir / "logs" / "failed_rank1.json").exists()
    assert load_record(run_dir / "commviz_rank0.pkl")["collectives"]


def test_tables_gather_writes_the_overview_instead_of_the_merge(tmp_path):
    """``output.gather: tables``: every rank's comm table, the overview made from them (it
    verifies and holds both ranks' lanes), and what travelled said; no merged trace."""
    result = launch("--set", f"output.dir={tmp_path}", "--set", "output.run_name=run",
                    "--set", "output.gather=tables", "--set", "workload.steps=3",
                    cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    run_dir = tmp_path / "run"
    overview = run_dir / "overview.pftrace"
    assert f"overview: {overview}" in out and not (run_dir / "merged.pftrace").exists()
    assert "gather:  tables, nothing travelled (all 2 ranks share the run dir)" in out
    from commviz.gathered import load_summary
    from commviz.verify import verify_pftrace
    from commviz.write.read import read_pftrace

    summary = load_summary(run_dir)
    assert summary["mode"] == "tables" and summary["received"] == {"0": 0, "1": 0}
    assert verify_pftrace(overview).ok
    procs = {t.process_name for t in read_pftrace(overview).tracks.values() if t.pid is not None}
    assert len(procs) == 2 and all(p.startswith(("rank 0 ", "rank 1 ")) for p in procs)


@pytest.mark.slow             # the launch runs in this process, its job in torchrun's
def test_the_launcher_reads_each_record_once(tmp_path, monkeypatch, capsys):
    """The merge, the report and the summary share one reading of the run dir: the launching
    process unpickles each rank's record once (the merge's workers read theirs apart)."""
    from commviz import cli
    from commviz.record import store

    reads: collections.Counter = collections.Counter()
    plain = store.loads_plain

    def counting(data, source):
        reads[Path(source).name] += 1
        return plain(data, source)

    monkeypatch.setattr(store, "loads_plain", counting)
    # the live hang watch reads the journals and records while the job runs: off here, this
    # counts what the launcher reads after the job
    code = cli.main(["launch", "--hang-after", "0", "--set", f"output.dir={tmp_path}",
                     "--set", "output.run_name=r"])
    got = capsys.readouterr()
    out = got.out + got.err
    assert code == 0, out
    records = {n: c for n, c in reads.items() if n.startswith("commviz_rank")}
    assert records == {"commviz_rank0.pkl": 1, "commviz_rank1.pkl": 1}, (reads, out)
    assert (tmp_path / "r" / "report.md").is_file() and (tmp_path / "r" / "merged.pftrace").is_file()


def test_a_single_node_rendezvous_port_lies_below_the_ephemeral_range() -> None:
    """The launcher picks a free port for torchrun's store just below the kernel's ephemeral
    range, which the sockets of jobs beside it (NCCL's, gloo's: port 0) draw from: a port
    from that range, free when chosen, could be theirs by the time torchrun binds it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.is_file():
        pytest.skip("no /proc ephemeral port range here")
    low = int(ranges.read_text().split()[0])
    if low < 2024:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    for _ in range(20):
        host, port = torchrun.free_endpoint().rsplit(":", 1)
        assert host == "127.0.0.1" and 1024 <= int(port) < low
        with socket.socket() as s:          # and it is free
            s.bind((host, int(port)))
