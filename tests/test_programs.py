"""Real training programs, unmodified but for ``commviz.start()``: every collective they issue
reaches commviz's records exactly once, numbered as torch numbers it.

Each program runs on real gloo processes with torch's Flight Recorder on; the expected
collectives (group, sequence number, op, element counts, dtype, ranks) are torch's own dump,
compared per entry by ``fr_compare.compare``. Whatever issues them: DDP's C++ reducer and its
setup, FSDP2, DTensor, functional collectives in compiled code, pipelining, object collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fr_compare import FR_ENV, compare, snapshot
from harness import run_ranks

pytestmark = pytest.mark.slow


def _start(run_dir: str) -> None:
    import commviz

    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)


def _every_record_has_an_origin(snap: dict[str, Any]) -> None:
    """Each record names the code or framework unit it comes from (commviz.record.origins)."""
    assert snap["records"]
    assert [r["commviz.op"] for r in snap["records"]
            if not r.get("commviz.origin") or r.get("commviz.origin_kind") == "unknown"] == []


# -- DDP ------------------------------------------------------------------------------------------

def _ddp(rank: int, world: int, run_dir: str, hook: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    _start(run_dir)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256),
                                torch.nn.ReLU(), *[torch.nn.Linear(256, 256) for _ in range(4)],
                                torch.nn.Linear(256, 8))
    ddp = DDP(model, bucket_cap_mb=0.25)
    if hook == "allreduce":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(3):
        with ddp.no_sync():                       # gradient accumulation: no allreduce
            ddp(torch.randn(16, 64)).sum().backward()
        ddp(torch.randn(16, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return snapshot()


@pytest.mark.parametrize("hook", ["none", "allreduce", "fp16"])
def test_ddp_reducer_setup_and_hooks(hook: str, run_dir: Path) -> None:
    for snap in run_ranks(_ddp, 2, str(run_dir), hook, env=FR_ENV):
        counts = compare(snap)
        _every_record_has_an_origin(snap)
        world = counts["0"]
        # DDP's setup (parameter check, module broadcast), BatchNorm's buffers every forward,
        # and the reducer's buckets (several per backward) all reach the records
        assert world["all_gather"] >= 1 and world["broadcast"] >= 1
        assert world["all_reduce"] >= 2 * 3, world


# -- FSDP2 --------------------------------------------------------------------------------------

def _fsdp2(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _start(run_dir)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 32)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return snapshot()


def test_fsdp2_with_clip_grad_norm(run_dir: Path) -> None:
    for snap in run_ranks(_fsdp2, 2, str(run_dir), env=FR_ENV):
        counts = compare(snap)
        _every_record_has_an_origin(snap)
        world = counts["0"]
        assert world["all_gather_into_tensor"] and world["reduce_scatter_tensor"]
        assert world["all_reduce"] >= 2          # clip_grad_norm_'s norm, once per step


# -- tensor parallel ------------------------------------------------------------------------------

def _tp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _tp(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    _start(run_dir)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize_module(_tp_model(), mesh, {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel()})
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
    return snapshot()


def test_dtensor_tensor_parallel(run_dir: Path) -> None:
    for snap in run_ranks(_tp, 2, str(run_dir), env=FR_ENV):
        counts = compare(snap)
        _every_record_has_an_origin(snap)
        assert sum(sum(c.values()) for c in counts.values()) >= 2


def _fsdp_tp(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    _start(run_dir)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_tp_model(), mesh["tp"], {"0": ColwiseParallel(),
                                                         "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    snap = snapshot()
    snap["mesh_groups"] = {dim: mesh[dim].get_group().group_name for dim in ("dp", "tp")}
    return snap


def test_fsdp2_over_dp_and_tp_over_tp_on_four_ranks(run_dir: Path) -> None:
    for snap in run_ranks(_fsdp_tp, 4, str(run_dir), env=FR_ENV, timeout=240):
        counts = compare(snap)
        _every_record_has_an_origin(snap)
        for dim, name in snap["mesh_groups"].items():
            assert sum(counts.get(name, {}).values()) > 0, f"no {dim}-mesh collective recorded"


# -- torch.compile --------------------------------------------------------------------------------

def _compiled_step(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    dist.all_reduce(y)                               # in-place, traced as a functional one
    return y + 1


def _compile(rank: int, world: int, run_dir: str, with_commviz: bool) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    if with_commviz:
        _start(run_dir)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(_compiled_step, backend="aot_eager", fullgraph=False)
    outs = [step(torch.full((8,), float(rank + i))) for i in range(3)]
    breaks = sum(counters["graph_break"].values())
    frames = counters["stats"]["unique_graphs"]
    result = {"breaks": breaks, "graphs": frames, "out": [o.tolist() for o in outs]}
    if with_commviz:
        result.update(snapshot())
    return result


def test_compiled_functional_collectives_same_graph_breaks(run_dir: Path) -> None:
    plain = run_ranks(_compile, 2, str(run_dir), False, env=FR_ENV)
    recorded = run_ranks(_compile, 2, str(run_dir), True, env=FR_ENV)
    for p, r in zip(plain, recorded):
        assert (r["breaks"], r["graphs"], r["out"]) == (p["breaks"], p["graphs"], p["out"])
        counts = compare(r)
        _every_record_has_an_origin(r)
        assert counts["0"]["all_reduce"] == 2 * 3


# -- pipelining -------------------------------------------------------------------------------

def _pipeline(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    _start(run_dir)
    torch.manual_seed(0)
    stage_mod = torch.nn.Linear(8, 8)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: out.sum())
    x = torch.randn(8, 8)
    for _ in range(2):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=torch.zeros(8, 8))
    snap = snapshot()
    import commviz

    snap["p2p"] = [(c["commviz.op"], c["commviz.src"], c["commviz.dst"], c["commviz.p2p_seq"])
                   for c in commviz.RECORDER.records() if c["commviz.kind"] == "p2p"]
    return snap


def test_pipelining_schedule_point_to_point(run_dir: Path) -> None:
    snaps = run_ranks(_pipeline, 2, str(run_dir), env=FR_ENV)
    for snap in snaps:
        compare(snap)
        _every_record_has_an_origin(snap)
    sends = sorted((s, d, q) for snap in snaps for op, s, d, q in snap["p2p"] if op == "send")
    recvs = sorted((s, d, q) for snap in snaps for op, s, d, q in snap["p2p"] if op == "recv")
    # GPipe, 4 microbatches, 2 steps: activations forward and gradients back (plus the
    # stages' shape exchange at the first step), every send paired with its receive
    assert len(sends) >= 2 * 4 * 2 and sends == recvs


# -- object collectives, subgroups, monitored_barrier, any-source recv, coalesced ------------

def _misc(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    _start(run_dir)
    sub = dist.new_subgroups(2)[0]
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    box = [rank] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    out: list[Any] = [None]
    dist.scatter_object_list(out, [i * 10 for i in range(world)] if rank == 0 else None, src=0)
    dist.all_reduce(torch.ones(3), group=sub)
    dist.monitored_barrier()
    if rank == 0:
        got = torch.zeros(2)
        senders = sorted(dist.recv(got) for _ in range(world - 1))   # any source
    else:
        dist.send(torch.full((2,), float(rank)), dst=0)
        senders = []
    with dist._coalescing_manager():
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(5))
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
    dist.all_reduce(torch.ones(1))
    snap = snapshot()
    import commviz

    snap["senders"] = senders
    snap["recvs"] = [c["commviz.peer"] for c in commviz.RECORDER.records()
                     if c["commviz.op"] == "recv"]
    snap["monitored"] = [c["commviz.seq"] for c in commviz.RECORDER.records()
                         if c["commviz.op"] == "monitored_barrier"]
    return snap


def test_object_collectives_monitored_barrier_any_source_and_coalesced(run_dir: Path) -> None:
    snaps = run_ranks(_misc, 4, str(run_dir), env=FR_ENV, timeout=240)
    for rank, snap in enumerate(snaps):
        # Flight Recorder on gloo keeps no entry for monitored_barrier: its two tags show
        # as the gap in the world group's numbering, which compare() checks around it
        counts = compare(snap, ignore_ops=("monitored_barrier",))
        _every_record_has_an_origin(snap)
        assert len(snap["monitored"]) == 1
        assert counts["0"]["all_gather"] >= 2 and counts["0"]["broadcast"] >= 2
        if rank == 0:
            assert snap["senders"] == [1, 2, 3]
            assert snap["recvs"] == [None] * 3     # any-source: recorded, peer unknown


# -- how a call reaches the kernel: boxed, unboxed, and with recording off ------------------

def _fr_last(group: str = "0") -> int:
    import pickle

    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return max(e["collective_seq_id"] for e in dump["entries"]
               if e["process_group"][0] == group)


def _arrivals(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import commviz
    from commviz.record import boundary

    def calls() -> None:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        dist.broadcast(t, src=1)
        dist.all_gather_into_tensor(torch.empty(4 * world), t)
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
        funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
        funcol.wait_tensor(funcol.all_gather_tensor(t, 0, dist.group.WORLD))

    calls()                        # before commviz starts: torch numbers these, commviz not
    before = _fr_last()
    _start(run_dir)
    calls()                        # boxed (torch's Autograd fallback) and unboxed (funcol)
    with torch.inference_mode():   # inference tensors skip autograd: every call unboxed
        calls()
    snap = snapshot()
    snap["after"] = {"0": before}
    commviz.enable(False)
    kept = len(commviz.RECORDER.records())
    calls()
    with torch.inference_mode():
        calls()
    snap["recorded_while_off"] = len(commviz.RECORDER.records()) - kept
    off_end = _fr_last()
    commviz.enable(True)
    calls()
    again = snapshot()
    again["records"] = again["records"][kept:]
    snap["again"], snap["again_after"] = again, {"0": off_end}
    snap["boxed_only"] = list(boundary.BOUNDARY.boxed)
    return snap


def test_boxed_unboxed_and_inference_calls_numbered_as_torch_and_none_while_off(
        run_dir: Path) -> None:
    for snap in run_ranks(_arrivals, 2, str(run_dir), env=FR_ENV):
        counts = compare(snap, after=snap["after"])["0"]
        _every_record_has_an_origin(snap)
        # twice (normal and inference tensors): all_reduce from c10d and functional, broadcast,
        # reduce_scatter_tensor, all_gather from c10d and functional (gloo's coalesced op)
        assert counts == {"all_reduce": 4, "broadcast": 2, "reduce_scatter_tensor": 2,
                          "all_gather_into_tensor": 2, "all_gather_into_tensor_coalesced": 2}
        assert snap["recorded_while_off"] == 0
        # recording on again: numbered on from torch's count, the calls made while off included
        again = compare(snap["again"], after=snap["again_after"])["0"]
        assert sum(again.values()) == 6, again
        # every op got the kernel with its own C++ signature on this torch (ProcessGroup.hpp)
        assert snap["boxed_only"] == []
