"""``commviz overview`` and the detail merge (``commviz merge --ranks``) on one real 4-rank gloo
run (tensor-parallel [0,1],[2,3] × data-parallel [0,2],[1,3]; rank 3 arrives 0.5 s late at one
world all_reduce). Expectations come from torch's Flight Recorder (every collective each rank
issued, by group and sequence number) and from perfetto's own protobuf classes, not from
commviz's output: the overview holds every instance of every rank and names the late rank; a
detail merge of ranks 0-1 verifies, equals the full merge restricted to those ranks, and
leaves no one-ended flow for the peers outside it.

Folding (above 64 ranks) is checked on comm tables of a simulated TP x DP job with a straggler
and a desync planted at known ranks: the plant says which ranks keep their own lanes and what
every folded lane must hold, read back with perfetto's protos."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from collections import defaultdict
from pathlib import Path
from statistics import median_low

import pytest

from commviz import cli
from commviz import metadata as md
from commviz.merge import merge_run, write_shard
from commviz.merge.piece import PID_BASE
from commviz.merge.select import parse_ranks
from commviz.match.model import InstanceKey, KeyKind, Pair
from commviz.review.fold import KeyIndex, Names
from commviz.review.overview import STRAGGLERS_TRACK, write_overview
from commviz.merge.table import table_path, write_table
from commviz.verify import verify_pftrace
from commviz.write.read import read_pftrace, slices
from fr_compare import FR_ENV, snapshot
from harness import run_ranks
from independent import flow_ends, pg_seq
from independent import slices as pb_slices

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
            InstanceKey(KeyKind.P2P, "0", 1, 0, 1), InstanceKey(KeyKind.P2P, "0", 10**9, 0, 1),
            InstanceKey(KeyKind.BATCH, "0", pairs=(Pair(0, 1, "3"), Pair(1, 0, "3"))),
            InstanceKey(c, "0", 2)]
    names = Names()
    index = KeyIndex(names)
    for n, key in enumerate(keys):
        assert index.find(key) is None
        assert index.add(key) == n
    assert len(index) == len(keys)
    for n, key in enumerate(keys):
        assert index.find(key) == n and index.key(n) == key
    assert index.find(InstanceKey(c, "0", 4)) is None          # a hole between known ones
    assert index.find(InstanceKey(c, "2", 5)) is None          # an unknown group
    # every group's numbered collective, the far one kept in the dict too, is numbered (the
    # warm-up and desync rules go by these numbers, as the report's do)
    pg, seq = index.numbered()
    for n, key in enumerate(keys):
        if key.kind is c and key.replay is None:
            assert (names.names[pg[n]], seq[n]) == (key.pg, key.seq), key
        else:
            assert pg[n] == -1, key


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


# -- folding alike ranks: comm tables of a simulated TP x DP job, outliers planted ---------------
#
# Each rank's table is written with the table module's own writer from planted times; what the
# overview must show comes from the plant alone: the planted straggler and desynced rank keep
# their own lanes with every planted slice, each group's folded lane names exactly its other
# ranks, and its min/median/max are those of the planted times of those ranks. The trace is read
# back with perfetto's own protos (``independent.slices``).

SIM_TP, SIM_STEPS = 4, 3
SLOT_NS, JITTER_NS, LATE_NS = 10_000_000, 20_000, 5_000_000
SIM_T0 = 1_700_000_000_000_000_000


def _sim_groups(world: int) -> dict[str, list[int]]:
    groups = {"0": list(range(world))}
    groups.update({f"tp{i}": list(range(i * SIM_TP, (i + 1) * SIM_TP))
                   for i in range(world // SIM_TP)})
    groups.update({f"dp{j}": list(range(j, world, SIM_TP)) for j in range(SIM_TP)})
    return groups


def _sim_run(run_dir: Path, world: int, straggler: int | None = None,
             desync: int | None = None) -> tuple[dict, dict[str, list[int]]]:
    """Write the tables; return the plant, (rank, pg, seq) -> (start, end, bytes), and the
    groups. ``straggler`` arrives LATE_NS late at its DP group's collective of step 1;
    ``desync`` records twice the bytes of its peers at its DP group's seq 2."""
    from commviz.match.artifact import Clock, PgInfo
    from commviz.merge.table import CommTable, Flag, Row, save

    groups = _sim_groups(world)

    def mine(r: int) -> dict[str, str]:
        return {"tp": f"tp{r // SIM_TP}", "dp": f"dp{r % SIM_TP}", "world": "0"}

    schedule = [("tp", "all_reduce", 1 << 20), ("tp", "all_reduce", 1 << 20),
                ("dp", "reduce_scatter_tensor", 4 << 20), ("world", "all_reduce", 8)] * SIM_STEPS
    rng = random.Random(7)
    plant: dict[tuple[int, str, int], tuple[int, int, int]] = {}
    seqs: dict[tuple[int, str], int] = defaultdict(int)
    for n, (kind, op, size) in enumerate(schedule):
        base = SIM_T0 + n * SLOT_NS
        for pg in sorted({mine(r)[kind] for r in range(world)}):
            starts = {r: base + rng.randrange(JITTER_NS) for r in groups[pg]}
            if kind == "dp" and n // 4 == 1 and straggler in groups[pg]:
                starts[straggler] += LATE_NS
            last = max(starts.values())
            for r in groups[pg]:
                seqs[(r, pg)] += 1
                seq = seqs[(r, pg)]
                got = size * 2 if (r == desync and kind == "dp" and seq == 2) else size
                plant[(r, pg, seq)] = (starts[r], last + 100_000 + rng.randrange(JITTER_NS), got)
    run_dir.mkdir(parents=True)
    for r in range(world):
        rows = sorted((Row(pg, op_of(pg, seq), InstanceKey(KeyKind.COLLECTIVE, pg, seq), s, e, b,
                           ctype_of(pg, seq), Flag(0))
                       for (rank, pg, seq), (s, e, b) in plant.items() if rank == r),
                      key=lambda row: (row.start_ns, row.end_ns))
        pgs = {pg: PgInfo(pg.rstrip("0123456789") or "default_pg", groups[pg])
               for pg in mine(r).values()}
        save(CommTable(r, f"node{r // 8}", f"sim-{r}", Clock(0, "measured"), pgs, [], rows),
             table_path(run_dir, r))
    return plant, groups


def op_of(pg: str, seq: int) -> str:
    return "reduce_scatter_tensor" if pg.startswith("dp") else "all_reduce"


def ctype_of(pg: str, seq: int) -> str:
    return "reduce_scatter" if pg.startswith("dp") else "all_reduce"


def _ranks_of(text: str) -> set[int]:
    """The overview's rank runs ("0-4, 6-7, 13-125 step 8") read back."""
    out: set[int] = set()
    for part in text.split(", "):
        span, _, step = part.partition(" step ")
        first, _, last = span.partition("-")
        out.update(range(int(first), int(last or first) + 1, int(step or 1)))
    return out


def _check_fold(path: Path, plant: dict, groups: dict[str, list[int]], kept: set[int]) -> None:
    """Everything the overview at ``path`` must show, from the plant."""
    got = pb_slices(path)
    lanes = [s for s in got if s.args.get(md.PG_NAME) is not None]
    # the kept ranks: a process each, holding exactly their planted collectives at their times
    procs = {s.process for s in lanes if s.process.startswith("rank ")}
    assert procs == {f"rank {r} · node{r // 8}" for r in kept}
    for r in kept:
        mine = sorted((s.args[md.PG_NAME], s.args["commviz.seq"], s.ts, s.ts + s.dur)
                      for s in lanes if s.process == f"rank {r} · node{r // 8}")
        assert mine == sorted((pg, seq, st, en) for (rank, pg, seq), (st, en, _) in plant.items()
                              if rank == r)
    # the folded lanes: per group the other ranks, every instance once, their spread exact;
    # alike groups (the TP groups not holding a kept rank) fold into one lane per class
    folded = [s for s in lanes if s.process.startswith("alike ranks")]
    by_pg: dict[str, list] = defaultdict(list)
    classes: dict[str, list] = defaultdict(list)
    for s in folded:
        if "commviz.alike_groups" in s.args:
            classes[s.args["commviz.folded_groups"]].append(s)
        else:
            by_pg[s.args[md.PG_NAME]].append(s)
    in_class = {f"tp{n}": text for text in classes for n in _ranks_of(text.replace("tp", ""))}
    assert set(by_pg) | set(in_class) == set(groups) and not set(by_pg) & set(in_class)
    assert not {pg for pg in in_class if set(groups[pg]) & kept}     # exceptions: their own lanes
    tp = {pg for pg in groups if pg.startswith("tp")}
    assert len(tp - set(in_class)) <= len(kept)                      # the rest fold
    for pg, members in groups.items():
        if pg in in_class:
            continue
        alike = [r for r in members if r not in kept]
        seqs = sorted(s.args["commviz.seq"] for s in by_pg[pg])
        assert seqs == sorted({seq for (_, g, seq) in plant if g == pg})
        for s in by_pg[pg]:
            assert _ranks_of(s.args["commviz.folded_ranks"]) == set(alike), pg
            assert s.track.startswith("PG ") and s.track.endswith(
                f"ranks {s.args['commviz.folded_ranks']} (alike)")
            times = [plant[(r, pg, s.args["commviz.seq"])] for r in alike]
            starts, ends = sorted(t[0] for t in times), sorted(t[1] for t in times)
            assert s.args["commviz.alike_ranks"] == len(alike)
            # the slice is the median rank; the args say how far the first and last are
            assert (s.ts, s.ts + s.dur) == (median_low(starts), median_low(ends))
            assert (s.ts - s.args["commviz.start_early_ns"],
                    s.ts + s.args["commviz.start_late_ns"]) == (starts[0], starts[-1])
            end = s.ts + s.dur
            assert (end - s.args["commviz.end_early_ns"],
                    end + s.args["commviz.end_late_ns"]) == (ends[0], ends[-1])
            everyone = [plant[k] for r in members if (k := (r, pg, s.args["commviz.seq"])) in plant]
            last = max(t[0] for t in everyone)
            waits = sorted(max(0, min(last, t[1]) - t[0]) for t in times)
            assert (s.args["commviz.wait_median_ns"], s.args["commviz.wait_max_ns"]) == (
                median_low(waits), waits[-1])
    for text, slices in classes.items():
        pgs = [pg for pg, t in in_class.items() if t == text]
        assert sorted(s.args["commviz.seq"] for s in slices) == sorted(
            {seq for (_, g, seq) in plant if g == pgs[0]})
        for s in slices:
            # the median group's median rank; the spread over every rank of the class
            seq = s.args["commviz.seq"]
            times = {pg: [plant[(r, pg, seq)] for r in groups[pg]] for pg in pgs}
            assert s.args["commviz.alike_groups"] == len(pgs)
            assert s.args["commviz.alike_ranks"] == sum(map(len, times.values()))
            assert s.ts == median_low([median_low([t[0] for t in ts]) for ts in times.values()])
            assert s.ts + s.dur == median_low([median_low([t[1] for t in ts])
                                               for ts in times.values()])
            every = [t for ts in times.values() for t in ts]
            assert s.ts - s.args["commviz.start_early_ns"] == min(t[0] for t in every)
            assert s.ts + s.args["commviz.start_late_ns"] == max(t[0] for t in every)
            assert not s.flow_ids
    # every group keeps its summary, or its class's; flows join an instance's kept slices and
    # its folded one
    summaries = {s.track for s in got if "commviz.skew_ns" in s.args and
                 s.track.endswith(" · instances")}
    assert len(summaries) == len(groups) - len(in_class) + len(classes)
    ends = flow_ends(path)
    assert min(ends.values(), default=2) >= 2
    flows = {(s.args.get(md.PG_NAME), s.args["commviz.seq"]) for s in lanes if s.flow_ids}
    assert flows == {(pg, seq) for (r, pg, seq) in plant if r in kept}


def test_fold_keeps_the_planted_straggler_and_desync(tmp_path: Path) -> None:
    world, straggler, desync = 128, 37, 90
    plant, groups = _sim_run(tmp_path / "run", world, straggler=straggler, desync=desync)
    result = write_overview(tmp_path / "run", tmp_path / "o.pftrace", progress=False)
    assert result.problems == [] and result.ranks == world
    assert verify_pftrace(result.out).ok
    assert sorted(result.kept) == [straggler, desync] and result.folded == world - 2
    assert "straggler x1" in result.kept[straggler]
    assert [k for k in result.kept[desync] if k.startswith("desync")] == [
        f"desync dp{desync % SIM_TP} #2 (size)"]
    _check_fold(result.out, plant, groups, {straggler, desync})
    got = pb_slices(result.out)
    late = [s for s in got if s.track == STRAGGLERS_TRACK]
    assert [(s.args["commviz.straggler"], pg_seq(s.args["commviz.instance"])) for s in late] == [
        (straggler, (f"dp{straggler % SIM_TP}", 2))]
    (desynced,) = [s for s in got if s.track.startswith("desyncs")]
    assert (desynced.args["commviz.desync_ranks"], desynced.args["commviz.seq"],
            desynced.args["commviz.desync"]) == (str(desync), 2, "size")
    # the kept ranks' processes say why
    from commviz.write.read import read_pftrace

    labels = {t.process_name: t.labels for t in read_pftrace(result.out).tracks.values()
              if t.pid is not None}
    assert "straggler x1" in labels[f"rank {straggler} · node{straggler // 8}"]
    assert "desync dp2 #2 (size)" in labels[f"rank {desync} · node{desync // 8}"]


def test_fold_is_exact_when_nothing_is_planted(tmp_path: Path) -> None:
    plant, groups = _sim_run(tmp_path / "run", 128)
    result = write_overview(tmp_path / "run", tmp_path / "o.pftrace", progress=False)
    assert result.kept == {} and result.folded == 128 and result.desyncs == []
    assert result.stragglers == {}
    assert verify_pftrace(result.out).ok
    _check_fold(result.out, plant, groups, set())


def test_fold_does_not_depend_on_its_chunks(tmp_path: Path, monkeypatch) -> None:
    """The fold works a chunk of rows at a time; chunks of 5 rows (smaller than a table, than
    an instance's rows) give the same trace, byte for byte, as chunks larger than the run."""
    from commviz.review import fold

    _sim_run(tmp_path / "run", 128, straggler=37, desync=90)
    whole = write_overview(tmp_path / "run", tmp_path / "a.pftrace", progress=False)
    monkeypatch.setattr(fold, "CHUNK", 5)
    small = write_overview(tmp_path / "run", tmp_path / "b.pftrace", progress=False)
    assert small.kept == whole.kept and small.out.read_bytes() == whole.out.read_bytes()


def test_a_rank_that_skipped_a_collective_keeps_its_lanes(tmp_path: Path) -> None:
    """A rank without its group's last collective (it stopped early): a desync of kind
    missing, the rank kept; with ``fold=False`` every rank keeps its process."""
    run = tmp_path / "run"
    plant, groups = _sim_run(run, 128)
    from commviz.merge.table import load, save

    table = load(table_path(run, 50))
    table.rows = [r for r in table.rows if not (r.pg.startswith("dp") and r.key.seq == 3)]
    save(table, table_path(run, 50))
    result = write_overview(run, tmp_path / "o.pftrace", progress=False)
    assert list(result.kept) == [50] and result.kept[50] == ["desync dp2 #3 (missing)"]
    del plant[(50, "dp2", 3)]
    _check_fold(result.out, plant, groups, {50})
    whole = write_overview(run, tmp_path / "all.pftrace", progress=False, fold=False)
    procs = {s.process for s in pb_slices(whole.out)
             if s.process.startswith("rank ")}
    assert len(procs) == 128 and whole.folded == 0


def test_two_readers_make_the_same_trace(tmp_path: Path, monkeypatch) -> None:
    """Above READ_IN_TWO ranks a second process reads half the tables; the trace is the same,
    byte for byte, as one process reading them all."""
    from commviz.review import overview

    _sim_run(tmp_path / "run", 128, straggler=37, desync=90)
    one = write_overview(tmp_path / "run", tmp_path / "a.pftrace", progress=False)
    monkeypatch.setattr(overview, "READ_IN_TWO", 100)
    monkeypatch.setattr(overview.os, "sched_getaffinity", lambda pid: {0, 1})
    two = write_overview(tmp_path / "run", tmp_path / "b.pftrace", progress=False)
    assert two.kept == one.kept and two.out.read_bytes() == one.out.read_bytes()


def test_rank_runs_read_back_exactly() -> None:
    """Large groups are named by runs of ranks (lane names, comm tables): read back, they are
    the ranks they were made from, whatever the set."""
    from commviz.metadata import group_ranks, ranks_text

    rng = random.Random(3)
    sets = [set(range(16384)), set(range(5, 16384, 8)) - {13}, {0, 1}, {4}, {0, 2, 3, 9},
            set(range(0, 64, 3)) | set(range(100, 110)) | {7, 200}]
    sets += [{rng.randrange(300) for _ in range(rng.randrange(1, 80))} for _ in range(300)]
    for ranks in sets:
        text = ranks_text(ranks)
        assert group_ranks(text) == tuple(sorted(ranks)) and _ranks_of(text) == ranks
    assert ranks_text(set(range(5, 16384, 8)) - {13}) == "5, 21-16381 step 8"
    assert group_ranks("[0, 1, 2]") == (0, 1, 2)          # the profiler's own spelling


def test_bytes_stay_flat_as_alike_ranks_grow(tmp_path: Path) -> None:
    """Four times the ranks (and the TP groups with them), all alike: about the same bytes
    (alike groups fold into one lane; each group's lanes made it grow with the ranks, and a
    lane naming a world-size list with ranks squared)."""
    sizes = {}
    for world in (256, 1024):
        _sim_run(tmp_path / f"run{world}", world)
        sizes[world] = write_overview(tmp_path / f"run{world}", tmp_path / f"o{world}.pftrace",
                                      progress=False).bytes
    assert sizes[1024] <= 1.1 * sizes[256]


def test_alike_pipeline_groups_fold_and_the_planted_ranks_keep_theirs(tmp_path: Path) -> None:
    """``scripts/bench_scale.py``'s TP 8 x PP 4 job at 256 ranks (8 replicas, the alike ones
    derived from a template's tables): the planted late rank and desynced rank are kept, each
    family's groups holding them are drawn on their own and named by the folded lanes, and
    every other group folds: one class per family, its p2p transfers by place in the group."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_scale

    world = 256
    bench_scale.write_tables(tmp_path / "run", world)
    late, desync = bench_scale.LATE_RANK, bench_scale.desync_rank(world)
    result = write_overview(tmp_path / "run", tmp_path / "o.pftrace", progress=False)
    assert sorted(result.kept) == [late, desync] and result.problems == []
    assert verify_pftrace(result.out).ok
    got = pb_slices(result.out)
    assert {s.process for s in got if s.process.startswith("rank ")} == {
        f"rank {r} · node{r // 8}" for r in (late, desync)}
    mine = {r: set(bench_scale._mine(r).values()) for r in (late, desync)}
    summary = [s for s in got if "commviz.alike_groups" in s.args and "commviz.skew_ns" in s.args]
    families = {s.args["commviz.folded_groups"][:2]: s for s in summary}
    assert set(families) == {"tp", "pp", "dp"}
    groups = bench_scale._groups(world)
    for family, s in families.items():
        drawn_alone = {pg for r in (late, desync) for pg in mine[r] if pg.startswith(family)}
        assert s.args["commviz.exception_groups"] == ", ".join(
            sorted(drawn_alone, key=lambda pg: int(pg[2:])))
        members = [pg for pg in groups if pg.startswith(family)]
        assert s.args["commviz.alike_groups"] == len(members) - len(drawn_alone)
    sends = [s for s in summary if s.args["commviz.op"] == "send"]
    # a transfer's place: from stage 0 to 1, the same in every pipeline
    assert sends and all(s.name.startswith("send 0->1 ") or s.name.startswith("send 1->2 ")
                         or s.name.startswith("send 2->3 ") for s in sends)
    assert {s.args["commviz.alike_groups"] for s in sends} == {world // 4 - 2}
    # the folded ranks' lane counts every rank of its groups (a transfer holds two of four)
    tracks = {t.name for t in read_pftrace(result.out).tracks.values() if t.name}
    alike = world // 4 - 2
    assert f"PG pp · {alike:,} alike groups, {alike * 4:,} ranks (alike)" in tracks


PIPELINES = Path(__file__).parent / "fixtures" / "gpu" / "proof-4x"


@pytest.mark.parametrize("name", ["pp-1f1b", "pp-interleaved"])
def test_a_pipelines_transfers_wait_in_its_bubbles_not_for_a_straggler(name: str,
                                                                        tmp_path: Path) -> None:
    """Real 4-stage NCCL pipelines (4 x H200, torch.distributed.pipelining): every NCCL kernel
    the profiler saw is a SendRecv, so every instance is one of the schedule's transfers, whose
    waits are its bubbles. The overview reads the comm tables with the review's rule, and
    names no straggler, folded or not (before, it named ranks 1 and 2 in 1F1B's)."""
    run = tmp_path / name
    shutil.copytree(PIPELINES / name, run)
    kernels = {e["name"] for path in run.glob("trace_rank*.json.gz")
               for e in json.loads(gzip.open(path).read())["traceEvents"]
               if e.get("cat") == "kernel" and "nccl" in e.get("name", "")}
    assert kernels and all("SendRecv" in k for k in kernels), kernels
    merge_run(run, progress=False)
    for fold in (False, True):
        result = write_overview(run, tmp_path / f"overview{fold}.pftrace", progress=False,
                                fold=fold)
        assert result.problems == [] and result.instances > 0
        assert result.stragglers == {}, (fold, result.stragglers)
