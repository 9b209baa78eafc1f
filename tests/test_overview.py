"""``commviz overview`` and the detail merge (``commviz merge --ranks``) on one real 4-rank gloo
run (tensor-parallel [0,1],[2,3] × data-parallel [0,2],[1,3]; rank 3 arrives 0.5 s late at one
world all_reduce). Expectations come from torch's Flight Recorder (every collective each rank
issued, by group and sequence number) and from perfetto's own protobuf classes, not from
commviz's output: the overview holds every instance of every rank and names the late rank; a
detail merge of ranks 0-1 verifies, equals the full merge restricted to those ranks, and
leaves no one-ended flow for the peers outside it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from commviz import cli
from commviz.merge import merge_run, write_shard
from commviz.merge.piece import PID_BASE
from commviz.merge.select import parse_ranks
from commviz.match.model import InstanceKey, KeyKind, Pair
from commviz.review.overview import STRAGGLERS_TRACK, KeyIndex, Names, write_overview
from commviz.merge.table import table_path, write_table
from commviz.verify import verify_pftrace
from commviz.write.read import read_pftrace, slices
from fr_compare import FR_ENV, snapshot
from harness import run_ranks
from independent import flow_ends, pg_seq

WORLD = 4
LATE_RANK, LATE_S = 3, 1.0       # far above a loaded machine's own skews, profiler start included


def _job(rank: int, world: int, run_dir: str) -> list[dict]:
    import time

    import torch

    import commviz
    import commviz.distributed as cvd

    commviz.start(run_dir)
    tp = [cvd.new_group(r, group_desc="tp") for r in ([0, 1], [2, 3])][rank // 2]
    dp = [cvd.new_group(r, group_desc="dp") for r in ([0, 2], [1, 3])][rank % 2]
    with commviz.profile(run_dir):
        t = torch.ones(256) * (rank + 1)
        for step in range(3):
            cvd.all_reduce(t, group=tp)
            out = [torch.zeros(256) for _ in range(2)]
            cvd.all_gather(out, t, group=tp)
            cvd.broadcast(t, group_src=0, group=dp)
            if step == 1 and rank == LATE_RANK:
                time.sleep(LATE_S)
            cvd.all_reduce(t)
    fr = snapshot()["fr"]                        # before the gather's own traffic
    commviz.gather(run_dir)
    write_shard(run_dir, rank)                   # on the rank's node, as a launch does
    write_table(run_dir, rank)
    return fr


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[list[dict]]]:
    run_dir = tmp_path_factory.mktemp("overview") / "run"
    fr = run_ranks(_job, WORLD, str(run_dir), env=FR_ENV)
    return run_dir, fr


def _read(path: Path) -> tuple[dict, list]:
    contents = read_pftrace(path)
    done, problems = slices(contents)
    assert problems == [] and contents.problems == []
    return contents.tracks, done


def _rank_of(tracks: dict) -> dict[int, int | None]:
    """track uuid -> the rank whose process holds it (None: above the ranks)."""
    procs = {u: t.pid - PID_BASE for u, t in tracks.items() if t.pid is not None}
    return {u: procs.get(u, procs.get(t.parent)) for u, t in tracks.items()}


def test_overview_holds_every_instance_of_every_rank(run, tmp_path: Path) -> None:
    run_dir, fr = run
    result = write_overview(run_dir, tmp_path / "overview.pftrace", progress=False)
    assert result.ranks == WORLD and result.problems == []
    assert verify_pftrace(result.out).ok
    tracks, done = _read(result.out)
    owner = _rank_of(tracks)
    seen: dict[int, set] = defaultdict(set)
    for s in done:
        if owner[s.track] is not None:
            seen[owner[s.track]].add(pg_seq(s.args["commviz.instance"]))
    for rank in range(WORLD):
        expected = {(e["group"], e["seq"]) for e in fr[rank] if not e["p2p"]}
        assert len(expected) == 12                    # 3 steps × 4 collectives
        assert seen[rank] == expected, rank
    # the late arrival is named: on the stragglers track, and on rank 3's own slice
    # (a loaded 2-core machine adds stragglers of its own: the test looks at the slept one,
    # found in torch's own list: the second world all_reduce)
    world = [e for e in fr[LATE_RANK] if e["desc"] == "default_pg"]
    slept = (world[1]["group"], world[1]["seq"])
    late = {pg_seq(s.args["commviz.instance"]): s for s in done
            if tracks[s.track].name == STRAGGLERS_TRACK}
    assert len(late) == sum(result.stragglers.values())
    assert late[slept].args["commviz.straggler"] == LATE_RANK
    assert late[slept].args["commviz.op"] == "all_reduce"
    assert late[slept].args["commviz.skew_ns"] >= LATE_S * 1e9 * 0.9
    on_ranks = [s for s in done if owner[s.track] is not None
                and pg_seq(s.args["commviz.instance"]) == slept]
    assert sorted(owner[s.track] for s in on_ranks) == list(range(WORLD))
    assert [owner[s.track] for s in on_ranks if s.args.get("commviz.straggler") == LATE_RANK
            and s.args.get("commviz.late")] == [LATE_RANK]
    # every cross-rank flow of the overview has both ends (perfetto's protos)
    ends = flow_ends(result.out)
    assert ends and min(ends.values()) >= 2


def test_key_index_gives_each_key_its_own_index() -> None:
    """The overview's compact key -> index map (arrays per group, a dict for the rest) keeps
    every kind of key apart and gives each back: sequence numbers out of order, with holes,
    far from the others, p2p, batches, annotations, graph replays."""
    c = KeyKind.COLLECTIVE
    keys = [InstanceKey(c, "0", 5), InstanceKey(c, "0", 3), InstanceKey(c, "1", 5),
            InstanceKey(c, "0", 1), InstanceKey(c, "0", 10**9), InstanceKey(c, "0", -2),
            InstanceKey(c, "0", 3, replay=1), InstanceKey(c, "0", 3, replay=("in trace", 2)),
            InstanceKey(KeyKind.USER, "0", 3), InstanceKey(KeyKind.PROFILER, "0", 3),
            InstanceKey(KeyKind.P2P, "0", 3, 0, 1), InstanceKey(KeyKind.P2P, "0", 3, 1, 0),
            InstanceKey(KeyKind.BATCH, "0", pairs=(Pair(0, 1, "3"), Pair(1, 0, "3"))),
            InstanceKey(c, "0", 2)]
    index = KeyIndex(Names())
    for n, key in enumerate(keys):
        assert index.find(key) is None
        assert index.add(key) == n
    assert len(index) == len(keys)
    for n, key in enumerate(keys):
        assert index.find(key) == n and index.key(n) == key
    assert index.find(InstanceKey(c, "0", 4)) is None          # a hole between known ones
    assert index.find(InstanceKey(c, "2", 5)) is None          # an unknown group


def test_only_the_small_tables_are_read(run, tmp_path: Path) -> None:
    """The overview needs nothing but the comm tables: the shards, matched runs, records and
    traces can be gone."""
    run_dir, _ = run
    alone = tmp_path / "tables"
    alone.mkdir()
    for rank in range(WORLD):
        (alone / table_path(alone, rank).name).write_bytes(table_path(run_dir, rank).read_bytes())
    full = write_overview(run_dir, tmp_path / "a.pftrace", progress=False)
    small = write_overview(alone, tmp_path / "b.pftrace", progress=False)
    assert small.out.read_bytes() == full.out.read_bytes()


def _no_flows(tracks: dict, done: list, ranks: set[int]) -> list[tuple]:
    owner = _rank_of(tracks)
    return sorted((owner[s.track], tracks[s.track].name, s.start, s.end, s.name,
                   sorted(s.args.items())) for s in done if owner[s.track] in ranks)


def test_detail_merge_of_a_subset(run, tmp_path: Path) -> None:
    run_dir, fr = run
    full = merge_run(run_dir, tmp_path / "full.pftrace", progress=False, workers=1)
    part = merge_run(run_dir, tmp_path / "part.pftrace", progress=False, workers=1,
                     ranks=[0, 1])
    assert full.problems == [] and part.problems == [] and part.stats["merged_ranks"] == 2
    assert verify_pftrace(part.out).ok
    ft, fd = _read(full.out)
    pt, pd = _read(part.out)
    assert {t.pid - PID_BASE for t in pt.values() if t.pid is not None} == {0, 1}
    # the same slices, names, times and args on ranks 0 and 1 as in the full merge
    assert _no_flows(pt, pd, {0, 1}) == _no_flows(ft, fd, {0, 1})
    # flows: the full merge's flows of ranks 0-1, less those whose other ends were on 2-3
    ends = flow_ends(part.out)
    assert min(ends.values()) >= 2
    full_owner, part_owner = _rank_of(ft), _rank_of(pt)
    full_ranks: dict[int, set] = defaultdict(set)
    for s in fd:
        for f in s.flow_ids:
            full_ranks[f].add(full_owner[s.track])
    part_ids = {f for s in pd if part_owner[s.track] is not None for f in s.flow_ids}
    assert part_ids == {f for f, held in full_ranks.items()
                        if len(held & {0, 1}) >= 2 or held in ({0}, {1})}
    # the dp group [0, 2] and [1, 3] instances: one selected rank each, so no flow at all
    dp_pgs = {e["group"] for e in fr[0] if e["desc"] == "dp"} | \
        {e["group"] for e in fr[1] if e["desc"] == "dp"}
    dp_slices = [s for s in pd if part_owner[s.track] is not None and s.categories == ("commviz",)
                 and s.args.get("Process Group Name") in dp_pgs]
    assert len(dp_slices) == 6 and all(not s.flow_ids for s in dp_slices)


def test_detail_merge_leaves_no_one_ended_flow_for_a_missing_peer(run, tmp_path: Path) -> None:
    run_dir, _ = run
    part = merge_run(run_dir, tmp_path / "odd.pftrace", progress=False, workers=1,
                     ranks=[0, 3])             # no group holds both: only the world's flows
    ends = flow_ends(part.out)
    assert ends and min(ends.values()) >= 2
    assert verify_pftrace(part.out).ok


@pytest.mark.parametrize("ranks, says", [("5-2", "'5-2' is not a range"),
                                         ("0,x", "'x' is not a rank"),
                                         ("1,7,9-12", "rank(s) 7,9-12 not in this run")])
def test_bad_selection_is_one_clear_error(run, tmp_path: Path, capsys, ranks: str,
                                          says: str) -> None:
    run_dir, _ = run
    code = cli.main(["merge", str(run_dir), "-o", str(tmp_path / "x.pftrace"), "--ranks", ranks])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
    assert not (tmp_path / "x.pftrace").exists()


def test_report_suggests_a_detail_merge_that_runs(run, tmp_path: Path, capsys) -> None:
    run_dir, _ = run
    assert cli.main(["report", str(run_dir), "--plots", str(tmp_path / "plots")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "commviz merge" in x)
    command = line[line.index("commviz merge"):].split()
    ranks = parse_ranks(command[command.index("--ranks") + 1])
    assert LATE_RANK in ranks and len(ranks) >= 2          # the straggler and its peers
    out = tmp_path / "detail.pftrace"
    assert cli.main(command[1:] + ["-o", str(out)]) == 0
    assert verify_pftrace(out).ok
