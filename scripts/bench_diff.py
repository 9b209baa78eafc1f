"""Benchmark: ``commviz diff`` of two simulated runs of 1,024 to 131,072 ranks.

Both runs' comm tables come from ``bench_scale``'s generator of a TP x PP x DP job's matched
runs (``bench_scale._artifact``: TP groups of 8, pipelines of 4 stages and their transfers, DP
groups across the replicas, its late rank 5), each made
into a table by commviz's own ``merge.table.from_artifact``, as a rank's node does. This script
adds what a diff needs and the generator leaves out: an origin per call (a line per group kind
and op, ``ORIGINS``) and the rank's profiler steps (one per schedule repeat). Run B differs
from A in two planted ways: each DP reduce-scatter moves its data 1 ms slower (more transfer),
and rank ``LATE_B`` arrives ``LATE_B_NS`` late at every world all_reduce (more waiting, for it).

Printed per size: the diff's wall and CPU time (its process and the second process that reads
run B), each process's peak RSS, the tables' bytes, and the first regressions with their
cause and late ranks (the planted ones must lead), and the 1-minute load average; under each
size after the first, its figures over the previous size's. The runs' tables are made as
``bench_scale`` makes its own (the planted replicas rank by rank, the others derived).

    .venv/bin/python scripts/bench_diff.py                       # 1024 and 16384 ranks
    .venv/bin/python scripts/bench_diff.py --sizes 16384,131072 --keep /tmp/diffbench
    .venv/bin/python scripts/bench_diff.py --sizes 1024 --keep /tmp/diffbench
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402

from commviz import metadata as md  # noqa: E402
from commviz.match.artifact import RankArtifact  # noqa: E402
from commviz.trace.steps import Step  # noqa: E402

# (group kind, op) -> the line it is called from
ORIGINS = {("tp", "all_reduce"): "train.py:101", ("tp", "all_gather_into_tensor"): "train.py:102",
           ("dp", "reduce_scatter_tensor"): "train.py:140",
           ("dp", "all_gather_into_tensor"): "train.py:141", ("", "all_reduce"): "train.py:160",
           ("pp", "send"): "pipe.py:80", ("pp", "recv"): "pipe.py:81"}
SLOWER, SLOWER_NS = "train.py:140", 1_000_000      # B: 1 ms more transfer time a call
LATE_ORIGIN, LATE_B, LATE_B_NS = "train.py:160", 9, 5_000_000    # B: rank 9 late there


def _shaped(art: RankArtifact, changed: bool) -> RankArtifact:
    """The generator's matched run with an origin per call and its profiler steps (one per
    schedule repeat); in run B with the two planted changes."""
    step_ns = len(bench_scale._schedule()) // bench_scale.STEPS * bench_scale.SLOT_NS
    events, steps = [], {}
    for ev in art.events:
        kind = ev.pg.rstrip("0123456789") if ev.pg != "0" else ""
        origin = ORIGINS[(kind, ev.op)]
        start, end = ev.start_ns, ev.end_ns
        if changed and origin == SLOWER:
            end += SLOWER_NS
        if changed and origin == LATE_ORIGIN:
            end += LATE_B_NS
            start += LATE_B_NS if art.rank == LATE_B else 0
        events.append(replace(ev, start_ns=start, end_ns=end, args={**ev.args, md.ORIGIN: origin}))
        n = (ev.start_ns - bench_scale.T0) // step_ns + 1
        got = steps.setdefault(n, [n, start - 1_000_000, start])
        got[2] = max(got[2], end + 1_000_000)
    return replace(art, events=events, steps=[Step(*steps[n]) for n in sorted(steps)])


def make_run(run_dir: Path, world: int, changed: bool) -> None:
    """Every rank's comm table (``bench_scale.write_tables``: the planted replicas rank by
    rank, the others derived from a template replica's); a kept dir made alike is reused."""
    made = {"world": world, "changed": changed, "origins": sorted(ORIGINS.values()),
            "late": [LATE_B, LATE_B_NS], "slower": [SLOWER, SLOWER_NS],
            "pp": [bench_scale.PP, bench_scale.MICRO]}
    marker = run_dir / "bench_diff.json"
    if marker.is_file() and json.loads(marker.read_text()) == made:
        return
    bench_scale.write_tables(run_dir, world, functools.partial(_shaped, changed=changed),
                             more=(LATE_B,))
    marker.write_text(json.dumps(made))


def _child(run_a: str, run_b: str) -> None:
    import resource

    from commviz.review.diff import Change, diff_runs

    t = time.perf_counter()
    d = diff_runs(run_a, run_b)
    wall = time.perf_counter() - t
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(json.dumps({
        "seconds": wall, "cpu": me.ru_utime + me.ru_stime,
        "cpu_children": kids.ru_utime + kids.ru_stime, "rss_mib": bench_scale._hwm_mib(),
        "children_rss_mib": kids.ru_maxrss / 1024, "keys": len(d.rows),
        "regressions": [(r.key, r.cause, r.late_ranks, round(r.delta_ns / 1e6, 2))
                        for r in d.of(Change.REGRESSION)]}))


def measure(run_a: Path, run_b: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", str(run_a), str(run_b)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,16384")
    ap.add_argument("--keep", help="keep the run dirs here (reused when made alike)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="commviz-diff-"))
    print(f"machine: {len(os.sched_getaffinity(0))} CPUs; a schedule of "
          f"{len(bench_scale._schedule())} slots in {bench_scale.STEPS} steps; planted: "
          f"{SLOWER} +{SLOWER_NS / 1e6:g} ms transfer a call, rank {LATE_B} "
          f"{LATE_B_NS / 1e6:g} ms late at {LATE_ORIGIN}")
    print(f"{'ranks':>6} {'diff s':>7} {'CPU s':>10} {'RSS MiB':>9} {'tables MB':>10} "
          f"{'load':>9}  regressions (Δ ms per rank and step)")
    try:
        prev: tuple[int, list[float]] | None = None
        for world in (int(s) for s in args.sizes.split(",")):
            run_a, run_b = base / f"a{world}", base / f"b{world}"
            make_run(run_a, world, changed=False)
            make_run(run_b, world, changed=True)
            size = sum(p.stat().st_size for p in run_a.glob("comm_rank*.json"))
            load = os.getloadavg()[0]
            got = measure(run_a, run_b)
            load_after = os.getloadavg()[0]
            cpu = f"{got['cpu']:.1f}+{got['cpu_children']:.1f}"
            rss = f"{got['rss_mib']:.0f}/{got['children_rss_mib']:.0f}"
            found = "; ".join(f"{k} {cause}{' for ' + str(late) if late else ''} +{delta}"
                              for k, cause, late, delta in got["regressions"][:3])
            print(f"{world:>6} {got['seconds']:>7.2f} {cpu:>10} {rss:>9} {size / 1e6:>10.1f} "
                  f"{load:>4.1f}-{load_after:<4.1f}  {found}")
            figures = [got["seconds"], got["cpu"] + got["cpu_children"], got["rss_mib"],
                       size / 1e6]
            if prev is not None:
                print(bench_scale.over_previous(world, figures, prev, (7, 10, 9, 10)))
            prev = (world, figures)
            if not args.keep:
                shutil.rmtree(run_a)
                shutil.rmtree(run_b)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
