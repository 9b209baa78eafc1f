"""``commviz merge`` on real gloo jobs (2 and 4 ranks, tensor- and data-parallel subgroups):
the merged .pftrace read back with perfetto's protos shows every collective on its process
group's lane on every rank with its args, cross-rank flows that link exactly the group's ranks,
every profiler event once, and bad inputs reported by file while the other ranks merge."""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from commviz import cli
from commviz import metadata as md
from commviz.errors import SourceError
from commviz.merge import merge_run, write_shard
from commviz.merge.piece import CROSS_FLOW_BIT, PID_BASE
from commviz.record import store
from commviz.trace.run import load_run
from commviz.verify import verify_pftrace
from commviz.write.read import read_pftrace, slices
from harness import run_ranks


def _job(rank: int, world: int, run_dir: str) -> None:
    import torch
    import torch.distributed as td

    import commviz
    import commviz.distributed as cvd

    commviz.start(run_dir)
    half = max(world // 2, 1)
    groups = {}
    for name, layout in (("tp", [list(range(i, i + half)) for i in range(0, world, half)]),
                         ("dp", [list(range(i, world, half)) for i in range(half)])):
        for ranks in layout:
            g = td.new_group(ranks, group_desc=name)
            if rank in ranks:
                groups[name] = g
    with commviz.profile(run_dir):
        t = torch.ones(64) * (rank + 1)
        cvd.all_reduce(t)
        cvd.all_reduce(t, group=groups["tp"])
        cvd.broadcast(t, group_src=0, group=groups["dp"])
        out = [torch.zeros(64) for _ in range(half)]
        cvd.all_gather(out, t, group=groups["tp"])
        if rank % 2 == 0:
            cvd.send(t, rank + 1)
        else:
            cvd.recv(t, rank - 1)
        cvd.barrier()
    commviz.gather(run_dir)


def _recorded(tmp_path_factory, world: int) -> Path:
    run_dir = tmp_path_factory.mktemp(f"world{world}") / "run"
    run_ranks(_job, world, str(run_dir))
    return run_dir


@pytest.fixture(scope="module")
def run4(tmp_path_factory) -> Path:
    return _recorded(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def run2(tmp_path_factory) -> Path:
    return _recorded(tmp_path_factory, 2)


@pytest.fixture
def copy4(run4: Path, tmp_path: Path) -> Path:
    shutil.copytree(run4, tmp_path / "run", ignore=shutil.ignore_patterns("merged*", "shard*"))
    return tmp_path / "run"


class Merged:
    """A merged trace read back: processes by rank, lanes, slices."""

    def __init__(self, path: Path) -> None:
        self.contents = read_pftrace(path)
        self.slices, self.problems = slices(self.contents)
        tracks = self.contents.tracks
        self.proc_rank = {u: t.pid - PID_BASE for u, t in tracks.items() if t.pid is not None}
        self.rank_of = {u: self.proc_rank.get(t.parent) for u, t in tracks.items()}
        self.lanes = {u: t.merge_key[5:] for u, t in tracks.items()
                      if t.merge_key and t.merge_key.startswith("lane ")}

    def lane_slices(self, rank: int) -> list:
        return [s for s in self.slices if s.track in self.lanes and self.rank_of[s.track] == rank]


def _as_written(value):
    """How an arg value reads back: lists, dicts and None as JSON text."""
    return orjson.dumps(value).decode() if isinstance(value, (list, dict, type(None))) else value


def test_every_collective_on_its_lane_on_every_rank(run4: Path, tmp_path: Path) -> None:
    result = merge_run(run4, tmp_path / "m.pftrace", workers=2, progress=False)
    assert result.problems == []
    assert result.stats["merged_ranks"] == 4 and result.stats["clock"].startswith("same-host")
    m = Merged(result.out)
    assert m.problems == [] and m.contents.problems == []
    procs = {u: t for u, t in m.contents.tracks.items() if t.pid is not None}
    assert sorted((t.order_rank, t.pid) for t in procs.values()) == [
        (r, PID_BASE + r) for r in range(4)]
    assert all(t.name.startswith(f"rank {t.order_rank} · ") and t.name.endswith("· cpu")
               for t in procs.values())
    root = m.contents.tracks[0]
    assert root.explicit_processes and root.explicit_children
    run = load_run(run4)
    first_lanes = []
    for rank, inp in run.ranks.items():
        record = inp.record
        groups = {g["name"]: g for g in record["process_groups"]}
        lanes = m.lane_slices(rank)
        by_key = {(m.lanes[s.track], s.args.get(md.SEQ), s.args.get(md.P2P_SEQ)): s
                  for s in lanes}
        assert len(lanes) == len(record["collectives"]) == 6
        for meta in record["collectives"]:
            s = by_key[(meta[md.PG_NAME], meta.get(md.SEQ), meta.get(md.P2P_SEQ))]
            assert s.name == meta[md.OP]
            for key, value in meta.items():
                assert s.args[key] == _as_written(value), (rank, key)
            desc = groups[meta[md.PG_NAME]]["desc"]
            track = m.contents.tracks[s.track]
            assert track.name == f"PG {desc} · ranks {groups[meta[md.PG_NAME]]['ranks']}"
            assert s.start <= meta[md.T_END] and s.end >= meta[md.T_BEGIN]   # the call's span
        order = sorted({(m.contents.tracks[u].order_rank, m.lanes[u]) for u in m.lanes
                        if m.rank_of[u] == rank})
        assert order[0][1] == "0"                                        # the world group first
        first_lanes.append(order[0])
        lane_orders = {pg: o for o, pg in order}
        assert list(lane_orders) == sorted(lane_orders, key=int)        # by group, on every rank
    assert len(set(first_lanes)) == 1


def test_cross_rank_flows_link_exactly_the_group(run4: Path, tmp_path: Path) -> None:
    out = merge_run(run4, tmp_path / "m.pftrace", workers=1, progress=False).out
    m = Merged(out)
    ranks_of_flow: dict[int, set[int]] = defaultdict(set)
    args_of_flow: dict[int, dict] = {}
    for s in m.slices:
        for fid in s.flow_ids:
            if fid & CROSS_FLOW_BIT:
                assert s.track in m.lanes
                ranks_of_flow[fid].add(m.rank_of[s.track])
                args_of_flow[fid] = s.args
    # world: all_reduce, barrier, 2 send/recv pairs; 2 tp groups x 2; 2 dp groups x 1
    assert len(ranks_of_flow) == 2 + 2 + 4 + 2
    for fid, ranks in ranks_of_flow.items():
        args = args_of_flow[fid]
        if args[md.KIND] == "p2p":
            assert ranks == {args[md.SRC], args[md.DST]}
        else:
            assert ranks == set(json.loads(args[md.PG_RANKS]))


def test_profiler_events_all_there_and_verified(run2: Path, tmp_path: Path) -> None:
    result = merge_run(run2, tmp_path / "m.pftrace", workers=1, progress=False)
    verify = pytest.importorskip("commviz.verify")
    report = verify.verify_pftrace(result.out, inputs=load_run(run2))
    assert report.ok, report.errors[:5]
    m = Merged(result.out)
    for rank, inp in load_run(run2).ranks.items():
        (trace,) = list(inp.load_traces())
        expected = sorted((e["name"], trace.ns(e["ts"]), trace.ns(e["ts"]) + round(
            e.get("dur", 0) * 1000)) for e in trace.events if e.get("ph") in ("X", "i", "I"))
        merged = sorted((s.name, s.start, s.end) for s in m.slices
                        if m.rank_of.get(s.track) == rank and s.track not in m.lanes)
        assert merged == expected


def test_json_format(run4: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(run4, run_dir, ignore=shutil.ignore_patterns("merged*", "shard*"))
    result = merge_run(run_dir, fmt="json", workers=2, progress=False)
    assert result.out == run_dir / "merged.json" and result.problems == []
    doc = json.loads(result.out.read_bytes())
    assert doc["commviz_merged"] is True
    events = doc["traceEvents"]
    inputs = sum(len(t.events) for inp in load_run(run_dir).ranks.values()
                 for t in inp.load_traces())
    lanes = [e for e in events if e.get("cat") == "commviz"]
    assert len(lanes) == 24
    pids = defaultdict(set)
    for e in events:
        if isinstance(e.get("pid"), int):
            pids[e["pid"] // 10_000_000 - 1].add(e["pid"])
    assert sorted(pids) == [0, 1, 2, 3]
    assert all(not (pids[a] & pids[b]) for a in pids for b in pids if a != b)
    assert len(events) >= inputs + len(lanes)
    again = load_run(run_dir)                 # the merged JSON is not taken for a trace
    assert again.problems == [] and sorted(again.ranks) == [0, 1, 2, 3]


def test_bad_and_missing_inputs_are_named_and_the_rest_merges(copy4: Path) -> None:
    whole = (copy4 / "trace_rank2.json.gz").read_bytes()
    (copy4 / "trace_rank2.json.gz").write_bytes(whole[: len(whole) // 3])
    for name in ("commviz_rank3.pkl", "trace_rank3.json.gz"):
        (copy4 / name).unlink()
    result = merge_run(copy4, workers=2, progress=False)
    assert result.out.exists()
    assert any(str(copy4 / "trace_rank2.json.gz") in p and "gzip" in p for p in result.problems)
    assert any("rank 3 is missing" in p for p in result.problems)
    m = Merged(result.out)
    assert m.problems == []
    assert sorted(m.proc_rank.values()) == [0, 1, 2]
    assert len(m.lane_slices(2)) == 6                     # rank 2's record still gives its lanes
    assert len([s for s in m.slices if m.rank_of.get(s.track) == 0]) > 6


def test_strict_writes_nothing(copy4: Path, capsys) -> None:
    (copy4 / "trace_rank1.json.gz").write_bytes(b"")
    with pytest.raises(SourceError, match="trace_rank1.json.gz"):
        merge_run(copy4, strict=True, progress=False)
    assert not (copy4 / "merged.pftrace").exists()
    assert cli.main(["merge", str(copy4), "--strict"]) == 2
    assert not (copy4 / "merged.pftrace").exists()
    assert "trace_rank1.json.gz" in capsys.readouterr().err
    assert cli.main(["merge", str(copy4), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("trace_rank1.json.gz") == 1
    assert "merged 4 of 4 ranks" in captured.out and (copy4 / "merged.pftrace").exists()


def test_duplicate_rank(copy4: Path) -> None:
    doc = orjson.loads(gzip.decompress((copy4 / "trace_rank1.json.gz").read_bytes()))
    doc["distributedInfo"]["rank"] = 0
    (copy4 / "stray.json").write_bytes(orjson.dumps(doc))
    result = merge_run(copy4, workers=1, progress=False)
    (problem,) = result.problems
    assert "stray.json" in problem and "trace_rank0.json.gz" in problem
    assert result.stats["merged_ranks"] == 4


def test_shards_are_reused_only_for_the_same_inputs(copy4: Path) -> None:
    fresh = Merged(merge_run(copy4, copy4 / "fresh.pftrace", workers=1, progress=False).out)
    for rank in range(4):
        assert write_shard(copy4, rank) == copy4 / f"shard_rank{rank}.pftrace"
    reused = merge_run(copy4, workers=1, progress=False)
    assert reused.stats["reused_shards"] == 4 and reused.problems == []
    again = Merged(reused.out)
    key = lambda m: sorted((m.rank_of[s.track] if m.rank_of[s.track] is not None else -1,  # noqa: E731
                            s.name, s.start, s.end, sorted(s.args.items())) for s in m.slices)
    assert key(again) == key(fresh)
    summary = lambda m: sorted((m.contents.tracks[s.track].name, s.name, s.start, s.end)  # noqa: E731
                               for s in m.slices if m.rank_of.get(s.track) is None)
    assert summary(again) == summary(fresh) and summary(fresh)
    doc = gzip.decompress((copy4 / "trace_rank1.json.gz").read_bytes())
    (copy4 / "trace_rank1.json.gz").write_bytes(gzip.compress(doc, 1))   # new bytes, same trace
    assert merge_run(copy4, workers=1, progress=False).stats["reused_shards"] == 3


def test_reused_shards_beside_a_converted_rank_in_workers(copy4: Path) -> None:
    """Three ranks from their shards (which send nothing ahead) and one converted in a worker
    (which sends its collectives ahead): the merge takes each rank's as it came, and the trace
    equals a merge in one process."""
    for rank in range(4):
        write_shard(copy4, rank)
    doc = gzip.decompress((copy4 / "trace_rank1.json.gz").read_bytes())
    (copy4 / "trace_rank1.json.gz").write_bytes(gzip.compress(doc, 1))   # new bytes, same trace
    pooled = merge_run(copy4, copy4 / "pooled.pftrace", workers=2, progress=False)
    assert pooled.stats["reused_shards"] == 3 and pooled.problems == []
    inline = merge_run(copy4, copy4 / "inline.pftrace", workers=1, progress=False)
    key = lambda m: sorted((m.rank_of[s.track] if m.rank_of[s.track] is not None else -1,  # noqa: E731
                            s.name, s.start, s.end, sorted(s.args.items())) for s in m.slices)
    merged = Merged(pooled.out)
    assert key(merged) == key(Merged(inline.out))
    assert pooled.stats["comm_events"] == inline.stats["comm_events"] > 0
    for rank in range(4):           # the job's six calls by hand, from a shard or converted
        want = ["all_gather", "all_reduce", "all_reduce", "barrier", "broadcast",
                "send" if rank % 2 == 0 else "recv"]
        assert sorted(s.name for s in merged.lane_slices(rank)) == sorted(want), rank


def test_a_ranks_events_sent_ahead_read_back_as_they_were(copy4: Path) -> None:
    """What a worker sends ahead (``Matched``, pickled with its events as columns) reads back
    equal, field for field and type for type: each rank's real matched run, and keys of the
    kinds a gloo run has none of (a p2p batch's pairs, a graph replay, none at all)."""
    from commviz.match import artifact
    from commviz.match.model import CommEvent, InstanceKey, KeyKind, Pair, Source
    from commviz.merge.piece import Matched

    merge_run(copy4, workers=1, progress=False)         # the matched runs, beside the records
    odd = [CommEvent(0, "1", "batch_isend_irecv", 5, 9, {"a": [1, 2]},
                     InstanceKey(KeyKind.BATCH, "1", pairs=(Pair(0, 1, "3"), Pair(1, 0, "4"))),
                     Source.KERNEL, 7, True, {"trace_index": 3}),
           CommEvent(0, "2", "all_reduce", 1, 2, {}, InstanceKey(KeyKind.COLLECTIVE, "2", 4,
                                                                 replay=("in trace", 2))),
           CommEvent(0, "2", "barrier", 3, 3, {md.SEQ: 1})]
    for rank in range(4):
        art = artifact.load(artifact.matched_path(copy4, rank))
        sent = Matched(rank, art.events + odd, art.pgs)
        back = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == sent and len(back.events) == len(art.events) + 3 > 3
        for got, want in zip(back.events, sent.events):
            assert [type(getattr(got, f)) for f in got.__slots__] == \
                [type(getattr(want, f)) for f in want.__slots__]
            assert type(got.key) is type(want.key) and got.source is want.source
            assert got.key is None or [type(p) for p in got.key.pairs] == \
                [type(p) for p in want.key.pairs]


def _job_shards_only(rank: int, world: int, base: str) -> None:
    """Each rank on its own "node" (run dir): shard written locally, only shard + record sent."""
    import torch

    import commviz
    import commviz.distributed as cvd

    run_dir = Path(base) / f"node{rank}"
    commviz.RECORDER.clear()
    commviz.start(run_dir)
    with commviz.profile(run_dir):
        t = torch.ones(64) * (rank + 1)
        cvd.all_reduce(t)
        cvd.broadcast(t, src=1)
    commviz.flush()
    write_shard(run_dir, rank)
    commviz.gather(run_dir, extra_patterns=("shard_rank{rank}.pftrace", "matched_rank{rank}.json"),
                   measure_clock=False, traces=False)


def test_shards_alone_reach_rank0_and_are_merged(tmp_path: Path) -> None:
    """Big jobs: a rank's raw trace stays on its node; rank 0 merges its shard as it is."""
    run_ranks(_job_shards_only, 3, str(tmp_path))
    node0 = tmp_path / "node0"
    assert sorted(p.name for p in node0.glob("trace_rank*")) == ["trace_rank0.json.gz"]
    assert sorted(p.name for p in node0.glob("shard_rank*")) == [
        f"shard_rank{r}.pftrace" for r in range(3)]
    result = merge_run(node0, workers=1, progress=False)
    assert result.problems == [] and result.stats["reused_shards"] == 3
    m = Merged(result.out)
    for rank in range(3):          # every rank's collectives on its lane, from its own shard
        assert sorted(s.name for s in m.lane_slices(rank)) == ["all_reduce", "broadcast"]
    report = verify_pftrace(result.out)
    assert report.ok, report.errors[:5]


def test_overlapping_kernels_keep_their_stream(tmp_path: Path) -> None:
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 7,
               "args": {"name": "stream 7"}}]
    spans = []
    for i in range(50):
        ts, dur = 1000.0 + 3.5 * i, 10.0 + (i % 4)           # each overlaps the next two
        spans.append((ts, dur))
        events.append({"ph": "X", "cat": "kernel", "name": f"kernel_{i % 3}", "pid": 0, "tid": 7,
                       "ts": ts, "dur": dur, "args": {"stream": 7, "correlation": i}})
    doc = {"traceEvents": events, "baseTimeNanoseconds": 1_700_000_000_000_000_000,
           "distributedInfo": {"rank": 0, "world_size": 1}}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "worker0.pt.trace.json").write_bytes(orjson.dumps(doc))
    result = merge_run(plain, workers=1, progress=False)
    assert result.problems == []
    m = Merged(result.out)
    assert m.problems == []
    kernels = [s for s in m.slices if s.name and s.name.startswith("kernel_")]
    tracks = [m.contents.tracks[u] for u in {s.track for s in kernels}]
    assert len(tracks) > 1                                         # split over backing tracks
    assert len({(t.name, t.merge_key, t.order_rank, t.parent) for t in tracks}) == 1
    assert (tracks[0].name, tracks[0].merge_key) == ("GPU 0 · stream 7", "track 0:7")
    assert m.rank_of[tracks[0].uuid] == 0
    base = 1_700_000_000_000_000_000
    assert sorted((s.start, s.end) for s in kernels) == sorted(
        (base + round(ts * 1000), base + round(ts * 1000) + round(dur * 1000))
        for ts, dur in spans)


def test_clock_offset_derived_across_hosts(run2: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(run2, run_dir, ignore=shutil.ignore_patterns("merged*", "shard*"))
    shift = 50_000_000                                # rank 1's clock runs 50 ms ahead
    record = pickle.loads((run_dir / "commviz_rank1.pkl").read_bytes())
    record["host"] = "other-host"
    record["clock"] = {"offset_ns": 0, "offset_source": "none"}
    for meta in record["collectives"]:
        meta[md.T_BEGIN] += shift
        meta[md.T_END] += shift
    store.dump_record(run_dir / "commviz_rank1.pkl", record)
    doc = orjson.loads(gzip.decompress((run_dir / "trace_rank1.json.gz").read_bytes()))
    doc["baseTimeNanoseconds"] += shift
    doc["host_name"] = "other-host"
    (run_dir / "trace_rank1.json.gz").write_bytes(gzip.compress(orjson.dumps(doc)))
    result = merge_run(run_dir, workers=1, progress=False)
    assert result.problems == []
    assert result.stats["clock_sources"][1].startswith("derived")

    def median_end_gap(merged: Path) -> int:
        m = Merged(merged)
        ends = defaultdict(dict)
        for rank in (0, 1):
            for s in m.lane_slices(rank):
                ends[s.args["commviz.instance"]][rank] = s.end
        diffs = sorted(abs(e[0] - e[1]) for e in ends.values() if len(e) == 2)
        assert len(diffs) >= 4
        return diffs[len(diffs) // 2]

    # The unshifted run's own gap (gloo ranks end a collective at slightly different times,
    # more so on a loaded machine) bounds what alignment can restore; 50 ms must be gone.
    natural = median_end_gap(merge_run(run2, tmp_path / "plain.pftrace", workers=1,
                                       progress=False).out)
    assert median_end_gap(result.out) < max(1_000_000, 2 * natural)


FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


@pytest.mark.parametrize("name", ["eager", "graphed"])
def test_recorded_gpu_fixtures(name: str, tmp_path: Path) -> None:
    """Real 2-GPU NCCL traces: kernels keep their stream and gain the matcher's args, lanes
    hold the collectives (graphed ones too), and the verifier finds every input event."""
    from commviz.match import match_rank

    src = FIXTURES / name
    if not src.is_dir():
        pytest.skip(f"no recorded GPU fixture {src}")
    result = merge_run(src, tmp_path / "m.pftrace", workers=1, progress=False)
    assert result.problems == []
    verify = pytest.importorskip("commviz.verify")
    report = verify.verify_pftrace(result.out, inputs=load_run(src))
    assert report.ok, report.errors[:5]
    m = Merged(result.out)
    by_start = {(m.rank_of[s.track], s.name, s.start): s for s in m.slices
                if s.track not in m.lanes}
    labelled = 0
    for rank, inp in load_run(src).ranks.items():
        (trace,) = list(inp.load_traces())
        match = match_rank(trace, inp.record, rank=rank)
        for index, added in match.kernel_args.items():
            ev = trace.events[index]
            s = by_start[(rank, ev["name"], trace.ns(ev["ts"]))]
            assert all(s.args[k] == _as_written(v) for k, v in added.items())
            if ev.get("cat") == "kernel":
                assert m.contents.tracks[s.track].name.startswith(f"GPU {ev['pid']} · ")
                labelled += 1
        lanes = m.lane_slices(rank)
        assert len(lanes) == len(match.events)
        kinds = {s.args["commviz.source"] for s in lanes}
        assert "kernel" in kinds
        if name == "graphed":
            assert any(s.args.get("commviz.graphed") for s in lanes)
    assert labelled > 0


def test_two_workers_write_what_one_writes(run4: Path, tmp_path: Path) -> None:
    """With worker processes the cross-rank piece is written while the ranks' pieces are (from
    the collectives each rank sends ahead); the merged file is the one a single process
    writes, byte for byte."""
    one = merge_run(run4, tmp_path / "one.pftrace", workers=1, progress=False)
    two = merge_run(run4, tmp_path / "two.pftrace", workers=2, progress=False)
    assert (one.stats["cross_piece_early"], two.stats["cross_piece_early"]) == (0, 1)
    assert one.out.read_bytes() == two.out.read_bytes()
    m = Merged(two.out)
    assert m.problems == []
    # the cross-rank piece, read back: one instance slice per collective of ``_job``, over its
    # group's ranks (counted by hand from the job: 4 ranks, tp {0,1} {2,3}, dp {0,2} {1,3})
    tracks = m.contents.tracks
    instances = sorted(s.args["commviz.ranks"] for s in m.slices
                       if (tracks[s.track].name or "").endswith("· instances"))
    assert instances == sorted(["0,1,2,3"] * 2                       # all_reduce, barrier
                               + ["0,1", "2,3"] * 2                  # tp all_reduce, all_gather
                               + ["0,2", "1,3"]                      # dp broadcast
                               + ["0,1", "2,3"])                     # send/recv pairs


def test_a_rank_that_fails_after_sending_leaves_the_cross_piece_as_without_it(
        copy4: Path, tmp_path: Path) -> None:
    """The piece written early is thrown away when a rank gives back no events after sending
    them: the cross-rank piece is then the one written from what the ranks gave back."""
    from commviz.match import artifact
    from commviz.merge.core import _CrossPiece
    from commviz.merge.cross import write_cross
    from commviz.merge.piece import Matched, RankResult
    from commviz.merge.stops import stops

    merge_run(copy4, workers=1, progress=False)         # the matched runs, beside the records
    arts = {r: artifact.load(artifact.matched_path(copy4, r)) for r in range(4)}
    assert all(a.events for a in arts.values())
    cross = _CrossPiece(tmp_path / "cross.pftrace", copy4)
    cross.write([Matched(r, a.events, a.pgs) for r, a in arts.items()])
    early = cross.path.read_bytes()
    results = [RankResult(rank=r, out=None, pgs=a.pgs, sent_early=r != 1) for r, a in arts.items()]
    cross.give_back(results, [])                       # every rank that sent was read
    events = [ev for res in results for ev in res.events]
    assert [ev.rank for ev in events] == [ev.rank for r in (0, 2, 3) for ev in arts[r].events]
    assert cross.written(results)["cross_piece_early"] == 0
    pgs = {}
    for a in arts.values():
        for pg, info in a.pgs.items():
            pgs.setdefault(pg, info)
    write_cross(tmp_path / "without1.pftrace", events, pgs, stops(events, copy4))
    assert cross.path.read_bytes() == (tmp_path / "without1.pftrace").read_bytes() != early
    # read back: the job's 10 collectives (by hand, as in the test above) without rank 1
    piece = Merged(cross.path)
    ranks = sorted(s.args["commviz.ranks"] for s in piece.slices
                   if (piece.contents.tracks[s.track].name or "").endswith("· instances"))
    assert ranks == sorted(["0,2,3"] * 2 + ["0", "2,3"] * 2 + ["0,2", "3"] + ["0", "2,3"])
