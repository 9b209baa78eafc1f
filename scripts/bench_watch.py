"""Scale benchmark of ``commviz watch``: one window of simulated ranks joined, the roots named.

By default (``--mesh TP PP DP``, 8 x 4 x 4,096 = 131,072 ranks) the job is
``scripts/mesh_sim.py``'s: a TP x PP x DP job with pipeline p2p, one root of each
kind planted (a late rank, a rank whose transfers are slow, a rank that pauses, a slow pipeline
link) in different DP replicas after a first window of two healthy steps (the run so far the
causes are judged against). The second window must name exactly the planted roots, each with its
cause (``commviz.live.cause``), and none of the thousands of ranks they hold up. Printed: the
calls and transfers, the time to take the calls in (``Windows.add``, chunk by chunk as a watcher
polls) and to close the window (the join of collectives and transfers, the rows, the causes),
against 5 s, the peak RSS against 1 GiB, and the roots named against the planted ones.

With ``--ranks N`` the ranks are ``scripts/bench_scale.py``'s (its generator, ``_artifact``: TP groups of 8, DP
groups across them, one world all_reduce a step, 130 collectives per rank; rank 5 late by 4 ms
at every third DP collective). Each rank's collectives become the calls the journal tail hands
the watcher (``commviz.live.tail.Call``, one ``Shape`` per call site, times the kernels' so the
late rank shows; device "cpu", so nothing is launch only), and all of them are one window.

Printed: the time to take the calls in (``Windows.add``: what a watcher does as it polls) and
to close the window (``Windows.close``: the join by (group, seq) across ranks, the rows per group
and origin, the late ranks), their sum against the 5 s target, and the process's peak RSS
against 512 MiB (``VmHWM``: the generator's own memory included, it is freed rank by rank).

    .venv/bin/python scripts/bench_watch.py                 # 131,072 ranks, roots planted
    .venv/bin/python scripts/bench_watch.py --mesh 8 4 64   # 2,048 ranks
    .venv/bin/python scripts/bench_watch.py --ranks 16384   # bench_scale's job
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402
import mesh_sim  # noqa: E402

from commviz import metadata as md  # noqa: E402
from commviz.live.tail import Call, Shape  # noqa: E402
from commviz.live.window import Windows  # noqa: E402

TARGET_S, TARGET_MIB = 5.0, 512
MESH_TARGET_MIB = 1024
HEALTHY = 2                     # steps of the first window (20 instances at each origin and more)


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


def planted(mesh: mesh_sim.Mesh) -> list[mesh_sim.Plant]:
    """One root of each kind, each in a DP replica of its own (a quarter of the way apart)."""
    tp, pp, dp = mesh
    replica = tp * pp
    at = [max(1, dp * k // 4) * replica if dp > 1 else 0 for k in range(4)]
    return [mesh_sim.Plant("late", at[0] + tp + 3, step=HEALTHY + 1),
            mesh_sim.Plant("transfer", at[1] + 2 * tp + 5, step=HEALTHY + 1),
            mesh_sim.Plant("pause", at[2] + 6, step=HEALTHY + 2),
            mesh_sim.Plant("p2p_link", at[3] + tp + 1, at[3] + 2 * tp + 1, step=HEALTHY + 1)]


def run_mesh(mesh: mesh_sim.Mesh, steps: int) -> int:
    """A first window of ``HEALTHY`` steps (the run so far the causes are judged against),
    then the window of ``steps`` with the roots planted: the one measured."""
    plants = planted(mesh)
    t = time.perf_counter()
    job = mesh_sim.Job(mesh, HEALTHY + steps, plants)
    made = time.perf_counter() - t
    windows = Windows()
    for chunk in job.calls(steps=range(1, HEALTHY + 1)):
        windows.add(chunk)
    windows.close(range(mesh.world), 0, 1)
    added = added_cpu = 0.0
    calls = 0
    for chunk in job.calls(steps=range(HEALTHY + 1, HEALTHY + steps + 1)):
        t, c = time.perf_counter(), time.process_time()
        windows.add(chunk)
        added += time.perf_counter() - t
        added_cpu += time.process_time() - c
        calls += len(chunk)
    del job
    t, c = time.perf_counter(), time.process_time()
    window = windows.close(range(mesh.world), 0, 1)
    closed, closed_cpu = time.perf_counter() - t, time.process_time() - c
    instances = sum(r.window.instances for r in window.groups)
    transfers = sum(r.window.instances for r in window.links)
    print(f"machine: {len(os.sched_getaffinity(0))} CPUs; TP {mesh.tp} x PP {mesh.pp} x DP "
          f"{mesh.dp} = {mesh.world} ranks; after a window of {HEALTHY} healthy steps, the "
          f"window of {steps} steps: {calls} calls, {instances} "
          f"collective instances in {len(window.groups)} groups, {transfers} p2p transfers")
    print(f"generated in {made:.1f} s (not counted)")
    print(f"add (as polled) {added:.2f} s wall, {added_cpu:.2f} s CPU; close (join of "
          f"collectives and transfers, rows, causes) {closed:.2f} s wall, {closed_cpu:.2f} s "
          f"CPU (target < {TARGET_S:g} s); 1-minute load {os.getloadavg()[0]:.1f}")
    print(f"peak RSS {hwm_mib():.0f} MiB (target < {MESH_TARGET_MIB} MiB)")
    want = mesh_sim.expected(plants)
    got = {(s.rank, str(s.cause), s.peer) for s in window.stragglers}
    for s in window.stragglers:
        print(f"  named: rank {s.rank}{f' -> {s.peer}' if s.peer is not None else ''} "
              f"{s.cause} at {s.origin} ({s.late_in}/{s.instances}, {s.skew_ns / 1e6:.1f} ms, "
              f"cost {s.cost_ns / 1e9:.2f} s, {len(s.waited)} waited listed)")
    print(f"planted {len(want)}, named {len(got)}: {len(want & got)} right (rank and cause), "
          f"{len(got - want)} wrong, {len(want - got)} missed")
    return 0 if got == want else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, help="bench_scale's TP x DP job of this many ranks")
    ap.add_argument("--mesh", type=int, nargs=3, default=(8, 4, 4096), metavar=("TP", "PP", "DP"))
    ap.add_argument("--steps", type=int, default=5, help="steps of the measured window")
    args = ap.parse_args(argv)
    if args.ranks is None:
        return run_mesh(mesh_sim.Mesh(*args.mesh), args.steps)
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
