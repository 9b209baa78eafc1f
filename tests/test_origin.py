"""Every record names where it comes from (``commviz.origin``), in torch's own terms.

Real programs on real gloo processes; what each record should say comes from torch's objects:
the DDP reducer's buckets (``GradBucket`` in a comm hook, ``Reducer._get_zeros_like_grad_buckets``),
``named_modules()`` and ``FSDPModule``, the transfers a pipelining schedule asks its stage for
(action and micro-batch). One job per world size runs several programs in turn,
and the records each made are told apart by their order.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import run_ranks

pytestmark = pytest.mark.slow

ORIGIN, KIND, UNIT, PHASE = ("commviz.origin", "commviz.origin_kind", "commviz.origin_unit",
                             "commviz.origin_phase")
MB, BUCKET = "commviz.origin_microbatch", "commviz.ddp_bucket"


def _records() -> list[dict[str, Any]]:
    import commviz

    return [{k: v for k, v in r.items() if isinstance(v, (str, int, float, bool, type(None)))}
            for r in commviz.RECORDER.records()]


def _since(mark: int) -> list[dict[str, Any]]:
    return _records()[mark:]


# -- the programs, one after another in one job ------------------------------------------------

def _ddp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                   *[torch.nn.Linear(128, 128) for _ in range(3)],
                                   torch.nn.Linear(128, 4))

    def buckets(ddp: DDP) -> list[tuple[int, int, int, str, str]]:
        """The reducer's buckets now, as torch reports them: index, elements, parameters,
        first and last parameter's name."""
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        return [(b.index(), b.buffer().numel(), len(b.parameters()),
                 names[id(b.parameters()[0])], names[id(b.parameters()[-1])])
                for b in ddp.reducer._get_zeros_like_grad_buckets()]

    out: dict[str, Any] = {}
    # no hook: the reducer's own all_reduces, numbered in its order; its buckets are rebuilt
    # at the second step; with find_unused_parameters they never are, and a map of the
    # parameters used is all-reduced after the last bucket
    for name, unused in (("plain", False), ("unused", True)):
        ddp = DDP(model(), bucket_cap_mb=0.1, find_unused_parameters=unused)
        out[name] = []
        for _ in range(4):
            mark = len(_records())
            ddp(torch.randn(8, 32)).sum().backward()
            out[name].append((_since(mark), buckets(ddp)))
    # a comm hook: what torch hands it is the truth
    hooked = DDP(model(), bucket_cap_mb=0.1)
    names = {id(p): n for n, p in hooked.module.named_parameters()}
    seen: list[tuple[int, int, str, str]] = []

    def hook(state, bucket):  # noqa: ANN001,ANN202 - DDP checks real annotations, not strings
        params = bucket.parameters()
        seen.append((bucket.index(), len(params), names[id(params[0])], names[id(params[-1])]))
        return default_hooks.allreduce_hook(state, bucket)

    hooked.register_comm_hook(None, hook)
    mark = len(_records())
    for _ in range(2):
        hooked(torch.randn(8, 32)).sum().backward()
    out["hooked"] = [r for r in _since(mark) if r["commviz.op"] == "all_reduce"]
    out["hook_saw"] = seen
    return out


def _fsdp_tp_compiled(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mark = len(_records())
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
    out["fsdp"] = _since(mark)
    out["fsdp_modules"] = {n for n, m in model.named_modules() if isinstance(m, FSDPModule)
                           and any(True for _ in m.parameters(recurse=False))}

    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    tp = parallelize_module(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                torch.nn.Linear(16, 8)),
                            tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    mark = len(_records())
    tp(torch.randn(4, 8)).sum().backward()
    out["tp"] = _since(mark)
    out["tp_modules"] = {n for n, _ in tp.named_modules()}

    def step(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(step, backend="aot_eager")
    mark = len(_records())
    compiled(torch.ones(4))
    out["compiled"] = _since(mark)
    out["compiled_fn"] = (step.__code__.co_qualname,
                          f"{step.__code__.co_filename}:{step.__code__.co_firstlineno}")
    return out


def _pipelines(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    class Stage(PipelineStage):
        """torch's stage, noting for which micro-batch the schedule asks it for transfers (the
        ops it returns are what the schedule then sends and receives)."""

        asked: list[tuple[str, int, int]] = []

        def _ask(self, action: str, chunk: int, ops: list) -> list:
            if ops:
                self.asked.append((action, self.stage_index, chunk))
            return ops

        def get_fwd_recv_ops(self, chunk: int) -> list:
            return self._ask("RECV_F", chunk, super().get_fwd_recv_ops(chunk))

        def get_fwd_send_ops(self, chunk: int) -> list:
            return self._ask("SEND_F", chunk, super().get_fwd_send_ops(chunk))

        def get_bwd_recv_ops(self, chunk: int) -> list:
            return self._ask("RECV_B", chunk, super().get_bwd_recv_ops(chunk))

        def get_bwd_send_ops(self, chunk: int) -> list:
            return self._ask("SEND_B", chunk, super().get_bwd_send_ops(chunk))

    out: dict[str, Any] = {}
    for name, kind in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch.manual_seed(0)
        stage = Stage(torch.nn.Linear(8, 8), rank, world, torch.device("cpu"))
        schedule = kind(stage, n_microbatches=4, loss_fn=lambda out, target: out.sum())
        schedule.step(torch.randn(8, 8)) if rank == 0 else schedule.step(
            target=torch.zeros(8, 8))                     # the first step infers shapes
        mark, stage.asked = len(_records()), []
        schedule.step(torch.randn(8, 8)) if rank == 0 else schedule.step(
            target=torch.zeros(8, 8))
        out[name] = _since(mark)
        out[name + "_order"] = stage.asked
    return out


def _modes(rank: int, world: int) -> dict[str, Any]:
    """Calls made under a torch function mode (``isend`` / ``irecv`` ask it) and under a
    dispatch mode (c10d's ops pass through it): the modes' hooks run between the line that
    made each call and torch's kernel. Returns the records and each call's line."""
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001,ANN204
            return func(*args, **(kwargs or {}))

    class Dispatching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001,ANN204
            return func(*args, **(kwargs or {}))

    lines = []
    mark = len(_records())
    with Passing():
        lines.append(sys._getframe().f_lineno + 1)
        work = dist.isend(torch.ones(4), 1) if rank == 0 else dist.irecv(torch.ones(4), 0)
        work.wait()
    with Dispatching():
        lines.append(sys._getframe().f_lineno + 1)
        dist.all_reduce(torch.ones(4))
    return {"records": _since(mark), "lines": lines}


def _job(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import commviz

    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)
    out = {"ddp": _ddp(rank, world), "fsdp_tp_compiled": _fsdp_tp_compiled(rank, world),
           "pipelines": _pipelines(rank, world), "modes": _modes(rank, world)}
    out["all"] = _records()
    commviz.flush()
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("origin")
    return run_dir, run_ranks(_job, 2, str(run_dir), timeout=300)


@pytest.fixture(scope="module")
def ranks(job: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return job[1]


def _pipelines_job(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import commviz

    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)
    out = {"pipelines": _pipelines(rank, world)}
    commviz.flush()
    return out


@pytest.fixture(scope="module")
def pipelines4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Pipelining on 4 ranks: middle stages receive and send both ways."""
    return run_ranks(_pipelines_job, 4, str(tmp_path_factory.mktemp("pp4")), timeout=300)


# -- the checks ----------------------------------------------------------------------------------

def test_a_mode_is_never_where_a_call_comes_from(ranks: list[dict[str, Any]]) -> None:
    """A torch function mode's and a dispatch mode's hooks run between the program's line and
    torch's kernel; the call was made where the program made it (its line, as Python counts
    it), in the record's call site and origin."""
    for rank, result in enumerate(ranks):
        modes = result["modes"]
        assert [r["commviz.op"] for r in modes["records"]] == [
            "send" if rank == 0 else "recv", "all_reduce"]
        for r, line in zip(modes["records"], modes["lines"]):
            assert r[ORIGIN] == f"test_origin.py:{line}", r[ORIGIN]
            assert r["commviz.callsite"].endswith(f"test_origin.py:{line}"), r["commviz.callsite"]


def test_no_record_without_an_origin(ranks: list[dict[str, Any]]) -> None:
    for snap in ranks:
        assert snap["all"]
        missing = [r["commviz.op"] for r in snap["all"]
                   if not r.get(ORIGIN) or r.get(KIND) in (None, "unknown")]
        assert missing == []


def test_ddp_buckets_as_the_reducer_reports_them(ranks: list[dict[str, Any]]) -> None:
    for snap in ranks:
        ddp = snap["ddp"]
        # no hook: one all_reduce per reducer bucket, in the reducer's bucket order, each
        # the size of the bucket torch keeps under that index, its parameters named as torch
        # names them, before and after the reducer rebuilds its buckets
        for name in ("plain", "unused"):
            for step, (records, truth) in enumerate(ddp[name]):
                reduced = [r for r in records if r["commviz.op"] == "all_reduce"]
                if name == "unused":          # torch's map of used parameters, then no more
                    assert reduced[len(truth)]["In msg nelems"] == sum(t[2] for t in truth)
                    assert reduced[len(truth)][ORIGIN] == "DDP unused-parameter map"
                    reduced = reduced[:len(truth)]
                assert [(r[BUCKET], r["commviz.ddp_bucket_numel"]) for r in reduced] == [
                    t[:2] for t in truth]
                assert all(r[KIND] == "DDP" and r[ORIGIN] == f"DDP bucket {r[BUCKET]}"
                           for r in reduced)
                named = [(r[BUCKET], r["commviz.ddp_bucket_numel"],
                          r.get("commviz.ddp_bucket_params"), r.get("commviz.ddp_bucket_first"),
                          r.get("commviz.ddp_bucket_last")) for r in reduced]
                assert named == truth, (name, step)
                assert all(r["commviz.backward_callsite"].endswith(
                    f"test_origin.py:{_line_of('ddp(torch.randn(8, 32)).sum().backward()')}")
                    for r in reduced)
        # a comm hook: the bucket torch handed it, its parameters named as the module names them
        got = [(r[BUCKET], r["commviz.ddp_bucket_params"], r["commviz.ddp_bucket_first"],
                r["commviz.ddp_bucket_last"]) for r in ddp["hooked"]]
        assert got == [tuple(s) for s in ddp["hook_saw"]] and len(got) >= 2


def test_fsdp2_modules_and_phases(ranks: list[dict[str, Any]]) -> None:
    for snap in ranks:
        out = snap["fsdp_tp_compiled"]
        recs = out["fsdp"]
        assert all(r[KIND] == "FSDP" for r in recs), Counter(r[ORIGIN] for r in recs)
        by_phase = Counter((r[PHASE], r[UNIT]) for r in recs)
        modules = out["fsdp_modules"]
        assert modules == {"0", "1", "2"}
        # every sharded module: gathered in each forward, its gradients reduce-scattered
        # in each backward (2 steps)
        for name in modules:
            assert by_phase[("forward all-gather", name)] == 2, by_phase
            assert by_phase[("reduce-scatter", name)] == 2, by_phase
        assert {u for _, u in by_phase} <= modules
        gathers = [r for r in recs if r[PHASE].endswith("all-gather")]
        assert all(r["commviz.op"] == "all_gather_into_tensor" for r in gathers)
        assert all(("commviz.backward_callsite" in r) == r[PHASE].startswith(("backward",
                                                                              "reduce"))
                   for r in recs)


def test_tensor_parallel_module_and_placements(ranks: list[dict[str, Any]]) -> None:
    for snap in ranks:
        out = snap["fsdp_tp_compiled"]
        dtensor = [r for r in out["tp"] if r[KIND] == "DTensor"]
        assert dtensor, Counter(r[ORIGIN] for r in out["tp"])
        for r in dtensor:
            assert r[UNIT] in out["tp_modules"]
            src, dst = r[PHASE].split(" -> ")
            assert src and dst and src != dst
        # RowwiseParallel's output: partial sums made whole (torch's placement names)
        assert any(r[UNIT] == "2" and r[PHASE] == "P(sum) -> R" for r in dtensor)


def test_compiled_code_names_the_compiled_function(ranks: list[dict[str, Any]]) -> None:
    for snap in ranks:
        out = snap["fsdp_tp_compiled"]
        qualname, at = out["compiled_fn"]
        assert out["compiled"] and all(
            r[KIND] == "compiled" and r[UNIT] == qualname and r["commviz.compiled_at"] == at
            for r in out["compiled"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelining_actions_in_the_schedules_order(request: pytest.FixtureRequest, world: int,
                                                   schedule: str) -> None:
    ranks = request.getfixturevalue("ranks" if world == 2 else "pipelines4")
    assert len(ranks) == world
    for rank, snap in enumerate(ranks):
        out = snap["pipelines"]
        recs = [r for r in out[schedule] if r["commviz.kind"] == "p2p"]
        assert recs and all(r[KIND] == "pipelining" and r[UNIT] == f"stage {rank}"
                            for r in recs)
        want = out[schedule + "_order"]
        got = [(r[PHASE], rank, r.get(MB)) for r in recs]
        for action in {a for a, _, _ in want} | {a for a, _, _ in got}:
            mine = [g for g in got if g[0] == action]
            theirs = [w for w in want if w[0] == action]
            assert mine == theirs     # the action and its micro-batch, in the schedule's order


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


# -- where a person looks: the merged trace, the overview, the report ---------------------------

def test_origins_in_the_trace_the_overview_and_the_report(
        job: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    import json

    from commviz.merge import merge_run, write_shard
    from commviz.merge.table import write_table
    from commviz.review.overview import write_overview
    from commviz.review.render.report_formats import write_report
    from commviz.write.read import read_pftrace, slices

    run_dir, snaps = job
    recorded = {(rank, r["commviz.pg_name"] if "commviz.pg_name" in r else
                 r["Process Group Name"], r.get("commviz.seq"), r.get("commviz.p2p_seq"),
                 r["commviz.op"]): r[ORIGIN] for rank, snap in enumerate(snaps)
                for r in snap["all"]}
    merged = merge_run(run_dir, tmp_path / "m.pftrace", workers=1, progress=False).out
    got = [s for s in slices(read_pftrace(merged))[0] if s.args.get("commviz.rank") is not None
           and s.args.get("commviz.op")]
    assert got
    for s in got:                     # each rank's slice: its record's origin
        key = (s.args["commviz.rank"], s.args["Process Group Name"], s.args.get("commviz.seq"),
               s.args.get("commviz.p2p_seq"), s.args["commviz.op"])
        assert s.args[ORIGIN] == recorded[key]
    summary = [s for s in slices(read_pftrace(merged))[0] if "commviz.skew_ns" in s.args]
    assert summary and all(s.args.get(ORIGIN) in recorded.values() for s in summary)

    for rank in range(len(snaps)):   # on each rank's node, as a launch does
        write_shard(run_dir, rank)
        write_table(run_dir, rank)
    overview = write_overview(run_dir, tmp_path / "o.pftrace", progress=False).out
    over = [s for s in slices(read_pftrace(overview))[0] if "commviz.instance" in s.args]
    assert over and [s for s in over if s.args.get(ORIGIN) not in recorded.values()] == []

    # rolled up per unit: every FSDP module, DDP bucket and pipeline stage torch names
    report = json.loads(write_report(run_dir, fmt="json", plots=False, by="unit",
                                     out=tmp_path / "r.json").text)
    units = {row["origin"] for row in report["by_unit"]}
    fsdp = snaps[0]["fsdp_tp_compiled"]["fsdp_modules"]
    buckets = len(snaps[0]["ddp"]["plain"][-1][1])
    assert {f"FSDP {m}" for m in fsdp} | {f"DDP bucket {b}" for b in range(buckets)} | {
        f"pipelining stage {r}" for r in range(len(snaps))} <= units, units
    # each rank's wait counted once, under its own unit
    assert sum(row["wait_ns"] for row in report["by_unit"]) == sum(
        sum(i["wait_ns"].values()) for i in report["instances"])
    assert all(i["origin"] != "-" for i in report["instances"])
    table = write_report(run_dir, fmt="table", plots=False, by="origin",
                         out=tmp_path / "r.txt").text
    assert "Communication by origin" in table and "FSDP forward all-gather (1)" in table
