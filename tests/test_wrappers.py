"""Every torch.distributed collective and point-to-point function on real gloo jobs, recorded
at the c10d boundary: one record per call, checked against torch's own Flight Recorder and the
profiler trace's distributedInfo, with the user's call site; torch itself left unchanged."""

from __future__ import annotations

import gzip
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import commviz
import commviz.distributed as cvd
from commviz import metadata as md
from commviz.match import match_rank
from commviz.match.index import OP_NAMES
from commviz.trace.load import load_trace
from fr_compare import FR_ENV, compare, snapshot
from harness import run_ranks



def _groups(world: int) -> dict[str, Any]:
    """Two layouts of subgroups (tensor- and data-parallel style) made collectively."""
    import torch.distributed as td

    half = world // 2
    tp = [list(range(i, i + half)) for i in range(0, world, half)]
    dp = [list(range(i, world, half)) for i in range(half)]
    rank = td.get_rank()
    made = {}
    for name, layout in (("tp", tp), ("dp", dp)):
        for ranks in layout:
            g = td.new_group(ranks, group_desc=name)
            if rank in ranks:
                made[name] = g
    return made


def _inputs(rank: int, world: int, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 10 * rank


def _all_ops(api: Any, rank: int, world: int, groups: dict[str, Any]) -> dict[str, Any]:
    """One call of every wrapped function through ``api`` (commviz or torch); their results."""
    tp, dp = groups["tp"], groups["dp"]
    out: dict[str, Any] = {}
    t = _inputs(rank, world)
    api.all_reduce(t)
    out["all_reduce"] = t.clone()
    t = _inputs(rank, world)
    api.all_reduce(t, op=api.ReduceOp.MAX, group=tp)
    out["all_reduce_max_tp"] = t.clone()
    t = _inputs(rank, world)
    work = api.all_reduce(t, async_op=True)
    work.wait()
    out["all_reduce_async"] = (type(work).__name__, t.clone())
    t = _inputs(rank, world)
    api.broadcast(t, group_src=0, group=dp)
    out["broadcast_dp"] = t.clone()
    t = _inputs(rank, world)
    api.broadcast(t, src=world - 1)
    out["broadcast"] = t.clone()
    lst = [torch.zeros(6) for _ in range(world // 2)]
    api.all_gather(lst, _inputs(rank, world), group=tp)
    out["all_gather_tp"] = torch.stack(lst)
    big = torch.zeros(6 * world)
    api.all_gather_into_tensor(big, _inputs(rank, world))
    out["all_gather_into_tensor"] = big
    if hasattr(api, "all_gather_single"):
        big = torch.zeros(6 * world)
        api.all_gather_single(big, _inputs(rank, world) * 2)
        out["all_gather_single"] = big
        o = torch.zeros(3)
        api.reduce_scatter_single(o, torch.arange(3.0 * world) * rank)
        out["reduce_scatter_single"] = o
    pair = [_inputs(rank, world), _inputs(rank, world)[:2] * 3]
    api.all_reduce_coalesced(pair)
    out["all_reduce_coalesced"] = torch.cat(pair)
    o = torch.zeros(2)
    api.reduce_scatter(o, [torch.full((2,), float(rank + i)) for i in range(world)])
    out["reduce_scatter"] = o
    o = torch.zeros(3)
    api.reduce_scatter_tensor(o, torch.arange(3.0 * world) + rank)
    out["reduce_scatter_tensor"] = o
    outs = [torch.zeros(2) for _ in range(world)]
    api.all_to_all(outs, [torch.full((2,), float(10 * rank + i)) for i in range(world)])
    out["all_to_all"] = torch.stack(outs)
    o = torch.zeros(2 * world)
    api.all_to_all_single(o, torch.arange(2.0 * world) + 100 * rank)
    out["all_to_all_single"] = o
    splits = [1 + (i % 2) for i in range(world)]
    o = torch.zeros(sum(1 + (rank % 2) for _ in range(world)))
    api.all_to_all_single(o, torch.arange(float(sum(splits))) + 100 * rank,
                          [1 + (rank % 2)] * world, splits)
    out["all_to_all_single_splits"] = o
    t = _inputs(rank, world)
    api.reduce(t, dst=0)
    out["reduce"] = t.clone() if rank == 0 else None
    gl = [torch.zeros(6) for _ in range(world)] if rank == 0 else None
    api.gather(_inputs(rank, world), gl, dst=0)
    out["gather"] = torch.stack(gl) if gl else None
    o = torch.zeros(6)
    api.scatter(o, [_inputs(i, world) for i in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = o
    peer = rank ^ 1
    if rank % 2 == 0:
        api.send(_inputs(rank, world), dst=peer)
        r = torch.zeros(6)
        api.recv(r, src=peer)
    else:
        r = torch.zeros(6)
        api.recv(r, src=peer)
        api.send(_inputs(rank, world), dst=peer)
    out["send_recv"] = r
    r2 = torch.zeros(6)
    works = [api.isend(_inputs(rank, world) * 2, dst=peer), api.irecv(r2, src=peer)]
    for w in works:
        w.wait()
    out["isend_irecv"] = r2
    r3 = torch.zeros(6)
    ops = [api.P2POp(api.isend, _inputs(rank, world) * 3, peer),
           api.P2POp(api.irecv, r3, peer)]
    for w in api.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv"] = r3
    api.barrier(group=tp)
    out["barrier"] = True
    return out


def _job_ops(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    groups = _groups(world)
    with commviz.profile(run_dir):
        _all_ops(td, rank, world, groups)
    snap = snapshot()
    commviz.gather(run_dir)
    td.barrier()
    return snap


@pytest.mark.parametrize("world", [2, 4])
def test_every_function_is_recorded_once_as_flight_recorder_numbers_it(
        world: int, run_dir: Path) -> None:
    snaps = run_ranks(_job_ops, world, str(run_dir), env=FR_ENV, timeout=240)
    records = {r: commviz.load_record(run_dir / f"commviz_rank{r}.pkl") for r in range(world)}
    traces = {r: json.load(gzip.open(run_dir / f"trace_rank{r}.json.gz")) for r in range(world)}
    for rank, snap in enumerate(snaps):
        compare(snap)
        rec = records[rank]
        assert rec["rank"] == rank and rec["world_size"] == world and rec["dropped"] == 0
        # Process-group metadata agrees with the profiler's own distributedInfo.
        pg_config = {p["pg_name"]: p for p in traces[rank]["distributedInfo"]["pg_config"]}
        for c in rec["collectives"]:
            cfg = pg_config[c[md.PG_NAME]]
            assert (c[md.PG_DESC], c[md.PG_RANKS], c[md.GROUP_SIZE], c[md.RANK]) == \
                (cfg["pg_desc"], str(cfg["ranks"]), cfg["pg_size"], rank)
            assert c[md.T_END] >= c[md.T_BEGIN]
            assert c[md.CALLSITE].rsplit(":", 1)[0] == __file__, c[md.CALLSITE]
        p2p = [c for c in rec["collectives"] if c[md.KIND] == "p2p"]
        # send/recv, isend/irecv and a batch of one isend and one irecv: 3 sends, 3 recvs
        assert sorted(c[md.OP] for c in p2p) == ["recv"] * 3 + ["send"] * 3
    # Point-to-point records pair up: each send has the matching recv on its peer.
    sends = {(c[md.PG_NAME], c[md.SRC], c[md.DST], c[md.P2P_SEQ]) for rec in records.values()
             for c in rec["collectives"] if c[md.OP] == "send"}
    recvs = {(c[md.PG_NAME], c[md.SRC], c[md.DST], c[md.P2P_SEQ]) for rec in records.values()
             for c in rec["collectives"] if c[md.OP] == "recv"}
    assert len(sends) == 3 * world and sends == recvs


def _job_values(rank: int, world: int, run_dir: str) -> list[dict[str, Any]]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    groups = _groups(world)
    with commviz.profile(run_dir):
        _all_ops(td, rank, world, groups)
    commviz.flush()
    return commviz.RECORDER.records()


def test_metadata_values_and_profiler_ranges(run_dir: Path) -> None:
    world = 2
    records = run_ranks(_job_values, world, str(run_dir))
    rec0 = {c[md.OP]: c for c in reversed(records[0])}  # first call of each op
    ar = rec0["all_reduce"]
    assert (ar[md.COLLECTIVE_NAME], ar[md.IN_NELEMS], ar[md.OUT_NELEMS], ar[md.DTYPE]) == \
        ("allreduce", 6, 6, "Float")
    assert (ar[md.BYTES_IN], ar[md.REDUCE_OP], ar[md.ASYNC]) == (24, "sum", False)
    assert (ar[md.PG_NAME], ar[md.PG_DESC], ar[md.PG_RANKS]) == ("0", "default_pg", "[0, 1]")
    assert ar[md.IN_SPLIT] == "[]" and ar[md.OUT_SPLIT] == "[]"
    assert ar[md.LANE] == md.lane_id("0")
    assert rec0["all_gather_into_tensor"][md.COLLECTIVE_NAME] == "_allgather_base"
    assert rec0["all_gather_into_tensor"][md.OUT_NELEMS] == 12
    assert rec0["reduce_scatter_tensor"][md.COLLECTIVE_NAME] == "_reduce_scatter_base"
    assert [c[md.ROOT] for c in records[0] if c[md.OP] == "broadcast"] == [0, 1]
    assert [c[md.ROOT] for c in records[1] if c[md.OP] == "broadcast"] == [0, 1]
    a2a = [c for c in records[0] if c[md.OP] == "all_to_all_single"]
    # torch 2.11's profiler names all_to_all_single "all_to_allv" with and without splits
    assert [c[md.COLLECTIVE_NAME] for c in a2a] == ["all_to_allv", "all_to_allv"]
    assert a2a[1][md.IN_SPLIT] == "[1, 2]" and a2a[1][md.OUT_SPLIT] == "[1, 1]"
    assert [c[md.ASYNC] for c in records[0] if c[md.OP] == "all_reduce"] == [False, False, True]
    sends = [c for c in records[0] if c[md.OP] == "send"]
    assert [(c[md.PEER], c[md.SRC], c[md.DST]) for c in sends] == [(1, 0, 1)] * 3

    # Eager mode: after the job, the same metadata goes onto the profiler's own event of each
    # call's c10d op, one event per call, on the calling thread.
    trace = load_trace(run_dir / "trace_rank0.json.gz", rank=0)
    matched = match_rank(trace, commviz.load_record(run_dir / "commviz_rank0.pkl"), rank=0)
    assert sorted(ev.extra["record_index"] for ev in matched.events if ev.source == "cpu") == \
        list(range(len(records[0])))
    for ev in matched.events:
        rec, event = records[0][ev.extra["record_index"]], trace.events[ev.extra["trace_index"]]
        assert OP_NAMES[event["name"]] == rec[md.OP] and event["tid"] == rec[md.TID]
        labelled = matched.kernel_args[ev.extra["trace_index"]]
        for key in md.EAGER_KEYS + (md.SEQ, md.RANK, md.CALLSITE, md.LANE):
            if key in rec:
                assert labelled[key] == rec[key], (rec[md.OP], key)


def _job_torch_unchanged(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import warnings

    import torch.distributed as td

    commviz.RECORDER.clear()
    before = {n: getattr(td, n) for n in ("all_reduce", "isend", "irecv", "P2POp",
                                          "batch_isend_irecv", "all_reduce_coalesced")}
    with commviz.patch(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = all(getattr(td, n) is f and getattr(cvd, n) is f for n, f in before.items())
        op = td.P2POp(td.isend, torch.ones(2), rank ^ 1)
        ops = [op, td.P2POp(td.irecv, torch.zeros(2), rank ^ 1)]
        for w in td.batch_isend_irecv(ops):
            w.wait()
        td.all_reduce_coalesced([torch.ones(2)])       # torch deprecates this one
        line = inspect.currentframe().f_lineno + 1
        td.all_reduce(torch.ones(1))
    recorded = commviz.RECORDER.records()
    td.all_reduce(torch.ones(1))                         # after unpatch: not recorded
    return {"same": same, "op_is_isend": op.op is td.isend,
            "warnings": [str(w.message) for w in caught if w.category is FutureWarning],
            "ops": [c[md.OP] for c in recorded], "site": recorded[-1][md.CALLSITE],
            "line": line, "after": len(commviz.RECORDER.records())}


def test_torch_objects_and_warnings_stay_torchs(run_dir: Path) -> None:
    for res in run_ranks(_job_torch_unchanged, 2, str(run_dir)):
        assert res["same"] and res["op_is_isend"]
        assert any("all_reduce_coalesced" in w for w in res["warnings"]), res["warnings"]
        assert sorted(res["ops"]) == ["all_reduce", "all_reduce_coalesced", "recv", "send"]
        assert res["site"] == f"{__file__}:{res['line']}"
        assert res["after"] == 4


def _job_repeated(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Call sites repeated many times (from their second call on a call is recorded without
    the GIL), two lines of one function, a point-to-point pair, a second thread on a group of
    its own: each record's line as Python numbers it, its thread's OS id."""
    import threading

    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    side = td.new_group(list(range(world)), group_desc="side_thread")
    lines: dict[str, int] = {}
    tids: dict[str, int] = {}

    def here(name: str) -> None:
        lines[name] = inspect.currentframe().f_back.f_lineno + 1
        tids[name] = threading.get_native_id()

    def other_thread() -> None:
        for _ in range(20):
            here("thread")
            td.all_reduce(torch.ones(3), group=side)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    for i in range(20):
        here("first")
        td.all_reduce(torch.ones(2))
        here("second")
        td.all_reduce(torch.ones(4))
        here("p2p")
        (td.send if rank == 0 else td.recv)(torch.ones(2), 1 - rank)
    snap = snapshot()
    snap.update(lines=lines, tids=tids)
    return snap


def test_repeated_call_sites_keep_lines_numbers_and_threads(run_dir: Path) -> None:
    for snap in run_ranks(_job_repeated, 2, str(run_dir), env=FR_ENV, timeout=240):
        compare(snap)
        expect = {(2, None): "first", (4, None): "second", (3, None): "thread",
                  (2, "p2p"): "p2p"}
        seen: dict[str, int] = {}
        for rec in snap["records"]:
            name = expect[(rec[md.IN_NELEMS], "p2p" if rec[md.KIND] == "p2p" else None)]
            assert rec[md.CALLSITE] == f"{__file__}:{snap['lines'][name]}", (name, rec)
            assert rec[md.TID] == snap["tids"][name], (name, rec)
            seen[name] = seen.get(name, 0) + 1
        assert seen == {"first": 20, "second": 20, "thread": 20, "p2p": 20}


def _job_off(rank: int, world: int, run_dir: str) -> tuple[int, int]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    commviz.enable(False)
    td.all_reduce(torch.ones(1))
    off = len(commviz.RECORDER.records())
    commviz.enable(True)
    td.all_reduce(torch.ones(1))
    return off, len(commviz.RECORDER.records())


def test_recording_off_records_nothing(run_dir: Path) -> None:
    assert run_ranks(_job_off, 2, str(run_dir)) == [(0, 1), (0, 1)]


def _job_non_member(rank: int, world: int, run_dir: str) -> tuple[Any, Any, list[str]]:
    import warnings

    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    only0 = td.new_group([0])
    t = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")               # torch warns the non-member rank
        result = td.all_reduce(t, group=only0)
        td.broadcast(t, group=only0, group_src=0)
        with commviz.annotate_collective("all_reduce", t, t, group=only0) as meta:
            pass
    return (result, [c[md.PG_RANKS] for c in commviz.RECORDER.records()], meta)


def test_calls_on_a_group_this_rank_is_not_in_are_not_recorded(run_dir: Path) -> None:
    (r0, r1) = run_ranks(_job_non_member, 2, str(run_dir))
    assert r0[1] == ["[0]", "[0]", "[0]"] and r0[2][md.PG_RANKS] == "[0]"
    assert r1[0] is None and r1[1] == [] and r1[2] == {}


def _job_annotate(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    t = torch.ones(8, dtype=torch.bfloat16)
    parts = [torch.zeros(4), torch.zeros(4)]
    line = inspect.currentframe().f_lineno + 1
    with commviz.annotate_collective("my_allreduce", t, t, reduce_op=td.ReduceOp.MAX,
                                     root=1, note="custom") as meta:
        td.all_reduce(t, op=td.ReduceOp.MAX)          # a c10d call inside: the same call
    with commviz.annotate_collective("all_gather", torch.ones(4), parts, async_op=True):
        pass                                          # the user's own transport
    td.all_reduce(t)
    snap = snapshot()
    snap.update(meta=dict(meta), line=line)
    return snap


def test_annotate_collective_on_user_code(run_dir: Path) -> None:
    snap = run_ranks(_job_annotate, 2, str(run_dir), env=FR_ENV)[1]
    meta, records = snap["meta"], snap["records"]
    assert meta[md.COLLECTIVE_NAME] == "my_allreduce" and meta[md.OP] == "my_allreduce"
    assert (meta[md.IN_NELEMS], meta[md.DTYPE], meta[md.BYTES_IN]) == (8, "BFloat16", 16)
    assert (meta[md.REDUCE_OP], meta[md.ROOT], meta["note"]) == ("max", 1, "custom")
    assert meta[md.RANK] == 1 and meta[md.PG_RANKS] == "[0, 1]"
    assert meta[md.CALLSITE] == f"{__file__}:{snap['line']}"
    assert records[0] == meta and records[0][md.T_END] >= records[0][md.T_BEGIN]
    gather = records[1]
    assert (gather[md.COLLECTIVE_NAME], gather[md.IN_NELEMS], gather[md.OUT_NELEMS]) == \
        ("all_gather", 4, 8)
    assert gather[md.ASYNC] is True
    # the all_reduce inside the first block is that block's record, not a second one, and
    # takes torch's number; the block with no c10d call inside numbers itself apart, so
    # commviz's numbering stays torch's (Flight Recorder's)
    assert [r[md.OP] for r in records] == ["my_allreduce", "all_gather", "all_reduce"]
    assert md.SEQ not in gather and gather[md.USER_SEQ] == 1
    assert [records[0][md.SEQ], records[2][md.SEQ]] == [e["seq"] for e in snap["fr"]] == [1, 2]
