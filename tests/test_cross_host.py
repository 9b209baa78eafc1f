"""A rank on another host whose clock runs 50 ms ahead: the report agrees with the merged trace.

A real 2-rank gloo job, each rank with its own run dir (its own "node"), so ``commviz.gather``
sends rank 1's files to rank 0 over gloo. Rank 1 says it runs on another host
(``socket.gethostname`` in its own process), so the gather measures its clock offset over the
process group for real; during that measurement rank 1's ``time.time_ns`` runs ``SHIFT_NS``
ahead. The recorder's and the profiler's times come from clocks no Python patch reaches (C++),
so rank 1's record and trace are moved by ``SHIFT_NS`` after the job, as that host's fast clock
would have written them (and its trace names that host).

Which rank is late where is known without commviz: before collective ``i`` the rank
``LATE[i]`` sleeps ``SLEEP_S``, so that collective's late rank is the sleeper and its skew about
the sleep; the others start together (each all_reduce releases both ranks at once; a
barrier first absorbs the profilers' different start-up). With
the clock applied, the report's skews and late ranks must be those (the skew about as far apart
as the job's own clock saw the two ranks call), must equal the merged
trace's (summary slices and the lanes' own starts), and the median skew must be far from 50 ms.
Two ways to the offset: the one gather measured, and one derived by the merge from collective
ends (a record that carries no measured offset).
"""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
import statistics
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from commviz import cli
from commviz import metadata as md
from commviz.record import schema, store
from commviz.write.read import read_pftrace, slices
from harness import run_ranks

SHIFT_NS = 50_000_000                # rank 1's clock runs this far ahead
SLEEP_S = 0.03                       # the injected late arrival
OTHER_HOST = "node-b.cross-host-test"
COLLECTIVES = 10
LATE = {3: 1, 6: 0, 8: 1}            # collective index -> the rank that sleeps before it
PID_BASE = 1_000_000                 # the merged trace's pid of rank R (README: process per rank)


def _job(rank: int, world: int, base: str) -> dict:
    import socket
    import time

    import torch

    import commviz
    import commviz.distributed as dist

    if rank == 1:                    # this process runs on "another host"
        socket.gethostname = lambda: OTHER_HOST
    run_dir = Path(base) / f"node{rank}"
    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)
    t = torch.ones(1024)
    stamps = []                      # when this rank called each collective, by its own clock
    with commviz.profile(run_dir):
        dist.barrier()               # the ranks start their profilers apart: meet first
        for i in range(COLLECTIVES):
            if LATE.get(i) == rank:
                time.sleep(SLEEP_S)
            stamps.append(time.time_ns())
            dist.all_reduce(t)
    if rank == 1:                    # the fast clock, as the gather's measurement sees it
        real = time.time_ns
        time.time_ns = lambda: real() + SHIFT_NS
    result = commviz.gather(run_dir)
    return {"sent": result.sent, "clock": dict(commviz.RECORDER.clock), "stamps": stamps}


@pytest.fixture(scope="module")
def cross_host_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    base = tmp_path_factory.mktemp("cross_host")
    results = run_ranks(_job, 2, str(base))
    node0 = base / "node0"
    _as_written_on_fast_host(node0, rank=1)
    return node0, results


def _as_written_on_fast_host(run_dir: Path, rank: int) -> None:
    """Move the rank's recorded and profiled times ``SHIFT_NS`` ahead, and its trace's host."""
    path = run_dir / schema.record_name(rank)
    record = pickle.loads(path.read_bytes())
    for meta in record["collectives"]:
        for key in (md.T_BEGIN, md.T_END):
            if meta.get(key) is not None:
                meta[key] += SHIFT_NS
    store.dump_record(path, record)
    for name in record["traces"]:
        trace = run_dir / name
        doc = orjson.loads(gzip.decompress(trace.read_bytes()))
        doc["baseTimeNanoseconds"] += SHIFT_NS
        doc["host_name"] = OTHER_HOST
        trace.write_bytes(gzip.compress(orjson.dumps(doc)))


def _copy(run_dir: Path, to: Path, how: str) -> Path:
    shutil.copytree(run_dir, to)
    if how == "derived":             # a record that carries no measured offset
        path = to / schema.record_name(1)
        record = pickle.loads(path.read_bytes())
        record["clock"] = {"offset_ns": 0, "offset_source": "none"}
        store.dump_record(path, record)
    return to


def _merged_instances(path: Path) -> tuple[dict[str, dict], dict[str, dict[int, int]]]:
    """From the merged trace: per instance (seq) its summary slice's args, and each rank's lane
    slice start."""
    contents = read_pftrace(path)
    done, problems = slices(contents)
    assert problems == []
    tracks = contents.tracks
    rank_of = {u: t.pid - PID_BASE for u, t in tracks.items() if t.pid is not None}
    summary: dict[str, dict] = {}
    starts: dict[str, dict[int, int]] = defaultdict(dict)
    for s in done:
        track = tracks[s.track]
        if track.merge_key and track.merge_key.startswith("summary ") and md.SEQ in s.args:
            summary[str(s.args[md.SEQ])] = s.args
        elif track.merge_key and track.merge_key.startswith("lane ") and md.SEQ in s.args:
            starts[str(s.args[md.SEQ])][rank_of[track.parent]] = s.start
    return summary, starts


@pytest.mark.slow
@pytest.mark.parametrize("how", ["measured", "derived"])
def test_report_agrees_with_merged_trace_across_hosts(cross_host_run, tmp_path: Path,
                                                      how: str) -> None:
    node0, results = cross_host_run
    assert sorted(results[0]["sent"]) == [1]                 # rank 1's files came over gloo
    assert results[1]["clock"]["offset_source"] == "measured"
    assert abs(results[1]["clock"]["offset_ns"] + SHIFT_NS) < 5_000_000
    run_dir = _copy(node0, tmp_path / "run", how)

    assert cli.main(["merge", str(run_dir), "--workers", "1"]) == 0
    report_path = tmp_path / "report.json"
    assert cli.main(["report", str(run_dir), "--format", "json", "-o", str(report_path),
                     "--no-plots"]) == 0
    report = json.loads(report_path.read_text())
    world = [i for i in report["instances"] if i["op"] == "all_reduce" and i["ranks"] == [0, 1]]
    by_seq = {str(i["seq"]): i for i in world}
    assert len(by_seq) == COLLECTIVES, sorted(by_seq)
    seqs = sorted(by_seq, key=int)
    late = {seqs[i]: rank for i, rank in LATE.items()}
    # how far apart the ranks really called it (one host's clock, stamped by the job): the
    # sleep, less whatever kept the early rank from its call on a loaded machine
    called = {seqs[i]: results[rank]["stamps"][i] - results[1 - rank]["stamps"][i]
              for i, rank in LATE.items()}
    apart = {seqs[i]: abs(results[1]["stamps"][i] - results[0]["stamps"][i])
             for i in range(COLLECTIVES)}

    skews = [i["skew_ns"] for i in world]
    assert statistics.median(skews) < 10_000_000, skews      # not the 50 ms clock gap
    for seq, inst in by_seq.items():
        if seq in late:                                      # the sleeper, by about the sleep
            assert inst["late_rank"] == late[seq], (seq, inst)
            assert called[seq] > 0, (seq, called)
            assert called[seq] * 0.9 <= inst["skew_ns"] < SLEEP_S * 1e9 + 15_000_000, \
                (inst, called[seq])
        else:                                                # as far apart as they called
            assert inst["skew_ns"] < apart[seq] + 15_000_000, (seq, inst, apart[seq])

    summary, starts = _merged_instances(run_dir / "merged.pftrace")
    assert set(seqs) <= set(summary)
    for seq, inst in by_seq.items():
        args = summary[seq]
        assert (args["commviz.skew_ns"], args["commviz.late_rank"]) == \
            (inst["skew_ns"], inst["late_rank"]), seq
        lane = starts[seq]                                   # the ranks' own slices
        assert sorted(lane) == [0, 1]
        assert {str(r): t for r, t in lane.items()} == inst["start_ns"], seq
        assert max(lane.values()) - min(lane.values()) == inst["skew_ns"]
