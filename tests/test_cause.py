"""Every slowdown named at its root (``commviz.live.cause``), in process: a TP x PP x DP job
simulated in columns (``scripts/mesh_sim.py``) with one root planted, its calls through the
watcher's own window (``commviz.live.window.Windows``). The expected names are the planted
roots alone (rank, cause, and a link's receiver); the thousands of ranks each fault holds up
are victims and must not be named; a healthy run and a whole-job slowdown name nobody. The
Prometheus rule for the transfer-slow rank runs in promtool's own rule evaluator.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "scripts"))
import mesh_sim  # noqa: E402
from mesh_sim import Job, Mesh, Plant, expected  # noqa: E402

import commviz  # noqa: E402
from commviz.live import series  # noqa: E402
from commviz.live.cause import Cause, Judge, said  # noqa: E402
from commviz.live.joined import Group, Instances  # noqa: E402
from commviz.live.window import Window, Windows, held, roots  # noqa: E402
from commviz.review.render import wholerun  # noqa: E402
from commviz.metadata import fmt_ns  # noqa: E402

MESHES = (Mesh(2, 2, 2), Mesh(4, 2, 4), Mesh(8, 4, 4))
HEALTHY = 11            # steps of a first window: 20 instances at each origin make the normal
ONSET, STEPS = HEALTHY + 1, 6       # the plants' first step; the second window's steps


def _window(mesh: Mesh, plants: list[Plant], seed: int = 0) -> Window:
    """The window of the faults: a first window of healthy steps made the run so far."""
    job = Job(mesh, HEALTHY + STEPS, [p._replace(step=ONSET + p.step - 3) for p in plants],
              seed)
    windows = Windows()
    for steps in (range(1, ONSET), range(ONSET, ONSET + STEPS)):
        for calls in job.calls(steps=steps):
            windows.add(calls)
        window = windows.close(range(mesh.world), 0, 1)
    return window


def _named(w: Window) -> set[tuple[int, str, int | None]]:
    return {(s.rank, str(s.cause), s.peer) for s in w.stragglers}


def _plants(mesh: Mesh, seed: int) -> list[list[Plant]]:
    """One planted root of each kind, at a rank the seed picks."""
    rnd = random.Random(seed)
    senders = [r for r in range(mesh.world) if (r // mesh.tp) % mesh.pp + 1 < mesh.pp]
    link = rnd.choice(senders)
    return [[Plant(cause, rnd.randrange(mesh.world))] for cause in ("late", "transfer", "pause")
            ] + [[Plant("p2p_link", link, link + mesh.tp)]]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_each_root_is_named_with_its_cause_and_no_victim(mesh, seed):
    for plants in _plants(mesh, seed):
        w = _window(mesh, plants, seed)
        assert _named(w) == expected(plants), (plants, w.stragglers)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_healthy_and_whole_job_slowdowns_name_nobody(mesh):
    assert _window(mesh, []).stragglers == []
    slow = _window(mesh, [Plant("whole")])
    assert slow.stragglers == []
    # the whole-job slowdown shows as groups slower than the run so far: the window's rows
    tp = next(r for r in slow.origins if r.origin == mesh_sim.TP_LINE)
    assert tp.window.comm_ns / tp.window.instances > mesh_sim.TP_COMM


def test_every_root_at_once_and_victims_listed_as_waiting():
    mesh = Mesh(8, 4, 4)
    plants = [Plant("late", 3), Plant("transfer", 8 * 4 + 13), Plant("pause", 2 * 32 + 20),
              Plant("p2p_link", 3 * 32 + 9, 3 * 32 + 17)]
    w = _window(mesh, plants)
    assert _named(w) == expected(plants)
    transfer = next(s for s in w.stragglers if s.cause == Cause.TRANSFER)
    late = next(s for s in w.stragglers if s.cause == Cause.LATE)
    # the transfer-slow rank's slow groups are its TP and DP groups; the late rank's TP peers,
    # late to their DP all_reduce for waiting on it, are listed, not named
    assert transfer.late_in == 2
    assert 3 not in late.waited and set(late.waited) & set(range(8))
    assert late.origin == mesh_sim.TP_LINE
    # p2p transfers joined per origin: every send matched to its receive
    links = {r.origin: r.window.instances for r in w.links}
    assert links == {f"PP:{s}RECV_F0": mesh.tp * mesh.dp * STEPS for s in range(1, mesh.pp)}


def test_causes_go_through_the_series_to_the_report(tmp_path: Path):
    mesh = Mesh(4, 2, 4)
    plants = [Plant("transfer", 9), Plant("p2p_link", 1, 5)]
    w = _window(mesh, plants)
    series.append(tmp_path, w)
    (line,), _ = series.read(series.path_of(tmp_path))
    assert {(s["rank"], s["cause"], s["peer"]) for s in line["stragglers"]} == expected(plants)
    whole = wholerun.to_json(tmp_path)
    assert {(d["rank"], d["cause"], d["peer"]) for d in whole["slowdowns"]} == expected(plants)
    kept = commviz.Run(tmp_path).windows()
    assert kept is not None and {(d.rank, d.cause, d.peer) for d in kept.slowdowns()} == \
        expected(plants)
    lines = [said(s, fmt_ns) for s in line["stragglers"]]
    assert any(x.startswith("TRANSFER: rank 9") for x in lines)
    assert any(x.startswith("P2P LINK: rank 1 -> rank 5") for x in lines)


def test_a_two_group_mesh_names_the_transfer_rank_once_the_run_so_far_is_known():
    """The issue's 2 x 2 mesh (TP pairs, DP pairs: two sibling groups each): in its first
    window, with no run so far, two siblings say too little and nobody is named; once the
    healthy steps made the run so far, the slow rank is named "transfer" and no peer."""
    mesh, plants = Mesh(2, 1, 2), [Plant("transfer", 3, step=13)]
    job = Job(mesh, 18, plants)        # a normal from 20 instances of a class: 11 steps x 2
    windows = Windows()
    named = []
    for steps in (range(1, 13), range(13, 19)):
        for calls in job.calls(steps=steps):
            windows.add(calls)
        named.append(_named(windows.close(range(mesh.world), 0, 1)))
    assert named == [set(), expected(plants)]
    # slow from the first window on: two siblings alone name nobody, not a victim either
    first = Windows()
    for calls in Job(mesh, 6, [Plant("transfer", 3, step=2)]).calls():
        first.add(calls)
    assert first.close(range(mesh.world), 0, 1).stragglers == []


def test_an_async_cpu_collective_launch_is_its_arrival():
    """DDP's bucket all_reduces on gloo are launched with ``async_op``: the call covers its
    launch, which is when the rank's data went in; the rank that launches last is late."""
    mesh, plants = Mesh(4, 1, 1), [Plant("late", 2, step=30)]
    job = Job(mesh, 35, plants, async_op=True)
    windows = Windows()
    for steps in (range(1, 30), range(30, 36)):
        for calls in job.calls(steps=steps):
            windows.add(calls)
        w = windows.close(range(mesh.world), 0, 1)
    assert _named(w) == expected(plants)
    assert w.stragglers[0].cost_ns > 0 and w.groups[0].window.comm_ns == 0


PROMTOOL_TEST = """
rule_files: [{rules}]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
{series}
    promql_expr_test:
      - expr: commviz:transfer_slow_rank:1m
        eval_time: 5m
        exp_samples: [{named}]
      - expr: commviz:late_rank_seconds_per_call:1m
        eval_time: 5m
        exp_samples: []
"""
TP_LINE, DP_LINE, SLOW = "train.py:41", "train.py:57", 30


def _series(per_call: dict[tuple[str, str, int], float]) -> str:
    out = []
    for (group, origin, rank), seconds in per_call.items():
        labels = f'group="{group}",origin="{origin}",rank="{rank}"'
        out.append(f"      - series: 'commviz_collective_seconds_count{{{labels}}}'\n"
                   "        values: '0+15x30'")
        out.append(f"      - series: 'commviz_collective_seconds_sum{{{labels}}}'\n"
                   f"        values: '0+{15 * seconds:g}x30'")
    return "\n".join(out)


def _mesh_seconds(slow: set[str]) -> dict[tuple[str, str, int], float]:
    """The issue's 2 x 2 mesh, seconds per call: the ``slow`` groups transfer ``SLOW`` times
    slower; rank 0's TP peer (1) arrives late to its DP all_reduce and its DP peer (2) to its
    TP all_reduce when rank 0's groups are slow (they waited on it), their peers wait there."""
    tp, dp = 0.002, 0.005
    f = {g: SLOW if g in slow else 1 for g in ("tp0", "tp1", "dp0", "dp1")}
    late = {"tp0", "dp0"} <= slow and len(slow) == 2
    return {("tp0", TP_LINE, 0): tp * f["tp0"], ("tp0", TP_LINE, 1): tp * f["tp0"],
            ("tp1", TP_LINE, 2): tp * f["tp1"],
            ("tp1", TP_LINE, 3): tp * f["tp1"] + (0.15 if late else 0),
            ("dp0", DP_LINE, 0): dp * f["dp0"], ("dp0", DP_LINE, 2): dp * f["dp0"],
            ("dp1", DP_LINE, 1): dp * f["dp1"],
            ("dp1", DP_LINE, 3): dp * f["dp1"] + (0.06 if late else 0)}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
@pytest.mark.parametrize("slow, named", [
    ({"tp0", "dp0"}, "{labels: 'commviz:transfer_slow_rank:1m{rank=\"0\"}', value: 2}"),
    ({"tp0", "tp1", "dp0", "dp1"}, "")], ids=["rank 0's link", "every link"])
def test_prometheus_rule_names_the_transfer_slow_rank_not_its_victims(tmp_path: Path, slow,
                                                                      named):
    """The issue's 2 x 2 mesh in promtool's own rule evaluator: rank 0's egress slow names
    rank 0 transfer-slow, and neither its peers (late elsewhere for waiting on it: the late
    rule would name them) nor anyone when every link is slow alike."""
    rules = REPO / "configs" / "prometheus" / "commviz.rules.yml"
    test = tmp_path / "test.yml"
    test.write_text(PROMTOOL_TEST.format(rules=rules, series=_series(_mesh_seconds(slow)),
                                         named=named))
    done = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_lateness_made_inside_a_call_is_not_its_late_rank_s():
    """A rank stopped inside a collective (its transfer stalled: both ends 300 ms late) holds
    its peer, who arrives 300 ms late to its next collective; the rank that arrived last to the
    stalled call, by 0.3 ms, is not the root of that lateness: nobody known is."""
    ms = 1_000_000
    # calls (rank, begin, end) of 3 instances: [1, 3] healthy; [0, 2], rank 0 last by 0.3 ms,
    # stalled inside; [0, 1], rank 1 waits there 290 ms for rank 0
    rank = np.array([3, 1, 2, 0, 1, 0])
    begin = np.array([0, ms // 10, 0, ms * 3 // 10, 10 * ms, 300 * ms + ms // 2])
    end = np.array([9 * ms, 9 * ms, 300 * ms, 300 * ms, 301 * ms, 301 * ms])
    starts, lasts = np.array([0, 2, 4]), np.array([1, 3, 5])
    own, carried = held(rank, begin, end, starts, lasts, np.ones(3, bool))
    assert own.tolist() == [True, True, False] and carried.tolist() == [-1, -1, 1]
    skew = begin[lasts] - begin[starts]
    assert roots(own, carried, rank[lasts], skew).tolist() == [1, 0, -1]
    # a late arrival carried on is still its root's
    skew[1] = 300 * ms
    assert roots(own, carried, rank[lasts], skew).tolist() == [1, 0, 0]


def _mesh_instances(stalls: list[tuple[int, int, bool, int]], dp_carried: bool = False
                    ) -> Instances:
    """A 2 x 2 mesh's window, 12 healthy steps (TP [0, 1], [2, 3]; DP [0, 2], [1, 3]) then
    ``stalls``: (group, late rank, carried in, root) of 290-300 ms each, at one time.
    ``dp_carried``: the healthy DP instances' lateness carried in from TP."""
    ms = 1_000_000
    groups = [Group(str(i), "", r) for i, r in enumerate(((0, 1), (2, 3), (0, 2), (1, 3)))]
    rows = []                       # group, origin, t, skew, late rank, inherited, root
    for step in range(12):
        for g, (a, b) in enumerate(r.ranks for r in groups):
            late = (a, b)[step % 2]
            rows.append((g, g // 2, step * 10 * ms, ms // 3, late, dp_carried and g > 1, late))
    for k, (g, late, inherited, root) in enumerate(stalls):
        rows.append((g, g // 2, 200 * ms, (290 + k * 5) * ms, late, inherited, root))
    col = np.array(rows, dtype=np.int64).T
    n = len(rows)
    return Instances(groups, ["tp", "dp"], group=col[0], origin=col[1], seq=np.arange(n) + 10,
                     n=np.full(n, 2), first_start=col[2], last_start=col[2] + col[3],
                     last_end=col[2] + col[3] + ms // 2, late_rank=col[4], wait=col[3],
                     comm=np.full(n, ms // 2), bus_bytes=np.zeros(n),
                     launch_only=np.zeros(n, bool), arrived=np.ones(n, bool),
                     gpu=np.zeros(n, bool), size=np.full(n, 1024), root=col[6],
                     inherited=col[5].astype(bool))


def test_a_pause_is_named_in_its_own_groups_only():
    """A rank is never named paused in a group it is not in: rank 0's stall in [0, 1] and
    one carried (root 0) into [1, 3], which rank 0 is not in, are one group of its own: no
    pause. Rank 1 stalling [0, 1] and [1, 3] is named, at one of them."""
    assert Judge().name(_mesh_instances([(0, 0, False, 0), (3, 1, True, 0)])) == []
    (s,) = Judge().name(_mesh_instances([(0, 1, False, 1), (3, 1, False, 1)]))
    assert (s.rank, s.cause, s.group) == (1, Cause.PAUSE, "3") and s.late_in == 2


def test_a_pause_stands_out_of_its_origin_s_carried_lateness_too():
    """The DP all_reduce, called right after the TP one, has its late arrivals carried in: its
    own late arrivals in a window are the stalls alone, no measure of the origin's skew."""
    stalls = [(0, 1, False, 1), (3, 1, False, 1)]
    (s,) = Judge().name(_mesh_instances(stalls, dp_carried=True))
    assert (s.rank, s.cause, s.late_in) == (1, Cause.PAUSE, 2)


def test_after_an_async_launch_a_late_rank_s_lateness_is_its_own():
    """DDP's bucket all_reduces, launched with ``async_op``: a rank that computes slowly
    launches each bucket last; the others wait for the work later, outside any call, so their
    gap between two launches is as long as its own: it tells nothing, the lateness is its own."""
    ms = 1_000_000
    # calls (rank, begin, end): two launches of each rank, rank 1 last by 50 ms at both
    rank = np.array([0, 1, 0, 1])
    begin = np.array([0, 50 * ms, 60 * ms, 110 * ms])
    end = begin + ms // 10
    starts, lasts = np.array([0, 2]), np.array([1, 3])
    usable = np.ones(2, bool)
    assert held(rank, begin, end, starts, lasts, usable)[0].tolist() == [True, False]
    own, carried = held(rank, begin, end, starts, lasts, usable, np.zeros(4, bool))
    assert own.tolist() == [True, True] and carried.tolist() == [-1, -1]
