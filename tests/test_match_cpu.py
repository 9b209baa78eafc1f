"""Matching on real gloo jobs: every recorded call becomes one CommEvent on the profiler's own
event of its c10d op.

Each job calls every wrapper on the world group and on subgroups, under ``commviz.profile``
with a schedule (two profiled steps, so two traces per rank, then one unprofiled step), and
gathers its files with ``commviz.gather``; the tests match the run dir and check the events
against the records, the traces and each other across ranks.
"""

from __future__ import annotations

import gzip
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import commviz
from commviz import metadata as md
from commviz.match import artifact, match_rank, match_run
from commviz.match.index import OP_NAMES
from commviz.match.ranges import TOLERANCE_NS
from commviz.trace.gpu import gpu_ops
from commviz.trace.load import load_trace
from commviz.trace.run import load_run
from harness import run_ranks

PROFILED_STEPS = 2


def _groups(world: int) -> dict[str, Any]:
    """Tensor- and data-parallel style subgroups, made collectively on every rank."""
    import torch.distributed as td

    half = world // 2
    layouts = {"tp": [list(range(i, i + half)) for i in range(0, world, half)],
               "dp": [list(range(i, world, half)) for i in range(half)]}
    made = {}
    for name, layout in layouts.items():
        for ranks in layout:
            group = td.new_group(ranks, group_desc=name)
            if td.get_rank() in ranks:
                made[name] = group
    return made


def _step(api: Any, rank: int, world: int, tp: Any, dp: Any) -> None:
    """One call of every commviz wrapper, on the world group and on the subgroups."""
    x = lambda n=4: torch.arange(float(n)) + rank  # noqa: E731 - a fresh input each call
    api.all_reduce(x())
    api.all_reduce(x(), op=api.ReduceOp.MAX, group=tp)
    api.all_reduce(x(), async_op=True).wait()
    api.all_reduce_coalesced([x(), x(2)], group=dp)
    api.broadcast(x(), group_src=0, group=dp)
    api.all_gather([torch.zeros(4) for _ in range(world // 2)], x(), group=tp)
    api.all_gather_into_tensor(torch.zeros(4 * world), x())
    if hasattr(api, "all_gather_single"):
        api.all_gather_single(torch.zeros(4 * world), x())
        api.reduce_scatter_single(torch.zeros(2), x(2 * world))
    api.reduce_scatter(torch.zeros(2), [x(2) for _ in range(world)])
    api.reduce_scatter_tensor(torch.zeros(2), x(2 * world))
    api.all_to_all([torch.zeros(2) for _ in range(world)], [x(2) for _ in range(world)])
    api.all_to_all_single(torch.zeros(2 * world), x(2 * world))
    api.reduce(x(), dst=0)
    api.gather(x(), [torch.zeros(4) for _ in range(world)] if rank == 0 else None, dst=0)
    api.scatter(torch.zeros(4), [x() for _ in range(world)] if rank == 0 else None, src=0)
    peer = rank ^ 1
    first, second = (api.send, api.recv) if rank % 2 == 0 else (api.recv, api.send)
    first(x() if first is api.send else torch.zeros(4), peer)
    second(x() if second is api.send else torch.zeros(4), peer)
    for work in (api.isend(x(), dst=peer), api.irecv(torch.zeros(4), src=peer)):
        work.wait()
    ops = [api.P2POp(api.isend, x(), peer), api.P2POp(api.irecv, torch.zeros(4), peer)]
    for work in api.batch_isend_irecv(ops):
        work.wait()
    api.barrier(group=tp)


def job(rank: int, world: int, run_dir: str, record_shapes: bool) -> None:
    """Two profiled steps (one trace each), then one step the profiler does not see."""
    import commviz.distributed as cvd

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    groups = _groups(world)
    warnings.filterwarnings("ignore", "Profiler won't be using warmup")
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=PROFILED_STEPS)
    with commviz.profile(run_dir, schedule=schedule, record_shapes=record_shapes) as prof:
        for _ in range(PROFILED_STEPS):
            _step(cvd, rank, world, groups["tp"], groups["dp"])
            prof.step()
    _step(cvd, rank, world, groups["tp"], groups["dp"])
    commviz.gather(run_dir)


@pytest.fixture(scope="module", params=[(2, True), (4, False)],
                ids=["2ranks-record_shapes", "4ranks-no_shapes"])
def run(request, tmp_path_factory) -> tuple[Path, int, bool]:
    world, shapes = request.param
    run_dir = tmp_path_factory.mktemp(f"run{world}")
    run_ranks(job, world, str(run_dir), shapes, timeout=300)
    return run_dir, world, shapes


def _wall_ns(trace: Any, event: dict) -> tuple[int, int]:
    t0 = trace.ns(float(event["ts"]))
    return t0, t0 + round(float(event["dur"]) * 1000)


def _members(args: dict[str, Any]) -> set[int]:
    """The global ranks that take part in a call, from its own metadata."""
    kind = args[md.KIND]
    if kind == "p2p":
        return {args[md.SRC], args[md.DST]}
    if kind == "batch":
        return {args[md.RANK]} | {int(p.split(":")[1]) for p in args[md.PEERS].split(",")}
    return set(json.loads(args[md.PG_RANKS]))


def test_every_call_is_one_event_on_its_c10d_op_event(run) -> None:
    run_dir, world, _ = run
    loaded = load_run(run_dir)
    assert not loaded.problems and sorted(loaded.ranks) == list(range(world))
    matches = match_run(loaded)
    for rank, m in matches.items():
        record = loaded.ranks[rank].record
        calls = record["collectives"]
        assert len(m.per_trace) == PROFILED_STEPS and m.trace_path is None
        assert not m.unmatched and not m.conflicts
        assert len(m.events) == len(calls)
        assert sorted(ev.extra["record_index"] for ev in m.events) == list(range(len(calls)))
        in_trace = [ev for ev in m.events if ev.source == "cpu"]
        # the last step ran after the profiler stopped: only its recorded span is known
        assert len(in_trace) == len(calls) * PROFILED_STEPS // (PROFILED_STEPS + 1)
        assert all(ev.source in ("cpu", "record") for ev in m.events)
        traces = {str(p.trace_path): load_trace(p.trace_path, rank=rank) for p in m.per_trace}
        labels = {str(p.trace_path): p.kernel_args for p in m.per_trace}
        for ev in m.events:
            meta = calls[ev.extra["record_index"]]
            assert ev.args == meta and ev.rank == rank and ev.key is not None
            assert ev.op == meta[md.OP] and ev.pg == meta[md.PG_NAME]
            if ev.source == "record":
                assert (ev.start_ns, ev.end_ns) == (meta[md.T_BEGIN], meta[md.T_END])
                continue
            trace = traces[ev.extra["trace_path"]]
            event = trace.events[ev.extra["trace_index"]]
            # the profiler's own event of the call's c10d op, on the calling thread
            assert OP_NAMES[event["name"]] == meta[md.OP] and event["tid"] == meta[md.TID]
            assert (ev.start_ns, ev.end_ns) == _wall_ns(trace, event)
            tol = TOLERANCE_NS      # profiler and time.time_ns convert the clock differently
            assert ev.start_ns - tol <= meta[md.T_BEGIN] and meta[md.T_END] <= ev.end_ns + tol
            # the event ends up with the call's full metadata: its own args plus what we add
            added = labels[ev.extra["trace_path"]][ev.extra["trace_index"]]
            known = {k: v for k, v in meta.items() if v is not None}
            assert {**(event.get("args") or {}), **added}.items() >= known.items()
            assert md.T_BEGIN in added and md.OP in added
        for part in m.per_trace:
            # every c10d op the profiler saw is a recorded call, paired whatever record_shapes
            assert part.stats["ranges_by_op"] == part.stats["op_events"] == len(calls) // 3
            assert part.stats["ranges"] == 0


def test_instance_keys_agree_across_ranks(run) -> None:
    run_dir, world, _ = run
    matches = match_run(load_run(run_dir))
    seen: dict[tuple, dict[int, tuple]] = {}
    for rank, m in matches.items():
        for ev in m.events:
            assert rank not in seen.get(ev.key, {}), f"{ev.key} twice on rank {rank}"
            kind = ev.args[md.KIND]          # the two sides of a p2p op: send and recv
            seen.setdefault(ev.key, {})[rank] = (kind, ev.op if kind == "collective" else None,
                                                 ev.args[md.DTYPE], frozenset(_members(ev.args)))
    assert len(seen) > 20
    for key, per_rank in seen.items():
        what = set(per_rank.values())
        assert len(what) == 1, f"{key}: ranks disagree on what it is: {per_rank}"
        members = next(iter(what))[3]
        assert set(per_rank) == members, f"{key}: on ranks {sorted(per_rank)}, not {members}"


def test_matcher_keeps_the_rank_clock_and_the_matched_run_applies_the_offset(run, tmp_path) -> None:
    """The clock is applied in one place: the matcher's times are the rank's own, whatever the
    record's offset; the matched run moves every collective and GPU op by it, and reads back
    the same from its file."""
    run_dir, world, _ = run
    loaded = load_run(run_dir)
    rank = world - 1
    item = loaded.ranks[rank]
    trace = next(item.load_traces())
    before = match_rank(trace, item.record, rank=rank)
    shifted = dict(item.record, clock=dict(item.record["clock"], offset_ns=123_456_789))
    after = match_rank(trace, shifted, rank=rank)
    assert len(before.events) == len(after.events) == len(item.record["collectives"])
    assert [(e.start_ns, e.end_ns) for e in after.events] == \
        [(e.start_ns, e.end_ns) for e in before.events]
    art = artifact.build(rank, [trace], shifted, inputs="in", record_inputs=None,
                         clock=artifact.Clock(123_456_789, "measured"))
    assert [(b.start_ns - a.start_ns, b.end_ns - a.end_ns) for a, b in
            zip(before.events, art.events)] == [(123_456_789, 123_456_789)] * len(before.events)
    own_ops = gpu_ops(trace)
    assert [(b.start_ns - a.start_ns, b.end_ns - a.end_ns) for a, b in zip(own_ops, art.gpu_ops)] \
        == [(123_456_789, 123_456_789)] * len(own_ops)
    back = artifact.load(artifact.save(art, tmp_path / artifact.matched_name(rank)))
    assert back.clock == art.clock and back.pgs == art.pgs and back.gpu_ops == art.gpu_ops
    assert [(e.key, e.start_ns, e.end_ns, e.args, e.source) for e in back.events] == \
        [(e.key, e.start_ns, e.end_ns, e.args, e.source) for e in art.events]


def test_a_matched_run_file_that_is_not_one_is_refused_naming_it(tmp_path) -> None:
    import pickle

    from commviz.errors import SourceError

    for name, data in (("pickle", pickle.dumps({"schema": artifact.SCHEMA})),
                       ("version", json.dumps({"schema": artifact.SCHEMA, "version": 99}).encode()),
                       ("event", json.dumps({"schema": artifact.SCHEMA, "version": artifact.VERSION,
                                             "rank": 0, "clock": {"offset_ns": 0, "source": "x"},
                                             "events": [["0", "all_reduce", "soon"]]}).encode())):
        path = tmp_path / f"{name}.json"
        path.write_bytes(data)
        with pytest.raises(SourceError, match=str(path)):
            artifact.load(path)


def test_record_alone_and_trace_alone(run) -> None:
    run_dir, world, _ = run
    loaded = load_run(run_dir)
    item = loaded.ranks[0]
    alone = match_rank(None, item.record, rank=0)
    calls = item.record["collectives"]
    assert [ev.extra["record_index"] for ev in alone.events] == list(range(len(calls)))
    assert all(ev.source == "record" and ev.args is calls[ev.extra["record_index"]]
               for ev in alone.events)
    # a gloo trace without its record: the profiler wrote no collective metadata to derive from
    bare = match_rank(next(item.load_traces()), None, rank=0)
    assert bare.events == [] and bare.unmatched == [] and bare.stats["nccl_kernels"] == 0


def test_an_unreadable_trace_is_a_problem_not_a_failure(run, tmp_path) -> None:
    run_dir, world, _ = run
    copy_dir = tmp_path / "copy"
    shutil.copytree(run_dir, copy_dir)
    bad = sorted(copy_dir.glob("trace_rank0_*.json.gz"))[0]
    text = gzip.decompress(bad.read_bytes())
    bad.write_bytes(gzip.compress(text[: len(text) // 2]))        # cut mid-JSON
    loaded = load_run(copy_dir)
    matches = match_run(loaded)
    assert any(str(bad) in p for p in loaded.problems)
    m = matches[0]
    calls = loaded.ranks[0].record["collectives"]
    assert len(m.events) == len(calls) and m.trace_path != bad
    assert sum(ev.source == "cpu" for ev in m.events) == len(calls) // 3
    assert len(matches) == world and all(not x.unmatched for x in matches.values())


def test_wrong_rank_is_refused(run) -> None:
    from commviz.errors import RecordError, TraceError

    run_dir, world, _ = run
    loaded = load_run(run_dir)
    trace = next(loaded.ranks[0].load_traces())
    with pytest.raises(TraceError, match="rank 0"):
        match_rank(trace, loaded.ranks[1].record, rank=1)
    with pytest.raises(RecordError, match="rank 1"):
        match_rank(trace, loaded.ranks[1].record, rank=0)
