"""Every wrapper on real gloo jobs: same results as torch.distributed, right metadata, agreeing
sequence numbers across ranks, and metadata checked against torch's own Flight Recorder and the
profiler trace's distributedInfo."""

from __future__ import annotations

import gzip
import inspect
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import commviz
import commviz.distributed as cvd
from commviz import metadata as md
from harness import run_ranks

FR_ENV = {"TORCH_FR_BUFFER_SIZE": "2000"}


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


def _job_compare(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    groups = _groups(world)
    with commviz.profile(run_dir):
        wrapped = _all_ops(cvd, rank, world, groups)
    fr = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
    reference = _all_ops(td, rank, world, groups)
    same = {k: (str(wrapped[k]) == str(reference[k])) for k in reference}
    commviz.gather(run_dir)
    td.barrier()
    fr_entries = [(e["process_group"][0], e["collective_seq_id"], e["input_dtypes"])
                  for e in fr["entries"]]
    return {"same": same, "fr": fr_entries}


@pytest.mark.parametrize("world", [2, 4])
def test_every_wrapper_matches_torch_and_records(world: int, run_dir: Path) -> None:
    results = run_ranks(_job_compare, world, str(run_dir), env=FR_ENV, timeout=240)
    for rank, res in enumerate(results):
        bad = [k for k, ok in res["same"].items() if not ok]
        assert not bad, f"rank {rank}: wrapper results differ from torch.distributed for {bad}"

    records = {r: commviz.load_record(run_dir / f"commviz_rank{r}.pkl") for r in range(world)}
    traces = {r: json.load(gzip.open(run_dir / f"trace_rank{r}.json.gz")) for r in range(world)}
    expected_ops = set(cvd.WRAPPED)
    for rank, rec in records.items():
        assert rec["rank"] == rank and rec["world_size"] == world
        assert rec["dropped"] == 0
        ops = {c[md.OP] for c in rec["collectives"]}
        assert ops == expected_ops, f"rank {rank}: missing {expected_ops - ops}"
        # Process-group metadata agrees with the profiler's own distributedInfo.
        pg_config = {p["pg_name"]: p for p in traces[rank]["distributedInfo"]["pg_config"]}
        for c in rec["collectives"]:
            cfg = pg_config[c[md.PG_NAME]]
            assert c[md.PG_DESC] == cfg["pg_desc"]
            assert c[md.PG_RANKS] == str(cfg["ranks"])
            assert c[md.GROUP_SIZE] == cfg["pg_size"]
            assert c[md.RANK] == rank
            assert c[md.T_END] >= c[md.T_BEGIN]
            assert c[md.CALLSITE].endswith(".py:" + c[md.CALLSITE].rsplit(":", 1)[1])
            assert "test_wrappers.py" in c[md.CALLSITE]
        # Sequence numbers and dtypes agree with torch's Flight Recorder for every collective.
        fr = {(pg, seq): dtypes for pg, seq, dtypes in results[rank]["fr"]}
        for c in rec["collectives"]:
            if c[md.KIND] != "collective":
                continue
            key = (c[md.PG_NAME], c[md.SEQ])
            assert key in fr, f"rank {rank}: {c[md.OP]} seq {key} not in the flight recorder"
            if fr[key]:
                assert fr[key][0] == c[md.DTYPE], (c[md.OP], fr[key], c[md.DTYPE])

    # Sequence numbers agree across the ranks of each group: same op at the same seq.
    by_group: dict[str, dict[int, list[tuple[int, str, int, int]]]] = {}
    for rank, rec in records.items():
        for c in rec["collectives"]:
            if c[md.KIND] == "collective":
                by_group.setdefault(c[md.PG_NAME], {}).setdefault(rank, []).append(
                    (c[md.SEQ], c[md.OP], c[md.IN_NELEMS], c[md.OUT_NELEMS]))
    for pg, per_rank in by_group.items():
        ranks_of_pg = json.loads(next(c[md.PG_RANKS] for r in records.values()
                                      for c in r["collectives"] if c[md.PG_NAME] == pg))
        assert sorted(per_rank) == ranks_of_pg
        sequences = [[(s, op) for s, op, _, _ in v] for v in per_rank.values()]
        assert all(s == sequences[0] for s in sequences), f"group {pg}: {sequences}"
        assert [s for s, _ in sequences[0]] == list(range(1, len(sequences[0]) + 1))

    # Point-to-point records pair up: each send has the matching recv on its peer.
    sends = {(c[md.PG_NAME], c[md.SRC], c[md.DST], c[md.P2P_SEQ]) for rec in records.values()
             for c in rec["collectives"] if c[md.OP] in ("send", "isend")}
    recvs = {(c[md.PG_NAME], c[md.SRC], c[md.DST], c[md.P2P_SEQ]) for rec in records.values()
             for c in rec["collectives"] if c[md.OP] in ("recv", "irecv")}
    assert sends and sends == recvs


def _job_values(rank: int, world: int, run_dir: str) -> list[dict[str, Any]]:
    commviz.RECORDER.clear()
    commviz.start(run_dir)
    groups = _groups(world)
    with commviz.profile(run_dir):
        _all_ops(cvd, rank, world, groups)
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
    batch = rec0["batch_isend_irecv"]
    assert batch[md.PEERS] == "send:1,recv:1" and batch[md.KIND] == "batch"
    assert rec0["all_reduce"][md.SEQ] == 1
    assert [c[md.ASYNC] for c in records[0] if c[md.OP] == "all_reduce"] == [False, False, True]

    # Eager mode: the same metadata shows up in the profiler trace on commviz:: ranges.
    trace = json.load(gzip.open(run_dir / "trace_rank0.json.gz"))
    ranges = [e for e in trace["traceEvents"] if e.get("name", "").startswith("commviz::")]
    assert len(ranges) == len(records[0])
    for ev, rec in zip(sorted(ranges, key=lambda e: e["ts"]), records[0]):
        assert ev["name"] == "commviz::" + rec[md.OP]
        for key in md.EAGER_KEYS + (md.SEQ, md.RANK, md.CALLSITE, md.LANE):
            if key in rec:
                assert ev["args"][key] == rec[key], (rec[md.OP], key)


def test_wrapper_signatures_mirror_torch() -> None:
    import torch.distributed as td

    for name in cvd.WRAPPED:
        ours = inspect.signature(getattr(cvd, name), follow_wrapped=False)
        theirs = inspect.signature(getattr(td, name))
        names = [p for p in theirs.parameters]
        got = [p for p in ours.parameters if ours.parameters[p].kind != inspect.Parameter.VAR_KEYWORD]
        assert got == names[:len(got)], name
        for p in got:
            assert ours.parameters[p].default == theirs.parameters[p].default, (name, p)
        assert getattr(cvd, name).__doc__ == getattr(td, name).__doc__


def _job_patch(rank: int, world: int, run_dir: str) -> tuple[int, int, bool]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    t = torch.ones(3)
    with commviz.patch():
        td.all_reduce(t)                          # an unmodified program's call
        td.distributed_c10d.broadcast(t, src=0)   # torch-internal style lookup
        ops = [td.P2POp(td.isend, torch.ones(2), rank ^ 1),
               td.P2POp(td.irecv, torch.zeros(2), rank ^ 1)]
        for w in td.batch_isend_irecv(ops):
            w.wait()
        patched = td.all_reduce is cvd.all_reduce
    td.all_reduce(t)                              # after unpatch: not recorded
    restored = td.all_reduce is cvd.RAW["all_reduce"]
    return len(commviz.RECORDER.records()), int(patched), restored


def test_patch_instruments_unmodified_code(run_dir: Path) -> None:
    for count, patched, restored in run_ranks(_job_patch, 2, str(run_dir)):
        assert (count, patched, restored) == (3, 1, True)


def _job_patch_all(rank: int, world: int, run_dir: str) -> tuple[list[str], list[str]]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    groups = _groups(world)
    _all_ops(cvd, rank, world, groups)               # the drop-in module: one record a call
    module_ops = [c[md.OP] for c in commviz.RECORDER.records()]
    commviz.RECORDER.clear()
    with commviz.patch():
        _all_ops(td, rank, world, groups)            # an unmodified program, patched
    patched_ops = [c[md.OP] for c in commviz.RECORDER.records()]
    return module_ops, patched_ops


def test_patch_records_every_call_exactly_once(run_dir: Path) -> None:
    """torch may implement one wrapped function through another (all_gather_into_tensor ->
    all_gather_single in 2.13): under patch() each call must still be recorded once."""
    for module_ops, patched_ops in run_ranks(_job_patch_all, 2, str(run_dir)):
        assert patched_ops == module_ops
        assert set(module_ops) == set(cvd.WRAPPED)


def _job_non_member(rank: int, world: int, run_dir: str) -> tuple[Any, Any, list[str]]:
    import warnings

    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    only0 = td.new_group([0])
    t = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")               # torch warns the non-member rank
        ours = cvd.all_reduce(t, group=only0)
        theirs = td.all_reduce(t.clone(), group=only0)
        cvd.broadcast(t, group=only0, group_src=0)
        with commviz.annotate_collective("all_reduce", t, t, group=only0) as meta:
            pass
    return (ours, theirs, [c[md.PG_RANKS] for c in commviz.RECORDER.records()], meta)


def test_calls_on_a_group_this_rank_is_not_in_are_not_recorded(run_dir: Path) -> None:
    (r0, r1) = run_ranks(_job_non_member, 2, str(run_dir))
    assert r0[2] == ["[0]", "[0]", "[0]"] and r0[3][md.PG_RANKS] == "[0]"
    assert r1[0] is None and r1[1] is None             # torch returns None there too
    assert r1[2] == [] and r1[3] == {}


def _job_annotate(rank: int, world: int, run_dir: str) -> tuple[dict, list[dict]]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    t = torch.ones(8, dtype=torch.bfloat16)
    parts = [torch.zeros(4), torch.zeros(4)]
    with commviz.annotate_collective("my_allreduce", t, t, reduce_op=td.ReduceOp.MAX,
                                     root=1, note="custom") as meta:
        td.all_reduce(t, op=td.ReduceOp.MAX)          # the user's own, unwrapped call
    with commviz.annotate_collective("all_gather", torch.ones(4), parts, async_op=True):
        td.all_gather(parts, torch.ones(4))
    return dict(meta), commviz.RECORDER.records()


def test_annotate_collective_on_user_code(run_dir: Path) -> None:
    meta, records = run_ranks(_job_annotate, 2, str(run_dir))[1]
    assert meta[md.COLLECTIVE_NAME] == "my_allreduce" and meta[md.OP] == "my_allreduce"
    assert (meta[md.IN_NELEMS], meta[md.DTYPE], meta[md.BYTES_IN]) == (8, "BFloat16", 16)
    assert (meta[md.REDUCE_OP], meta[md.ROOT], meta["note"]) == ("max", 1, "custom")
    assert meta[md.SEQ] == 1 and meta[md.RANK] == 1 and meta[md.PG_RANKS] == "[0, 1]"
    assert meta[md.CALLSITE].endswith(f"test_wrappers.py:{meta[md.CALLSITE].rsplit(':')[-1]}")
    assert records[0] == meta and records[0][md.T_END] >= records[0][md.T_BEGIN]
    gather = records[1]
    assert (gather[md.COLLECTIVE_NAME], gather[md.IN_NELEMS], gather[md.OUT_NELEMS]) == \
        ("all_gather", 4, 8)
    assert gather[md.ASYNC] is True and gather[md.SEQ] == 2
