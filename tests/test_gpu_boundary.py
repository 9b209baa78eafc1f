"""GPU, one rank: the c10d boundary records NCCL collectives whoever issues them.

One torchrun job (this file run as a script, 1 rank, NCCL, Flight Recorder on) issues
collectives through the torch.distributed API, functional collectives, DDP (setup and reducer),
a compiled function (same graph breaks as without commviz) and under ``torch.cuda.graph``
capture, with ``commviz.start()`` only. The checks here compare its records with NCCL's own
Flight Recorder numbering (``fr_compare``) and look at the captured collectives' records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fr_compare import FR_ENV

REPO = Path(__file__).resolve().parents[1]


def _compiled(x: Any) -> Any:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    return y + 1


def _breaks(torch: Any, fn: Any, x: Any) -> tuple[int, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn)
    for _ in range(2):
        compiled(x)
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _reduce_overhead(torch: Any, commviz: Any, graphs: Any, funcol: Any, dist: Any
                     ) -> dict[str, Any]:
    """A compiled step with a functional all_reduce under ``mode="reduce-overhead"`` (cudagraph
    trees capture it themselves): its records, and what torch says it did with CUDA graphs."""
    from torch._dynamo.utils import counters

    def step(t: Any) -> Any:
        return funcol.all_reduce(t * 2, "sum", dist.group.WORLD) + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead")
    inp = torch.ones(1024, device="cuda")
    first, graphs_before = len(commviz.RECORDER.records()), len(commviz.RECORDER.graphs)
    for _ in range(5):
        compiled(inp)
    torch.cuda.synchronize()
    graphs.resolve_all()
    new_graphs = [g["graph"] for g in commviz.RECORDER.graphs[graphs_before:]]
    return {"first": first, "graphs_before": graphs_before, "skips": sum(counters["inductor"].get(k, 0) for k in counters["inductor"]
                         if "cudagraph_skip" in k),
            "new_graphs": new_graphs,
            "records": [(r["Process Group Name"], r.get("commviz.seq"),
                         bool(r.get("commviz.captured")), r.get("commviz.graph"),
                         r.get("commviz.ordinal"))
                        for r in commviz.RECORDER.records()[first:]]}


def job(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    sys.path.insert(0, str(Path(__file__).parent))
    import commviz
    from commviz.capture import graphs
    from fr_compare import snapshot

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 16, device="cuda")
    plain_breaks = _breaks(torch, _compiled, x)
    after = {"0": dist.group.WORLD._get_sequence_number_for_group()}
    commviz.start(str(out / "run"), flush_interval=None)
    sub = dist.new_group([0])
    dist.all_reduce(x)
    dist.broadcast(x, src=0, group=sub)
    big = torch.empty(1 << 16, device="cuda")
    dist.all_gather_into_tensor(big, x)
    dist.reduce_scatter_tensor(torch.empty(1 << 16, device="cuda"), big)
    dist.all_to_all_single(torch.empty_like(x), x)
    with dist._coalescing_manager():
        dist.all_reduce(x)
        dist.all_reduce(big)
    funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
    with torch.inference_mode():
        dist.all_reduce(torch.ones(8, device="cuda"))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda())
    for _ in range(2):
        model(torch.randn(8, 64, device="cuda")).sum().backward()
    recorded_breaks = _breaks(torch, _compiled, x)
    torch.cuda.synchronize()
    before_capture = len(commviz.RECORDER.records())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            dist.all_reduce(x)                       # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    fr_last: dict[str, int] = {}          # NCCL's own last number per group before the capture
    for e in snapshot()["fr"]:
        fr_last[e["group"]] = max(fr_last.get(e["group"], 0), e["seq"])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
        y = funcol.all_reduce(x * 3, "sum", dist.group.WORLD)
        dist.all_reduce(y, group=sub)
        dist.all_reduce(x, async_op=True).wait()     # walked by Python, between native ones
        dist.all_reduce(x)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    graphs.resolve_all()
    reduce_overhead = _reduce_overhead(torch, commviz, graphs, funcol, dist)
    # what the journal alone says of each call: the kernel's own entries carry "captured"
    from commviz.record.journal import recover
    journaled = [(m["Process Group Name"], m.get("commviz.seq"), bool(m.get("commviz.captured")))
                 for m in recover(out / "run", 0)[0]["collectives"]]
    snap = snapshot()
    snap.update(plain_breaks=plain_breaks, recorded_breaks=recorded_breaks, after=after,
                before_capture=before_capture, fr_last=fr_last, journaled=journaled,
                reduce_overhead=reduce_overhead,
                boundary=commviz.record.boundary.BOUNDARY.impl.value)
    (out / "snap.json").write_text(json.dumps(snap, default=str))
    dist.barrier()
    os._exit(0)


@pytest.fixture(scope="module")
def snap(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu_boundary")
    env = dict(os.environ, **FR_ENV, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", "29533", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert (out / "snap.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "snap.json").read_text())


@pytest.mark.gpu(count=1)
def test_nccl_records_equal_flight_recorder(snap: dict[str, Any]) -> None:
    from fr_compare import compare

    assert snap["boundary"] == "cpp"
    assert snap["fr"], "Flight Recorder recorded nothing"
    (Path(os.environ.get("OUT", "/tmp")) / "gpu_boundary_snap.json").write_text(json.dumps(
        {"fr": snap["fr"], "records": [(r["Process Group Name"], r.get("commviz.seq"),
                                        r["commviz.op"], r.get("commviz.captured"),
                                        r["commviz.callsite"]) for r in snap["records"]]}))
    counts = compare(snap, after=snap["after"])
    world = counts["0"]
    # API calls, coalesced pair (one NCCL number, two records), functional, inference mode,
    # DDP's setup and reducer, compiled and captured calls: all of them reach the records
    assert world["all_reduce"] >= 8 and world["all_gather_into_tensor"] >= 1
    assert world["reduce_scatter_tensor"] == 1 and world["all_to_all_single"] == 1


@pytest.mark.gpu(count=1)
def test_compiled_code_breaks_the_same(snap: dict[str, Any]) -> None:
    assert snap["recorded_breaks"] == snap["plain_breaks"]


@pytest.mark.gpu(count=1)
def test_captured_collectives_are_recorded_with_their_graph(snap: dict[str, Any]) -> None:
    captured = [r for r in snap["records"][snap["before_capture"]:
                                           snap["reduce_overhead"]["first"]]
                if r.get("commviz.captured")]
    # API all_reduce, functional all_reduce, the subgroup's, an async one and one more: each
    # once, in the graph, in call order, numbered on from the last number NCCL gave each
    # group before the capture
    assert [r["commviz.op"] for r in captured] == ["all_reduce"] * 5
    assert len({r["commviz.graph"] for r in captured}) == 1
    assert snap["reduce_overhead"]["graphs_before"] == 1
    last = snap["fr_last"]
    sub = captured[2]["Process Group Name"]
    assert [(r["Process Group Name"], r["commviz.seq"]) for r in captured] == [
        ("0", last["0"] + 1), ("0", last["0"] + 2), (sub, last[sub] + 1),
        ("0", last["0"] + 3), ("0", last["0"] + 4)]
    # ordinals within the graph follow the calls on each lane, across both recording paths
    assert [r["commviz.ordinal"] for r in captured if r["Process Group Name"] == "0"] == \
        [1, 2, 3, 4]
    assert [r["commviz.ordinal"] for r in captured if r["Process Group Name"] == sub] == [1]
    # the synchronous API calls were recorded by the kernel itself (its calls-file entries say
    # "captured"); the asynchronous one was built in Python (its journal entry was written at
    # its start, before anything was known of its graph)
    journaled = {(g, s): c for g, s, c in snap["journaled"]}
    sync = [captured[i] for i in (0, 2, 4)]
    assert all(journaled[(r["Process Group Name"], r["commviz.seq"])] for r in sync)
    assert not journaled[("0", captured[3]["commviz.seq"])]
    # the call site is the user's line, also for calls from compiled code's generated module
    sites = [r["commviz.callsite"] for r in snap["records"] if r.get("commviz.callsite")]
    assert sites and all(s.startswith(__file__) or "site-packages" not in s for s in sites)
    assert not any("torchinductor" in s for s in sites), sites


@pytest.mark.gpu(count=1)
def test_reduce_overhead_graphs_get_their_collectives(snap: dict[str, Any]) -> None:
    ro = snap["reduce_overhead"]
    (Path(os.environ.get("OUT", "/tmp")) / "gpu_reduce_overhead.json").write_text(json.dumps(ro))
    captured = [r for r in ro["records"] if r[2]]
    assert ro["records"], "the compiled step's all_reduce was not recorded"
    if ro["skips"]:              # torch chose not to graph it: nothing may claim it was
        assert not captured and not ro["new_graphs"]
        return
    # cudagraph trees captured the step: its all_reduce is in one of the graphs they made,
    # first on its lane, and the group's numbering goes on without a gap
    assert captured and all(r[3] in ro["new_graphs"] and r[4] == 1 for r in captured)
    seqs = [r[1] for r in ro["records"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


if __name__ == "__main__":
    job(Path(sys.argv[1]))
