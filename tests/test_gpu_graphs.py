"""GPU: CUDA-graphed collectives carry the eager NCCL metadata, checked on 2 GPUs.

One torchrun job (this file run as a script, 2 ranks, NCCL) does the same step on the world
group and on two more process groups: all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single (with and without splits), batch_isend_irecv and an
async all_reduce waited after a ``commviz.mark``-ed matmul, plus a list all_gather, a list
all_to_all and an all_reduce_coalesced. It runs the
step eagerly under the profiler (the ground truth: the profiler's own metadata on each NCCL
kernel), then captures it into one graph and a second, different step into another graph on a
side stream, and replays both several times under the profiler: tagged replays through commviz,
and one untagged replay of each (torch's own replay, found by the fingerprint).

The checks run here, in the test process, on the files the job wrote; the CPU tests
(``test_match_graphed.py``) run the same checks on a copy of them kept in ``tests/fixtures/gpu``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
N = 4096                                # elements per rank and buffer: small, NCCL's LL protocol
GROUPS = (("world", "Float"), ("pg_a", "BFloat16"), ("pg_b", "Float"))
TAGGED_REPLAYS = 3


# ---------------------------------------------------------------------------------------------
# the job (runs under torchrun on the GPU machine)
# ---------------------------------------------------------------------------------------------
def _buffers(torch: Any, rank: int, dtype: Any) -> dict[str, Any]:
    dev = torch.device("cuda")
    full = lambda n: torch.full((n,), float(rank + 1), device=dev, dtype=dtype)  # noqa: E731
    return {"x": full(N), "y": full(N), "ag": full(2 * N), "rs": full(N), "a2a": full(N),
            "send": full(N), "recv": full(N), "m": torch.randn(64, 64, device=dev, dtype=dtype),
            "mm": torch.empty(64, 64, device=dev, dtype=dtype),
            "parts": [full(N) for _ in range(2)],
            "a2a_in": [full(N // 2) for _ in range(2)], "a2a_out": [full(N // 2) for _ in range(2)],
            "co": [full(N), full(N // 2)]}


def step(dist: Any, capture: Any, rank: int, groups: list[tuple[str, Any, dict]]) -> None:
    """Every collective kind on every group (the step that is run eagerly and captured)."""
    peer = 1 - rank
    for name, g, b in groups:
        dist.all_reduce(b["x"], group=g)
        dist.broadcast(b["x"], src=0, group=g)
        dist.all_gather_into_tensor(b["ag"], b["x"], group=g)
        dist.reduce_scatter_tensor(b["rs"], b["ag"], group=g)
        if name == "pg_a":
            dist.all_to_all_single(b["a2a"], b["x"], [N // 2, N // 2], [N // 2, N // 2], group=g)
        else:
            dist.all_to_all_single(b["a2a"], b["x"], group=g)
        if name == "pg_b":                           # grouped: one send/recv per peer
            dist.all_to_all(b["a2a_out"], b["a2a_in"], group=g)
        if name == "world":                          # coalesced: one launch, two tensors
            dist.all_reduce_coalesced(b["co"], group=g)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, b["send"], peer, g),
                                        dist.P2POp(dist.irecv, b["recv"], peer, g)])
        for w in works:
            w.wait()
        op = dist.ReduceOp.MAX if name == "pg_b" else dist.ReduceOp.SUM
        work = dist.all_reduce(b["y"], op=op, group=g, async_op=True)
        with capture.mark(f"matmul_{name}", stream=name):
            b["mm"].copy_(b["m"] @ b["m"])
        work.wait()
        if name == "world":
            dist.all_gather(b["parts"], b["x"], group=g)


def step2(dist: Any, capture: Any, rank: int, groups: list[tuple[str, Any, dict]]) -> None:
    """A different, shorter step: the second graph (captured on a side stream)."""
    (_, world, bw), (_, pg_a, ba), (_, pg_b, bb) = groups
    dist.all_reduce(bb["x"], group=pg_b)
    with capture.mark("scale"):
        bw["x"].mul_(0.5)
    dist.broadcast(bw["x"], src=1, group=world)
    dist.all_gather_into_tensor(ba["ag"], ba["x"], group=pg_a)
    dist.all_reduce(bw["y"], group=world)


def job(out: Path) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import commviz
    from commviz import capture

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                            timeout=datetime.timedelta(seconds=120))
    commviz.start(out / "graphed")
    commviz.patch()
    pg_a = dist.new_group([0, 1], group_desc="pg_a")
    pg_b = dist.new_group([0, 1], group_desc="pg_b")
    handles = {"world": dist.group.WORLD, "pg_a": pg_a, "pg_b": pg_b}
    dtypes = {"Float": torch.float32, "BFloat16": torch.bfloat16}
    groups = [(name, handles[name], _buffers(torch, rank, dtypes[dt])) for name, dt in GROUPS]

    for _ in range(2):                               # warm up: communicators, cuBLAS, p2p
        step(dist, capture, rank, groups)
        step2(dist, capture, rank, groups)
    torch.cuda.synchronize()

    with commviz.profile(out / "eager"):             # ground truth: the eager step, profiled
        step(dist, capture, rank, groups)
        torch.cuda.synchronize()
        step2(dist, capture, rank, groups)
        torch.cuda.synchronize()

    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with capture.graph(g1):
        step(dist, capture, rank, groups)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with capture.graph(g2, stream=side):
        step2(dist, capture, rank, groups)
    torch.cuda.synchronize()
    g1.replay()                                       # one replay outside the profiler
    g2.replay()
    torch.cuda.synchronize()

    with commviz.profile(out / "graphed"):
        for _ in range(TAGGED_REPLAYS):
            g1.replay()
            g2.replay()
        torch._C._CUDAGraph.replay(g1)               # untagged: torch's own replay
        torch._C._CUDAGraph.replay(g2)
        torch.cuda.synchronize()

    from commviz.capture import bindings, cupti

    capture.resolve_all()                            # (flush does it; the info below reads it)
    info = {"rank": rank, "torch": torch.__version__, "cupti": cupti.path,
            "backend": bindings.backend().name if bindings.available() else None,
            "nccl": list(torch.cuda.nccl.version()),
            "graphs": [{k: g[k] for k in ("graph", "cupti_graph_id", "exec_ids",
                                          "tools_exec_ids", "complete", "kernel_count",
                                          "replays")} for g in commviz.RECORDER.graphs]}
    (out / f"info_rank{rank}.json").write_text(json.dumps(info, indent=1))
    commviz.RECORDER.flush("explicit", run_dir=out / "eager")
    commviz.flush()
    dist.barrier()
    check_node_ids(out, rank, torch, dist, capture, step, groups)
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


def check_node_ids(out: Path, rank: int, torch: Any, dist: Any, capture: Any, fn: Any,
                   groups: Any) -> None:
    """After the records are written: capture ``fn`` once more into a graph that outlives its
    capture (``keep_graph``), and compare every node id commviz recorded (computed from the
    node's place in the graph) with CUPTI's own id of the node, queried node by node."""
    import commviz
    from commviz.capture import bindings, cupti
    from commviz.capture.names import kernel_key

    g = torch.cuda.CUDAGraph(keep_graph=True)
    with capture.graph(g):
        fn(dist, capture, rank, groups)
    capture.resolve_all()
    record = commviz.RECORDER.graphs[-1]
    real = {}
    for handle in bindings.nodes(int(g.raw_cuda_graph())):
        desc = bindings.kernel(handle)
        if desc is not None:
            real[cupti.node_id(handle)] = kernel_key(desc[0])
    checked = [n for n in record["nodes"] if n["node"] is not None]
    wrong = [n["node"] for n in checked if real.get(n["node"]) != n["kernel"]]
    (out / f"node_ids_rank{rank}.json").write_text(json.dumps(
        {"kernels": len(real), "checked": len(checked), "labelled":
         sum(n["ordinal"] is not None or bool(n["marks"]) for n in checked), "wrong": wrong}))
    g.instantiate()


# ---------------------------------------------------------------------------------------------
# the checks (also used by test_match_graphed.py on the fixtures)
# ---------------------------------------------------------------------------------------------
def _eager_keys() -> tuple[str, ...]:
    from commviz import metadata as md

    return md.EAGER_KEYS


def _nccl(ev: dict) -> bool:
    from commviz.kernels import parse_nccl

    return ev.get("ph") == "X" and ev.get("cat") == "kernel" and \
        parse_nccl(str(ev.get("name", ""))) is not None


def eager_truth(trace: Any, record: dict) -> dict[tuple[str, int], dict[str, Any]]:
    """(process group name, position of the call on that group) -> the eager NCCL kernel's
    profiler metadata and commviz's metadata of the call it ran for: the eager step's record,
    each call joined to the kernels launched inside its event (the profiler's ``c10d::<op>``
    event, in older traces commviz's ``commviz::<op>`` range) by commviz's matcher."""
    from commviz import metadata as md
    from commviz.match import match_rank

    matched = match_rank(trace, record, rank=int(record["rank"]))
    kernel_of = {ev.extra["record_index"]: ev.extra["kernel_indices"][0]
                 for ev in matched.events if ev.source == "kernel"}
    for i, ev in enumerate(trace.events):
        if _nccl(ev):
            assert i in kernel_of.values(), f"eager kernel {ev['name']} joined to no call"
    out: dict[tuple[str, int], dict[str, Any]] = {}
    count: dict[str, int] = defaultdict(int)
    keys = _eager_keys()
    for pos, meta in enumerate(record["collectives"]):
        if meta.get(md.CAPTURED):
            continue
        pg = str(meta[md.PG_NAME])
        count[pg] += 1
        index = kernel_of.get(pos)
        ev = trace.events[index] if index is not None else None
        out[(pg, count[pg])] = {
            "kernel": ev["name"] if ev else None,
            "profiler": {k: ev["args"][k] for k in keys if ev and k in ev["args"]},
            "commviz": {k: meta[k] for k in keys if k in meta},
            "op": meta.get(md.OP)}
    return out


def format_differences(truth: dict) -> list[dict[str, Any]]:
    """Every eager key where the profiler and commviz's metadata disagree (same collective)."""
    diffs = []
    for (pg, pos), item in sorted(truth.items()):
        for key, value in item["profiler"].items():
            mine = item["commviz"].get(key)
            if str(mine) != str(value) or type(mine) is not type(value):
                diffs.append({"pg": pg, "position": pos, "op": item["op"], "key": key,
                              "profiler": value, "commviz": mine})
    return diffs


def check_rank(eager_trace: Any, graphed_trace: Any, record: dict, eager_record: dict
               ) -> dict[str, Any]:
    """Match the graphed trace and compare every graphed NCCL kernel with its eager twin."""
    from commviz import metadata as md
    from commviz.match.graphed import REPLAY, match_graphed

    truth = eager_truth(eager_trace, eager_record)
    result = match_graphed(graphed_trace, record)
    # where the second graph's calls sit in the eager run: after the first step's, per group
    first = min(g["graph"] for g in record["graphs"])
    step1 = defaultdict(int)
    for meta in record["collectives"]:
        if meta.get(md.GRAPH) == first:
            step1[meta[md.PG_NAME]] = max(step1[meta[md.PG_NAME]], meta[md.ORDINAL])
    report: dict[str, Any] = {"kernels": 0, "matched": 0, "unmatched": len(result.unmatched),
                              "mislabelled": [], "vs_profiler": [], "per_replay": {},
                              "stats": result.stats,
                              "unmatched_reasons": [u.reason for u in result.unmatched],
                              "format_differences": format_differences(truth)}
    per_replay: dict[tuple, int] = defaultdict(int)
    for i, ev in enumerate(graphed_trace.events):
        if not _nccl(ev) or i not in result.graphed:
            continue
        report["kernels"] += 1
        args = result.kernel_args.get(i)
        if args is None:
            continue
        report["matched"] += 1
        gid, pg = args[md.GRAPH], args[md.PG_NAME]
        pos = args[md.ORDINAL] + (step1[pg] if gid != first else 0)
        per_replay[(gid, args[REPLAY])] += 1
        twin = truth.get((pg, pos))
        if args.get(md.KIND) == "batch" and (twin is None or twin["op"] != args[md.OP]):
            # a coalesced p2p group's kernel, its calls recorded one by one: their sizes
            report["mislabelled"] += _batch_differences(i, args, truth, pg, pos)
            continue
        if twin is None:
            report["mislabelled"].append({"index": i, "why": f"no eager call {pg}#{pos}"})
            continue
        for key, value in twin["commviz"].items():
            if args.get(key) != value:
                report["mislabelled"].append({"index": i, "key": key, "graphed": args.get(key),
                                              "eager": value, "op": twin["op"]})
        for key, value in twin["profiler"].items():
            if args.get(key) != value:
                report["vs_profiler"].append({"op": twin["op"], "key": key,
                                              "graphed": args.get(key), "profiler": value})
    report["per_replay"] = {f"graph{g}/replay{r}": n for (g, r), n in
                            sorted(per_replay.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))}
    # every NCCL kernel node of the graph as CUDA gave it back at the end of the capture,
    # a coalesced p2p group's (claimed by no call) included
    report["expected_per_graph"] = {
        g["graph"]: sum(1 for n in g["nodes"] if n["kernel"].startswith("ncclDevKernel"))
        for g in record["graphs"]}
    return report


def _batch_differences(i: int, args: dict[str, Any], truth: dict, pg: str, pos: int
                       ) -> list[dict[str, Any]]:
    """A graphed coalesced p2p kernel's label against the eager run's calls it stands for
    (its ops from position ``pos`` of its group on): elements sent in, received out."""
    from commviz import metadata as md

    ops = args[md.PEERS].split(",")
    calls = [truth.get((pg, pos + n)) for n in range(len(ops))]
    kinds = [c["op"].removeprefix("i") for c in calls if c is not None]    # isend: send
    if None in calls or kinds != [o.split(":")[0] for o in ops]:
        return [{"index": i, "why": f"{ops} are not the eager calls {pg}#{pos}..", "calls": calls}]
    sent = sum(int(c["commviz"][md.IN_NELEMS]) for c, k in zip(calls, kinds) if k == "send")
    got = sum(int(c["commviz"][md.OUT_NELEMS]) for c, k in zip(calls, kinds) if k == "recv")
    if (args[md.IN_NELEMS], args[md.OUT_NELEMS]) != (sent, got):
        return [{"index": i, "graphed": (args[md.IN_NELEMS], args[md.OUT_NELEMS]),
                 "eager": (sent, got)}]
    return []


def load_rank(run: Path, rank: int) -> tuple[Any, Any, dict, dict]:
    from commviz.record.store import load_record
    from commviz.trace.load import load_trace

    return (load_trace(run / "eager" / f"trace_rank{rank}.json.gz"),
            load_trace(run / "graphed" / f"trace_rank{rank}.json.gz"),
            load_record(run / "graphed" / f"commviz_rank{rank}.pkl"),
            load_record(run / "eager" / f"commviz_rank{rank}.pkl"))


def assert_rank(report: dict[str, Any]) -> None:
    assert report["kernels"] > 0
    assert report["unmatched"] == 0, report["unmatched_reasons"]
    assert report["matched"] == report["kernels"]
    assert report["mislabelled"] == []
    per_graph = report["expected_per_graph"]
    for name, n in report["per_replay"].items():
        graph = int(name.split("/")[0][5:])
        assert n == per_graph[graph], (name, n, per_graph)
    assert len(report["per_replay"]) == 2 * (TAGGED_REPLAYS + 1)


# ---------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness import torchrun

    out = tmp_path_factory.mktemp("gpu_graphs")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    proc = torchrun([str(Path(__file__).resolve()), str(out)], nproc=2, timeout=240, env=env)
    keep = os.environ.get("COMMVIZ_GPU_KEEP")
    if keep:
        shutil.copytree(out, Path(keep) / "gpu_graphs", dirs_exist_ok=True)
        Path(keep, "gpu_graphs", "torchrun.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("rank", [0, 1])
def test_graphed_kernels_carry_eager_metadata(gpu_run: Path, rank: int) -> None:
    report = check_rank(*load_rank(gpu_run, rank))
    keep = os.environ.get("COMMVIZ_GPU_KEEP")
    if keep:
        Path(keep, f"report_rank{rank}.json").write_text(json.dumps(report, indent=1,
                                                                    default=str))
    assert_rank(report)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("rank", [0, 1])
def test_graphed_kernels_read_like_the_profilers_eager_ones(gpu_run: Path, rank: int) -> None:
    """The full chain: graphed values equal the profiler's own eager values, key by key."""
    report = check_rank(*load_rank(gpu_run, rank))
    assert report["vs_profiler"] == [], report["format_differences"]


@pytest.mark.gpu(count=2)
def test_every_captured_collective_found_its_kernel(gpu_run: Path) -> None:
    from commviz import metadata as md
    from commviz.record.store import load_record

    for rank in (0, 1):
        record = load_record(gpu_run / "graphed" / f"commviz_rank{rank}.pkl")
        captured = [m for m in record["collectives"] if m.get(md.CAPTURED)]
        assert len(captured) > 0
        groups: dict[int, set] = defaultdict(set)    # per graph: its coalesced p2p groups
        for meta in captured:
            if meta[md.KIND] == "p2p" and not meta[md.GRAPH_NODES]:
                groups[meta[md.GRAPH]].add((meta[md.PG_NAME], meta[md.FR_P2P_SEQ]))
            else:
                assert len(meta[md.GRAPH_NODES]) == 1, (meta[md.OP], meta[md.GRAPH_NODES])
        assert groups, "the step's batch_isend_irecv calls were coalesced"
        # NCCL added one SendRecv kernel per coalesced group, claimed by no call
        for g in record["graphs"]:
            unclaimed = [n for n in g["nodes"] if n["kernel"].startswith("ncclDevKernel_SendRecv")
                         and n.get("ordinal") is None]
            assert len(unclaimed) == len(groups[g["graph"]]), (g["graph"], groups[g["graph"]])
        assert all(g["complete"] and g["exec_ids"] and g["unresolved"] == 0
                   for g in record["graphs"])


@pytest.mark.gpu(count=2)
def test_recorded_node_ids_are_cuptis_own(gpu_run: Path) -> None:
    for rank in (0, 1):
        ids = json.loads((gpu_run / f"node_ids_rank{rank}.json").read_text())
        assert ids["checked"] >= ids["labelled"] >= 5 and ids["wrong"] == [], ids


@pytest.mark.gpu(count=1)
def test_mark_and_replay_tags_on_one_gpu(tmp_path: Path) -> None:
    """Without communication: marked compute kernels are labelled in every replay."""
    import torch

    import commviz
    from commviz import capture
    from commviz.capture.marks import MARK
    from commviz.match.graphed import match_graphed
    from commviz.record.store import load_record
    from commviz.trace.load import load_trace

    commviz.start(tmp_path)
    a = torch.randn(256, 256, device="cuda")
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a @ a)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture.graph(g):
        with capture.mark("outer"):
            with capture.mark("mm", stream=61):
                b.copy_(a @ a)
            b.mul_(2)
    with commviz.profile(tmp_path):
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    commviz.flush()
    trace = load_trace(tmp_path / "trace_rank0.json.gz", rank=0)
    result = match_graphed(trace, load_record(tmp_path / "commviz_rank0.pkl"))
    labels = [m[MARK] for m in result.marks.values()]
    assert labels.count("outer/mm") >= 3 and labels.count("outer") == 3, labels
    assert not result.unmatched


if __name__ == "__main__":
    job(Path(sys.argv[1]))
