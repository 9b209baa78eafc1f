"""No input makes an after-the-job step superlinear: the work of each per-point lookup of the
match and the merge grows like its input.

Work is counted, not timed: the Python lines run in the module under test (``sys.settrace``
line events: one per line started, one per loop turn, comprehensions included), at two input
sizes, 4x apart. Linear work grows about 4x (a bisection per point: a little more); a scan per
point grows 16x. Inputs are shaped as the profiler and the recorder write them
(``tests/profiler_like.py``, after the fixtures recorded on 2 x H200), and each result is
checked against what the input itself says.
"""

from __future__ import annotations

import gzip
import importlib
import json
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

import commviz
from commviz import metadata as md
from commviz.capture.names import kernel_key
from commviz.match import coalesced, graphed, index, match_rank, merged_clock, ranges
from commviz.match.merged_clock import ClockPlan
from commviz.merge import flows, merge_run
from commviz.trace.load import load_trace
from commviz.trace.run import load_run
from commviz.verify import read_slices, verify_pftrace
from profiler_like import (KERNELS, NCCL_ALL_REDUCE, graph_record, write_any_source_recvs,
                           write_graph_replays, write_p2p_groups)

LINEAR = 5.0            # most a linear step's work may grow for 4x the input (a scan: 16x)
LOG_LINEAR = 6.0        # the same with a tree descent per point: n log n grows 4.9x at n=500
COMMVIZ = Path(commviz.__file__).parent


@contextmanager
def lines_run(*modules: ModuleType) -> Iterator[Counter]:
    """Count the lines run in ``modules`` (by module name) while the block runs."""
    files = {m.__file__: m.__name__ for m in modules}
    counts: Counter = Counter()

    def call(frame: Any, event: str, arg: Any) -> Callable | None:
        name = files.get(frame.f_code.co_filename)
        if name is None:
            return None

        def line(frame: Any, event: str, arg: Any) -> Callable:
            if event == "line":
                counts[name] += 1
            return line
        return line

    sys.settrace(call)
    try:
        yield counts
    finally:
        sys.settrace(None)


def growth(work: Callable[[int], int], n: int) -> float:
    """How much ``work(size)`` grows from ``n`` to ``4 * n``."""
    small, large = work(n), work(4 * n)
    assert small > 0
    return large / small


# -- launch flows of CUDA graph replays (issue 32) ---------------------------------------------

REPLAYS = 20


def _graph_run(root: Path, kernels: int) -> tuple[Path, list[int]]:
    run = root / f"run{kernels}"
    run.mkdir()
    launches = write_graph_replays(run / "trace_rank0.json.gz", kernels=kernels,
                                   replays=REPLAYS)
    return run, [call.correlation for call in launches]


def _after_the_job() -> list[ModuleType]:
    """Every module of the steps after the job: trace loading, match, writer, merge."""
    names = [f"commviz.{part}" + ("" if f.stem == "__init__" else f".{f.stem}")
             for part in ("trace", "match", "write", "merge")
             for f in sorted((COMMVIZ / part).glob("*.py"))]
    return [importlib.import_module(name) for name in names]


def test_graph_replay_merge_work_is_linear(tmp_path: Path) -> None:
    """A 1,000-kernel graph replayed 20 times on one stream, against 250 kernels: the flow
    binder's work grows like the trace (it grew with kernels^2 x stream length before: minutes
    at HTA's 502 x 12), and so does the whole rank's merge."""
    modules = _after_the_job()
    seen: dict[int, Counter] = {}

    def work(kernels: int) -> int:
        run, _ = _graph_run(tmp_path, kernels)
        with lines_run(*modules) as counts:
            merge_run(run, run / "m.pftrace", workers=1, progress=False)
        seen[kernels] = counts
        return counts[flows.__name__]

    assert growth(work, 250) < LINEAR
    assert sum(seen[1000].values()) / sum(seen[250].values()) < LINEAR, {
        name: round(n / max(seen[250][name], 1), 2) for name, n in seen[1000].items()}


def _links(doc: dict) -> dict[Any, tuple[str, int]]:
    """correlation -> (name of the CPU call whose ``ac2g`` flow starts there, number of GPU
    events carrying the correlation), from the input trace alone."""
    events = doc["traceEvents"]
    calls = {(e["args"]["correlation"], e["pid"], e["tid"], e["ts"]): e["name"]
             for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    starts = {e["id"]: calls[(e["id"], e["pid"], e["tid"], e["ts"])]
              for e in events if e.get("ph") == "s" and e.get("cat") == "ac2g"}
    gpu = Counter(e["args"]["correlation"] for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy"))
    return {corr: (name, gpu[corr]) for corr, name in starts.items()}


def test_graph_replay_flows_reach_their_launch(tmp_path: Path) -> None:
    """Every kernel of every replay is linked to its own ``cudaGraphLaunch`` and nothing
    else; each launch fans out to its 1,000 kernels; ``commviz verify`` agrees."""
    run, launches = _graph_run(tmp_path, 1000)
    want = _links(json.loads(gzip.decompress((run / "trace_rank0.json.gz").read_bytes())))
    assert {corr for corr, (name, _) in want.items() if name == "cudaGraphLaunch"} == \
        set(launches)
    result = merge_run(run, run / "m.pftrace", workers=1, progress=False)
    stats = result.stats["per_rank"][0]
    assert stats["flows"] == sum(n for _, n in want.values())
    assert stats["flows_from_correlation"] == stats["flow_points_unbound"] == 0
    slices, report = read_slices(result.out)
    assert report.ok, [str(e) for e in report.errors[:5]]
    by_flow: dict[int, list] = defaultdict(list)
    for s in slices:
        for fid in s.flow_ids:
            by_flow[fid].append(s)
    reached: dict[Any, list[tuple[str, Any]]] = defaultdict(list)
    fan_out: Counter = Counter()
    for s in slices:
        corr = s.args.get("correlation")
        if corr in want and s.name != want[corr][0]:          # GPU work of a launch
            reached[corr] += [(o.name, o.args.get("correlation"))
                              for fid in s.flow_ids for o in by_flow[fid] if o is not s]
        elif corr in want:
            fan_out[corr] = len(s.flow_ids)
    for corr, (name, count) in want.items():
        assert reached[corr] == [(name, corr)] * count, corr
        assert fan_out[corr] == count, corr
    assert all(fan_out[corr] == 1000 for corr in launches)
    checked = verify_pftrace(result.out, inputs=load_run(run))
    assert checked.ok, [str(e) for e in checked.errors[:5]]
    assert checked.inputs[0]["launch_flows"] == stats["flows"]


# HTA's published trace_diff test trace (facebookresearch/HolisticTraceAnalysis,
# tests/data/trace_diff/test/test.json.gz): about 105k events, one stream of 502 kernels per
# cudaGraphLaunch correlation, 12 replays. Its merge ran for more than 7 minutes without
# finishing before the binder indexed its tracks. The file (gzip) could not be read from here,
# so a trace of the same shape stands in for it: 105,032 events.
HTA_KERNELS, HTA_REPLAYS, HTA_CPU_CHAINS = 502, 12, 2580


def test_a_trace_shaped_like_htas_trace_diff_merges_and_verifies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    launches = write_graph_replays(run / "trace_rank0.json.gz", kernels=HTA_KERNELS,
                                   replays=HTA_REPLAYS, cpu_chains=HTA_CPU_CHAINS)
    doc = json.loads(gzip.decompress((run / "trace_rank0.json.gz").read_bytes()))
    assert 104_000 < len(doc["traceEvents"]) < 106_000
    want = _links(doc)
    assert all(want[call.correlation] == ("cudaGraphLaunch", HTA_KERNELS) for call in launches)
    result = merge_run(run, run / "m.pftrace", workers=1, progress=False)
    stats = result.stats["per_rank"][0]
    assert stats["flows"] == sum(n for _, n in want.values())
    assert stats["flows_from_correlation"] == stats["flow_points_unbound"] == 0
    checked = verify_pftrace(result.out, inputs=load_run(run))
    assert checked.ok, [str(e) for e in checked.errors[:5]]
    assert checked.inputs[0]["launch_flows"] == stats["flows"]


# -- the graph matcher: which graph a replay ran, which node each kernel is ---------------------

def _graph_match(root: Path, kernels: int, replays: int
                 ) -> tuple[graphed.GraphMatch, Any, dict[str, Any], int]:
    """The graph matcher's result on a generated trace and record, and its lines run."""
    path = root / f"trace_{kernels}x{replays}.json.gz"
    launches = write_graph_replays(path, kernels=kernels, replays=replays, cpu_chains=1)
    record = graph_record(kernels, launches, {name: kernel_key(name) for name in KERNELS})
    trace = load_trace(path, rank=0)
    with lines_run(graphed) as counts:
        out = graphed.match_graphed(trace, record)
    return out, trace, record, counts[graphed.__name__]


@pytest.mark.parametrize("grown", ["kernels", "replays"])
def test_graph_matching_work_is_linear(tmp_path: Path, grown: str) -> None:
    """Each replay is found by its recorded time window (not by a scan of every window), each
    kernel's node among the nodes due at that point (not by a scan of every node running the
    same kernel): 4x the kernels per replay, or 4x the replays, cost about 4x."""
    def work(n: int) -> int:
        kernels, replays = (n, 20) if grown == "kernels" else (8, n)
        out, trace, record, lines = _graph_match(tmp_path, kernels, replays)
        expected_matches(out, trace, record)
        return lines

    assert growth(work, 100 if grown == "kernels" else 200) < LINEAR


def expected_matches(out: graphed.GraphMatch, trace: Any, record: dict) -> None:
    """Replay n (in time order) is the record's replay n; its k-th kernel is node k, and each
    all_reduce node's kernel carries that node's collective (the generator's own numbering)."""
    replays = record["replays"]
    assert out.stats["graph_replays_by_time"] == len(replays)
    nodes = record["graphs"][0]["nodes"]
    per_replay = len(nodes)
    kernels = sorted((ev["ts"], i) for i, ev in enumerate(trace.events)
                     if ev.get("ph") == "X" and ev.get("cat") == "kernel")
    assert len(kernels) == per_replay * len(replays)
    labelled = 0
    for pos, (_, i) in enumerate(kernels):
        replay, k = divmod(pos, per_replay)
        node = nodes[k]
        if node["ordinal"] is None:
            assert i not in out.kernel_args
            continue
        args = out.kernel_args[i]
        assert trace.events[i]["name"] == NCCL_ALL_REDUCE
        assert (args[md.ORDINAL], args[md.SEQ], args[md.REPLAY], args[md.MATCHED_BY]) == \
            (node["ordinal"], node["ordinal"], replays[replay]["replay"], "order")
        labelled += 1
    assert labelled == out.stats["graph_matched"] == len(record["collectives"]) * len(replays)
    assert not out.unmatched


# -- coalesced p2p: which calls each SendRecv kernel ran --------------------------------------

def test_coalesced_p2p_work_is_linear(tmp_path: Path) -> None:
    """A stage's SendRecv kernels, each launched after its group's send and recv: each kernel
    reads the calls since the thread's previous NCCL launch, not every call before it."""
    def work(groups: int) -> int:
        path = tmp_path / f"p2p{groups}.json.gz"
        collectives, launches = write_p2p_groups(path, groups=groups)
        trace = load_trace(path, rank=0)
        with lines_run(coalesced) as counts:
            result = match_rank(trace, {"rank": 0, "collectives": collectives}, rank=0)
        kernel_of = {ev["args"]["correlation"]: i for i, ev in enumerate(trace.events)
                     if ev.get("cat") == "kernel"}
        for g, corr in enumerate(launches, start=1):       # group g: the g-th send and recv
            label = result.kernel_args[kernel_of[corr]]
            assert (label[md.P2P_OPS], label[md.P2P_SEQ]) == ("send→1 8 KiB, recv←1 8 KiB",
                                                              f"{g},{g}")
        assert result.stats["coalesced_kernels"] == groups
        return counts[coalesced.__name__]

    assert growth(work, 200) < LINEAR


# -- record entries <-> commviz ranges, when many calls share op, group and numbers ------------

def test_range_pairing_of_calls_sharing_an_identity_is_linear(tmp_path: Path) -> None:
    """Receives from any source carry no peer and no sequence number: every one has the same
    identity. Each range takes the free entry nearest its time, found without rescanning the
    entries taken before."""
    def work(calls: int) -> int:
        path = tmp_path / f"recv{calls}.json.gz"
        entries = write_any_source_recvs(path, calls=calls)
        trace = load_trace(path, rank=0)
        with lines_run(ranges) as counts:
            pairing = ranges.pair_ranges(index.TraceIndex(trace), entries)
        spans = sorted((ev["ts"], i) for i, ev in enumerate(trace.events)
                       if ev.get("name") == "commviz::recv")
        assert [pairing.range_of[pos].index for pos in range(calls)] == [i for _, i in spans]
        assert pairing.by_identity == calls and not pairing.time_mismatch
        return counts[ranges.__name__]

    assert growth(work, 300) < LINEAR


# -- which intervals hold a time, behind one long open interval --------------------------------

def test_intervals_skip_what_ended_behind_a_long_open_one() -> None:
    """Recorded calls of all threads: one call blocked for the whole run (a receive on a side
    thread) and many short ones after it; a kernel launched between two short calls is held
    by the long one only, found without walking back over the short ones."""
    def work(n: int) -> int:
        calls = [(0, 10 * n + 10, "blocked")] + [(10 * i, 10 * i + 5, i) for i in range(1, n)]
        found = index.Intervals(calls)
        with lines_run(index) as counts:
            held = [found.holding(10 * i + 7) for i in range(1, n)]
        assert held == [["blocked"]] * (n - 1)
        return counts[index.__name__]

    assert growth(work, 500) < LOG_LINEAR


def test_flow_points_bound_by_time_skip_finished_siblings() -> None:
    """A flow point inside a profiler step but in no op of it binds to the step: the walk back
    jumps over the ops that finished before it (one step of many ops, a point after each)."""
    def work(n: int) -> int:
        items = sorted([(0, -(10 * n + 10), 0)] + [(10 * i, -(10 * i + 5), i)
                                                   for i in range(1, n)])
        track = flows.Track(items)
        with lines_run(flows) as counts:
            held = [track.holding(10 * i + 7) for i in range(1, n)]
        assert held == [0] * (n - 1)
        return counts[flows.__name__]

    assert growth(work, 500) < LINEAR


# -- clocks derived from collective ends, over many ranks --------------------------------------

def _clock_work(ranks: int, chained: bool) -> int:
    """Rank 0 aligned; every other rank on another host with no measured offset, its own
    clock ``7 * rank`` µs behind. Each rank holds the end of 20 collectives: shared with rank 0
    (the world group), or ``chained``: with its neighbours only (a pipeline)."""
    shift = {r: 7_000 * r for r in range(ranks)}
    merged = {r: {("c", r, j): 1_000_000 * r + j for j in range(20)} for r in range(ranks)}
    ends: dict[int, dict[tuple, int]] = {0: dict(merged[0])}
    for r in range(1, ranks):
        mine = {**merged[r], **(merged[r - 1] if chained else merged[0])}
        ends[r] = {key: end - shift[r] for key, end in mine.items()}
    plan = ClockPlan(offsets={0: 0}, sources={0: merged_clock.SAME_HOST},
                     pending=list(range(ranks - 1, 0, -1)))    # the worst order for a chain
    with lines_run(merged_clock) as counts:
        problems = merged_clock.derive(plan, ends)
    assert not problems
    assert plan.offsets == shift
    return counts[merged_clock.__name__]


@pytest.mark.parametrize("chained", [False, True], ids=["world-group", "neighbours-only"])
def test_clock_derivation_work_is_linear_in_ranks(chained: bool) -> None:
    """Each pending rank is compared with one reference end per collective (the aligned ranks'
    median), not with every aligned rank; a rank that shares nothing with them yet waits for
    a neighbour, whose ends count once shifted onto the merged clock."""
    assert growth(lambda n: _clock_work(n, chained), 64) < LINEAR
