"""Scale benchmark of ``commviz watch``: one window of 16,384 simulated ranks joined.

The ranks are ``scripts/bench_scale.py``'s (its generator, ``_artifact``: TP groups of 8, DP
groups across them, one world all_reduce a step, 130 collectives per rank; rank 5 late by 4 ms
at every third DP collective). Each rank's collectives become the calls the journal tail hands
the watcher (``commviz.live.tail.Call``, one ``Shape`` per call site, times the kernels' so the
late rank shows; device "cpu", so nothing is launch only), and all of them are one window.

Printed: the time to take the calls in (``Windows.add``: what a watcher does as it polls) and
to close the window (``Windows.close``: the join by (group, seq) across ranks, the rows per group
and origin, the late ranks), their sum against the 5 s target, and the process's peak RSS
against 512 MiB (``VmHWM``: the generator's own memory included, it is freed rank by rank).

    .venv/bin/python scripts/bench_watch.py                 # 16,384 ranks
    .venv/bin/python scripts/bench_watch.py --ranks 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402

from commviz import metadata as md  # noqa: E402
from commviz.live.tail import Call, Shape  # noqa: E402
from commviz.live.window import Windows  # noqa: E402

TARGET_S, TARGET_MIB = 5.0, 512


def rank_calls(rank: int, world: int, shapes: dict[tuple, Shape]) -> list[Call]:
    """One simulated rank's collectives as the tail would hand them over."""
    art = bench_scale._artifact(rank, world, bench_scale._groups(world))
    out = []
    for ev in art.events:
        a = ev.args
        key = (ev.pg, ev.op, a[md.BYTES_IN])
        shape = shapes.get(key)
        if shape is None:
            meta = {**{k: v for k, v in a.items() if k not in (md.SEQ, md.RANK, md.T_BEGIN,
                                                                  md.T_END)},
                    md.DEVICE: "cpu", md.ORIGIN: f"train.py:{ev.op}"}
            shape = shapes[key] = Shape.of(meta)
        out.append(Call(rank, len(out) + 1, a[md.SEQ], None, ev.start_ns, ev.end_ns, False,
                        shape))
    return out


def hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16_384)
    args = ap.parse_args(argv)
    world = args.ranks
    windows = Windows()
    shapes: dict[tuple, Shape] = {}
    made = added = added_cpu = 0.0
    calls = 0
    for rank in range(world):
        t = time.perf_counter()
        got = rank_calls(rank, world, shapes)
        made += time.perf_counter() - t
        t, c = time.perf_counter(), time.process_time()
        windows.add(got)
        added += time.perf_counter() - t
        added_cpu += time.process_time() - c
        calls += len(got)
    t, c = time.perf_counter(), time.process_time()
    window = windows.close(range(world), 0, 1)
    closed, closed_cpu = time.perf_counter() - t, time.process_time() - c
    instances = sum(r.window.instances for r in window.groups)
    print(f"machine: {len(os.sched_getaffinity(0))} CPUs; {world} ranks, {calls} calls "
          f"({calls // world} per rank), {instances} instances in {len(window.groups)} groups")
    print(f"generated in {made:.1f} s (not counted)")
    print(f"add {added:.2f} s + close (join, rows, late ranks) {closed:.2f} s = "
          f"{added + closed:.2f} s wall, {added_cpu + closed_cpu:.2f} s CPU (add "
          f"{added_cpu:.2f}, close {closed_cpu:.2f}); target < {TARGET_S:g} s; 1-minute load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"peak RSS {hwm_mib():.0f} MiB (target < {TARGET_MIB} MiB)")
    late = ", ".join(f"rank {s.rank} at {s.origin} in {s.group_label} ({s.late_in}/"
                     f"{s.instances}, {s.skew_ns / 1e6:.1f} ms)" for s in window.stragglers[:5])
    print(f"late ranks named: {len(window.stragglers)}{': ' + late if late else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
