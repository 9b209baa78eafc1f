"""``commviz merge --steps`` / ``--window`` on one real 2-rank gloo run whose profiler schedule
records steps 1-4 in one trace per rank (a 40 ms sleep opens every step, so a window edge can
sit where no collective runs). Expectations come from torch, not commviz: which collectives each
step issued from Flight Recorder (its entries counted as each step begins), each step's range
from the profiler's own ``ProfilerStep#N`` events in the raw JSON; the output is read back with
commviz's reader checked by verify and perfetto's protos for the flows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from commviz.merge import merge_run
from commviz.merge.keep import parse_steps, parse_window, run_start_ns
from commviz.merge.piece import LANE_CAT, PID_BASE
from commviz.verify import verify_pftrace
from commviz.write.read import read_pftrace, slices
from fr_compare import FR_ENV, snapshot
from harness import run_ranks
from independent import flow_ends, pg_seq

WORLD, ITERATIONS, GAP_S = 2, 6, 0.04


def _job(rank: int, world: int, run_dir: str) -> dict:
    import time

    import torch

    import commviz
    import commviz.distributed as cvd
    from commviz.convert import convert_here

    commviz.start(run_dir)
    pair = cvd.new_group([0, 1], group_desc="pair")
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=4, repeat=1)
    begins, gaps = [], []
    with commviz.profile(run_dir, schedule=schedule) as prof:
        t = torch.ones(128) * (rank + 1)
        for _ in range(ITERATIONS):
            begins.append(len(snapshot()["fr"]))      # Flight Recorder's count as the step opens
            before = time.time_ns()
            time.sleep(GAP_S)
            gaps.append((before, time.time_ns()))
            for _ in range(20):
                t = t * 1.0 + 0.5
            cvd.all_reduce(t)
            cvd.all_reduce(t, group=pair)
            cvd.broadcast(t, src=0)
            cvd.all_gather([torch.zeros(128) for _ in range(world)], t)
            prof.step()
    fr = snapshot()["fr"]
    commviz.gather(run_dir)
    convert_here(run_dir, rank)                       # shard, matched run, comm table
    return {"fr": fr, "begins": begins + [len(fr)], "gaps": gaps}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("keep") / "run"
    return run_dir, run_ranks(_job, WORLD, str(run_dir), env=FR_ENV)


def _step_collectives(result: dict, steps: range) -> set[tuple]:
    """(group, seq) of what Flight Recorder saw issued during those loop iterations (the loop's
    iteration N is the profiler's ProfilerStep#N)."""
    fr, begins = result["fr"], result["begins"]
    return {(e["group"], e["seq"]) for n in steps for e in fr[begins[n]:begins[n + 1]]
            if not e["p2p"]}


def _raw_steps(run_dir: Path, rank: int) -> tuple[dict[int, tuple[int, int]], list[dict], int]:
    """ProfilerStep#N -> [start, end) ns from the raw trace, its X events and its time base."""
    (path,) = run_dir.glob(f"trace_rank{rank}_*.json.gz")
    doc = json.loads(gzip.open(path).read())
    base = int(doc.get("baseTimeNanoseconds", 0))
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = {}
    for e in xs:
        if str(e["name"]).startswith("ProfilerStep#"):
            start = base + round(e["ts"] * 1000)
            steps[int(e["name"].split("#")[1])] = (start, start + round(e["dur"] * 1000))
    return steps, xs, base


def _by_rank(out: Path) -> tuple[dict[int, set], dict[int, list], list]:
    contents = read_pftrace(out)
    done, problems = slices(contents)
    assert problems == [] and contents.problems == []
    tracks = contents.tracks
    procs = {u: t.pid - PID_BASE for u, t in tracks.items() if t.pid is not None}
    owner = {u: procs.get(u, procs.get(t.parent)) for u, t in tracks.items()}
    lanes: dict[int, set] = {r: set() for r in range(WORLD)}
    cpu: dict[int, list] = {r: [] for r in range(WORLD)}
    for s in done:
        rank = owner[s.track]
        if rank is None:
            continue
        if s.categories == (LANE_CAT,):
            lanes[rank].add(pg_seq(s.args["commviz.instance"]))
        else:
            cpu[rank].append((s.name, s.start))
    return lanes, cpu, done


def test_steps_keep_exactly_those_steps(run, tmp_path: Path) -> None:
    run_dir, results = run
    out = tmp_path / "steps.pftrace"
    merged = merge_run(run_dir, out, progress=False, workers=1, ranks=[0, 1],
                       keep=parse_steps("2-3"))
    assert merged.problems == []
    assert verify_pftrace(out).ok
    ends = flow_ends(out)
    assert ends and min(ends.values()) >= 2             # no one-ended flow
    lanes, cpu, _ = _by_rank(out)
    for rank in range(WORLD):
        expected = _step_collectives(results[rank], range(2, 4))
        assert len(expected) == 8 and lanes[rank] == expected, rank
        # the profiler's own events: exactly those starting inside ProfilerStep#2 and #3
        steps, xs, base = _raw_steps(run_dir, rank)
        assert sorted(steps) == [1, 2, 3, 4]
        spans = [steps[2], steps[3]]
        inside = sorted((e["name"], base + round(e["ts"] * 1000)) for e in xs
                        if any(lo <= base + round(e["ts"] * 1000) < hi for lo, hi in spans))
        assert len(inside) < len(xs) / 2 and sorted(cpu[rank]) == inside, rank


def test_window_keeps_what_starts_inside(run, tmp_path: Path) -> None:
    """A window from the middle of step 2's opening sleep to the middle of step 4's, in ms
    after the run's first collective: steps 2 and 3's collectives on both ranks."""
    run_dir, results = run
    start = run_start_ns(run_dir)

    def mid(n: int) -> float:
        lo = max(r["gaps"][n][0] for r in results)
        hi = min(r["gaps"][n][1] for r in results)
        assert hi - lo > GAP_S * 1e9 / 2                  # the ranks slept together
        return (lo + hi) / 2

    t0, t1 = ((mid(n) - start) / 1e6 for n in (2, 4))
    out = tmp_path / "window.pftrace"
    merged = merge_run(run_dir, out, progress=False, workers=1, ranks=[0, 1],
                       keep=parse_window(f"{t0:.3f}:{t1:.3f}"))
    assert merged.problems == [] and verify_pftrace(out).ok
    ends = flow_ends(out)
    assert ends and min(ends.values()) >= 2
    lanes, cpu, _ = _by_rank(out)
    for rank in range(WORLD):
        assert lanes[rank] == _step_collectives(results[rank], range(2, 4)), rank
    lo, hi = start + round(t0 * 1e6), start + round(t1 * 1e6)
    for rank in range(WORLD):
        assert cpu[rank] and all(lo <= ts < hi for _, ts in cpu[rank])


@pytest.mark.parametrize("argv, says", [(["--steps", "4-2"], "'4-2' is not a range of steps"),
                                        (["--window", "5:1"], "T1 must be after T0"),
                                        (["--window", "abc"], "give T0:T1"),
                                        (["--steps", "1", "--window", "0:1"], "choose one")])
def test_bad_keep_is_one_clear_error(run, tmp_path: Path, capsys, argv: list[str],
                                     says: str) -> None:
    from commviz import cli

    run_dir, _ = run
    code = cli.main(["merge", str(run_dir), "-o", str(tmp_path / "x.pftrace"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
