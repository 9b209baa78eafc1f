"""commviz.gather on real gloo jobs: shared run dir, per-node run dirs, a rank with no record."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import commviz
from commviz import metadata as md
from commviz.record import schema
from harness import run_ranks


def _job(rank: int, world: int, base: str, per_node: bool, skip_rank: int | None) -> dict:
    import commviz.distributed as dist

    run_dir = Path(base) / (f"node{rank}" if per_node else "shared")
    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)
    with commviz.profile(run_dir):
        t = torch.ones(5) * rank
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
    if rank == skip_rank:  # its record cannot be written: a directory squats on the name
        (run_dir / schema.record_name(rank)).mkdir()
    with warnings.catch_warnings(record=True) as caught, commviz.patch():
        warnings.simplefilter("always")
        res = commviz.gather(run_dir)  # patched: its own traffic must still not be recorded
    return {"shared": res.shared, "sent": res.sent, "missing": res.missing,
            "warnings": [str(w.message) for w in caught]}


def test_gather_over_gloo_when_run_dirs_are_not_shared(tmp_path: Path) -> None:
    results = run_ranks(_job, 3, str(tmp_path), True, None)
    assert results[0]["shared"] == [0]
    assert sorted(results[0]["sent"]) == [1, 2]
    node0 = tmp_path / "node0"
    for rank in range(3):
        rec = commviz.load_record(node0 / schema.record_name(rank))
        assert rec["rank"] == rank and [c[md.OP] for c in rec["collectives"]] == \
            ["all_reduce", "broadcast"]
        assert rec["clock"]["offset_source"] == "same-host"
        assert (node0 / schema.trace_name(rank)).stat().st_size > 0
        assert set(results[0]["sent"].get(rank, [])) <= {schema.record_name(rank),
                                                          schema.trace_name(rank)}
    assert results[0]["missing"] == []


def test_gather_on_shared_dir_moves_nothing(tmp_path: Path) -> None:
    results = run_ranks(_job, 2, str(tmp_path), False, None)
    assert results[0]["shared"] == [0, 1] and results[0]["sent"] == {}
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == [
        "commviz_rank0.pkl", "commviz_rank1.pkl", "trace_rank0.json.gz", "trace_rank1.json.gz"]


def test_rank_that_cannot_write_is_named_and_others_kept(tmp_path: Path) -> None:
    results = run_ranks(_job, 3, str(tmp_path), True, 2)
    assert results[0]["missing"] == [2]
    assert any("rank(s) [2]" in w for w in results[0]["warnings"])
    assert any("rank 2 could not write its record" in w for w in results[2]["warnings"])
    node0 = tmp_path / "node0"
    for rank in (0, 1):
        assert commviz.load_record(node0 / schema.record_name(rank))["rank"] == rank
    assert (node0 / schema.trace_name(2)).is_file()  # what rank 2 did write still arrives
    # its journal arrives too: rank 2's records are rebuilt from it on rank 0's node
    from commviz.trace.run import load_run

    run = load_run(node0)
    rebuilt = run.ranks[2].record
    assert rebuilt is not None and [c[md.OP] for c in rebuilt["collectives"]] == \
        ["all_reduce", "broadcast"], run.problems
    assert any("rank 2 did not write its final record" in p for p in run.problems)
