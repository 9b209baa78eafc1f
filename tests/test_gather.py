"""commviz.gather on real gloo jobs: shared run dir, per-node run dirs, a rank with no record;
the tables-only gather (bytes per rank independent of trace size, checked against Flight
Recorder), and its fallback for a rank whose record could not be written."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
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
        "commviz_rank0.pkl", "commviz_rank1.pkl", "gather.json", "trace_rank0.json.gz",
        "trace_rank1.json.gz"]
    from commviz.gathered import load_summary

    assert load_summary(tmp_path / "shared")["received"] == {"0": 0, "1": 0}


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


# -- tables-only gather: each rank converts on its node and sends its comm table alone ---------

def _tables_job(rank: int, world: int, base: str, compute: int, skip_rank: int | None) -> dict:
    """Three collectives per step over 2 steps; ``compute`` tiny ops per step fill the trace."""
    from fr_compare import snapshot

    import commviz.distributed as dist

    run_dir = Path(base) / f"node{rank}"
    commviz.start(run_dir, flush_interval=None)
    with commviz.profile(run_dir):
        t = torch.ones(64) * rank
        for _ in range(2):
            for _ in range(compute):
                t = t * 1.0
            dist.all_reduce(t)
            dist.broadcast(t, src=1)
            dist.all_gather([torch.zeros(64) for _ in range(world)], t)
    fr = snapshot()["fr"]
    if rank == skip_rank:  # its record cannot be written: a directory squats on the name
        (run_dir / schema.record_name(rank)).mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = commviz.gather(run_dir, mode="tables")
    return {"fr": fr, "received": res.received, "sent": res.sent, "shared": res.shared,
            "missing": res.missing, "unconverted": res.unconverted,
            "warnings": [str(w.message) for w in caught]}


def _trace_bytes(node: Path) -> int:
    return sum(p.stat().st_size for p in node.glob("trace_rank*.json.gz"))


@pytest.fixture(scope="module")
def tables_runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    from fr_compare import FR_ENV

    out = {}
    for name, compute in (("light", 0), ("heavy", 3000)):
        base = tmp_path_factory.mktemp(f"tables-{name}")
        out[name] = base, run_ranks(_tables_job, 3, str(base), compute, None, env=FR_ENV)
    return out


def test_tables_gather_sends_bytes_independent_of_trace_size(tables_runs) -> None:
    from commviz.gathered import load_summary
    from independent import pg_seq
    from commviz.review.overview import write_overview
    from commviz.merge.table import table_name
    from commviz.write.read import read_pftrace, slices

    light, heavy = tables_runs["light"], tables_runs["heavy"]
    # the traces differ a lot (on every node), the collectives do not
    for rank in range(3):
        assert _trace_bytes(heavy[0] / f"node{rank}") > 20 * _trace_bytes(light[0] / f"node{rank}")
        assert len(heavy[1][rank]["fr"]) == len(light[1][rank]["fr"]) == 6
    per_run = {}
    for name, (base, results) in tables_runs.items():
        node0 = base / "node0"
        summary = load_summary(node0)
        assert summary is not None and summary["mode"] == "tables"
        assert results[0]["shared"] == [0] and results[0]["missing"] == []
        assert results[0]["unconverted"] == []
        # only the comm tables travelled: rank 0's dir has no other rank's record, trace,
        # shard or matched run, and each rank's bytes are its table plus the name list
        assert results[0]["sent"] == {r: [table_name(r)] for r in (1, 2)}
        others = {p.name for p in node0.iterdir() if p.name.startswith(
            ("commviz_rank", "trace_rank", "shard_rank", "matched_rank"))
            and not any(p.name.startswith(f"{k}_rank0") for k in ("commviz", "trace", "shard",
                                                                   "matched"))}
        assert others == set()
        received = {int(r): n for r, n in summary["received"].items()}
        for r in (1, 2):
            table = (base / f"node{r}" / table_name(r)).stat().st_size
            assert (node0 / table_name(r)).stat().st_size == table
            names = len(f'["{table_name(r)}"]')
            assert received[r] == table + names + 2 * 8, (r, received[r], table)
        assert received[0] == 0
        per_run[name] = received
        # what arrived is enough: the overview on rank 0's node holds every rank's collectives
        # as Flight Recorder counted them
        over = write_overview(node0, base / "overview.pftrace", progress=False)
        assert over.ranks == 3 and over.problems == []
        done, problems = slices(read_pftrace(over.out))
        assert problems == []
        seen = {pg_seq(s.args["commviz.instance"]) for s in done
                if md.PG_NAME in s.args}             # the ranks' lane slices, not the summary
        expected = {(e["group"], e["seq"]) for res in results for e in res["fr"]}
        assert seen == expected
    for r in (1, 2):   # bytes per rank: the same within a few bytes, whatever the trace size
        assert abs(per_run["heavy"][r] - per_run["light"][r]) <= 0.02 * per_run["light"][r]


def test_tables_gather_falls_back_for_a_rank_without_a_record(tmp_path: Path) -> None:
    """A rank whose record cannot be written sends its journal and traces instead of a table:
    rank 0 rebuilds its records; nothing is missing."""
    from commviz.gathered import load_summary
    from commviz.trace.run import load_run

    results = run_ranks(_tables_job, 3, str(tmp_path), 0, 2)
    assert results[0]["missing"] == [] and results[0]["unconverted"] == [2]
    assert any("rank 2 could not write its record" in w for w in results[2]["warnings"])
    node0 = tmp_path / "node0"
    assert load_summary(node0)["unconverted"] == [2]
    sent = results[0]["sent"][2]
    assert "comm_rank2.json" not in sent and any(n.endswith(".journal") for n in sent)
    run = load_run(node0)
    rebuilt = run.ranks[2].record
    assert rebuilt is not None and [c[md.OP] for c in rebuilt["collectives"]] == \
        ["all_reduce", "broadcast", "all_gather"] * 2, run.problems
