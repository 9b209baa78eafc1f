"""The CUDA graph matcher on real files recorded on 2 x H200 (``tests/fixtures/gpu``), on CPU.

The fixtures are the GPU test's own run (``test_gpu_graphs.py``): per rank the eager step's trace
(the profiler's ground truth), the graphed trace (two graphs, tagged and untagged replays) and
the commviz record; ``synthetic/`` holds the graphed traces rewritten the way torch >= 2.12 writes
them (``make_synthetic.py``). Each test feeds the matcher real data, or real data with one thing
broken, and checks that every label it gives is the eager one and that whatever it cannot be
sure of is reported instead.
"""

from __future__ import annotations

import copy
import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from commviz import metadata as md
from commviz.capture import cupti, hooks
from commviz.capture.marks import MARK, MARK_LANE
from commviz.capture.names import kernel_key
from commviz.match.graphed import MATCHED_BY, REPLAY, check_kernel, match_graphed
from commviz.record.store import load_record
from commviz.kernels import parse_nccl
from commviz.trace.load import Trace, load_trace
from test_gpu_graphs import TAGGED_REPLAYS, assert_rank, check_rank, load_rank

FIX = Path(__file__).parent / "fixtures" / "gpu"
RANKS = (0, 1)


def graphed(rank: int) -> tuple[Trace, dict]:
    return (load_trace(FIX / "graphed" / f"trace_rank{rank}.json.gz"),
            load_record(FIX / "graphed" / f"commviz_rank{rank}.pkl"))


def nccl_indices(trace: Trace, result) -> list[int]:
    return [i for i in sorted(result.graphed)
            if trace.events[i].get("cat") == "kernel" and parse_nccl(trace.events[i]["name"])]


def identity(args: dict) -> tuple:
    return (args[md.PG_NAME], args[md.GRAPH], args[md.ORDINAL], args[REPLAY])


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    return {rank: check_rank(*load_rank(FIX, rank)) for rank in RANKS}


@pytest.mark.parametrize("rank", RANKS)
def test_recorded_run_matches_the_eager_profiler(reports: dict, rank: int) -> None:
    """Every graphed NCCL kernel of every replay gets its eager twin's values; none unmatched."""
    report = reports[rank]
    assert_rank(report)
    stats = report["stats"]
    assert stats["graph_replays_by_tag"] == 2 * TAGGED_REPLAYS
    assert stats["graph_replays_by_fingerprint"] == 2          # torch's own replay(), untagged
    assert stats["graph_matched"] == report["kernels"]
    # and commviz's values are the profiler's own, key by key, eager and graphed
    assert report["format_differences"] == [] and report["vs_profiler"] == []


@pytest.mark.parametrize("rank", RANKS)
def test_both_ranks_name_each_replayed_collective_alike(rank: int) -> None:
    """The instance key of every graphed collective exists on the other rank too."""
    keys = {}
    for r in RANKS:
        trace, record = graphed(r)
        keys[r] = Counter(ev.key for ev in match_graphed(trace, record).events)
    assert keys[rank] and keys[rank] == keys[1 - rank]
    assert all(n == 1 for n in keys[rank].values())


@pytest.mark.parametrize("rank", RANKS)
def test_marked_compute_kernels_are_labelled(rank: int) -> None:
    trace, record = graphed(rank)
    result = match_graphed(trace, record)
    marks = Counter(m[MARK] for m in result.marks.values())
    replays = TAGGED_REPLAYS + 1
    for name in ("matmul_world", "matmul_pg_a", "matmul_pg_b"):
        assert marks[name] >= replays and marks[name] % replays == 0, marks
    assert marks["scale"] == replays, marks
    lanes = {m[MARK]: m.get(MARK_LANE) for m in result.marks.values()}
    assert lanes["matmul_pg_a"] == "pg_a" and lanes["scale"] is None


@pytest.mark.parametrize("rank", RANKS)
def test_eager_marks_label_kernels_launched_inside(rank: int) -> None:
    trace = load_trace(FIX / "eager" / f"trace_rank{rank}.json.gz")
    result = match_graphed(trace, load_record(FIX / "eager" / f"commviz_rank{rank}.pkl"))
    names = Counter(m[MARK] for m in result.marks.values())
    assert names["scale"] >= 1 and names["matmul_world"] >= 1, names
    assert not result.graphed and not result.unmatched


@pytest.mark.parametrize("rank", RANKS)
def test_exact_matching_by_graph_node_id(rank: int) -> None:
    """torch >= 2.12 traces: ids alone place every kernel, whatever the order in the replay."""
    trace, record = graphed(rank)
    by_order = match_graphed(trace, record)
    synthetic = load_trace(FIX / "synthetic" / f"trace_rank{rank}.json.gz")
    by_id = match_graphed(synthetic, record)
    assert not by_id.unmatched
    assert by_id.stats.get("graph_matched_by_node_id") == by_order.stats["graph_matched"]
    assert "graph_matched_by_order" not in by_id.stats
    assert {i: identity(a) for i, a in by_id.kernel_args.items()} == \
        {i: identity(a) for i, a in by_order.kernel_args.items()}
    assert all(a[MATCHED_BY] == "graph node id" for a in by_id.kernel_args.values())
    assert by_id.marks.keys() == by_order.marks.keys()


def test_unknown_graph_node_id_is_reported() -> None:
    trace = load_trace(FIX / "synthetic" / "trace_rank0.json.gz")
    _, record = graphed(0)
    victim = next(i for i, ev in enumerate(trace.events)
                  if ev.get("cat") == "kernel" and "graph node id" in ev.get("args", {})
                  and parse_nccl(ev["name"]))
    trace.events[victim]["args"]["graph node id"] = 123456789
    result = match_graphed(trace, record)
    assert [u.index for u in result.unmatched] == [victim]
    assert "not in the record" in result.unmatched[0].reason
    assert victim not in result.kernel_args


def test_capture_ids_are_accepted_too() -> None:
    """Node ids that carry the capture graph's id (not the exec graph's) match as well."""
    trace = load_trace(FIX / "synthetic" / "trace_rank0.json.gz")
    _, record = graphed(0)
    to_capture = {g["exec_ids"][-1]: g["cupti_graph_id"] for g in record["graphs"]}
    for ev in trace.events:
        args = ev.get("args") or {}
        if "graph node id" in args:
            node = args["graph node id"]
            args["graph node id"] = (to_capture[node >> 32] << 32) | (node & 0xFFFFFFFF)
    for g in record["graphs"]:
        g["exec_ids"] = []
    result = match_graphed(trace, record)
    assert not result.unmatched
    assert result.stats["graph_matched_by_node_id"] == len(nccl_indices(trace, result))


def test_ambiguous_order_is_reported_never_guessed() -> None:
    """Forget the dependencies between captured kernels: same-kernel collectives of different
    groups become indistinguishable, and are reported; every label still given is right."""
    trace, record = graphed(0)
    truth = {i: identity(a) for i, a in match_graphed(trace, record).kernel_args.items()}
    blind = copy.deepcopy(record)
    for g in blind["graphs"]:
        for node in g["nodes"]:
            node["after"] = []
    result = match_graphed(trace, blind)
    assert result.unmatched
    assert any("nothing tells them apart" in u.reason for u in result.unmatched)
    for i, args in result.kernel_args.items():
        assert identity(args) == truth[i]
    assert len(result.kernel_args) + len(result.unmatched) == len(truth)


def test_a_kernel_missing_from_a_replay_leaves_that_replay_unlabelled() -> None:
    trace, record = graphed(0)
    full = match_graphed(trace, record)
    victim = nccl_indices(trace, full)[3]
    corr = trace.events[victim]["args"]["correlation"]
    trace.events[victim] = {"ph": "i", "name": "dropped", "ts": trace.events[victim]["ts"]}
    result = match_graphed(trace, record)
    lost = [u for u in result.unmatched if "incomplete" in u.reason]
    same_replay = [i for i in nccl_indices(trace, full)
                   if trace.events[i].get("args", {}).get("correlation") == corr]
    assert sorted(u.index for u in lost) == sorted(same_replay)
    assert all(full.kernel_args[i] == a for i, a in result.kernel_args.items())


def test_record_that_contradicts_the_kernel_is_reported() -> None:
    """A kernel that cannot be its recorded collective (here: wrong dtype) stays unlabelled."""
    trace, record = graphed(0)
    meta = next(m for m in record["collectives"]
                if m.get(md.CAPTURED) and m[md.OP] == "all_reduce" and m[md.DTYPE] == "Float")
    meta[md.DTYPE] = "Half"
    result = match_graphed(trace, record)
    assert result.unmatched and all("dtype" in u.reason for u in result.unmatched)
    assert len(result.unmatched) == TAGGED_REPLAYS + 1


def test_replays_found_by_time_without_tag_args() -> None:
    """No range args (record_shapes=False): the recorded replay windows name the graph."""
    trace, record = graphed(0)
    for ev in trace.events:
        if ev.get("name") == hooks.REPLAY_RANGE:
            ev["args"] = {}
    result = match_graphed(trace, record)
    assert result.stats["graph_replays_by_time"] == 2 * TAGGED_REPLAYS
    assert not result.unmatched


def test_unidentified_replays_are_reported() -> None:
    """No tag, no recorded window, and a fingerprint two graphs share: nothing is guessed."""
    trace, record = graphed(0)
    for ev in trace.events:
        if ev.get("name") == hooks.REPLAY_RANGE:
            ev["args"] = {}
    first = record["graphs"][0]
    record = dict(record, replays=[], graphs=record["graphs"] + [dict(first, graph=99)])
    result = match_graphed(trace, record)
    assert result.stats["graph_replays_unidentified"] == TAGGED_REPLAYS + 1
    assert result.unmatched and not any(a[md.GRAPH] == first["graph"]
                                        for a in result.kernel_args.values())
    assert all(u.reason.startswith("its replay matches no captured graph")
               for u in result.unmatched)


def test_no_fingerprint_match_while_a_graph_has_none() -> None:
    """A graph captured without collectives or marks is not read at capture end: an untagged
    replay could be that graph, so no fingerprint is trusted."""
    trace, record = graphed(0)
    bare = {"graph": 7, "complete": False, "kernel_names": {}, "nodes": [], "exec_ids": []}
    result = match_graphed(trace, dict(record, graphs=record["graphs"] + [bare]))
    assert "graph_replays_by_fingerprint" not in result.stats
    assert result.stats["graph_replays_unidentified"] == 2
    assert len(result.unmatched) == sum(1 for i in nccl_indices(trace, result)
                                        if i not in result.kernel_args)


def test_without_a_record_graphed_kernels_are_unmatched() -> None:
    trace, _ = graphed(1)
    result = match_graphed(trace, None)
    assert result.unmatched and not result.kernel_args
    assert all(u.reason == "no commviz record for this rank" for u in result.unmatched)


# -- the pieces ---------------------------------------------------------------------------------
def test_kernel_keys_join_mangled_and_demangled_names() -> None:
    """Every kernel the record names (mangled at capture) appears in the trace (demangled)."""
    trace, record = graphed(0)
    in_trace = {kernel_key(ev["name"]) for ev in trace.events if ev.get("cat") == "kernel"}
    for g in record["graphs"]:
        assert set(g["kernel_names"]) <= in_trace
    assert kernel_key("_ZN2at6native12_GLOBAL__N_16kernelIfEEvT_") == \
        kernel_key("void at::native::(anonymous namespace)::kernel<float>(float)") == \
        "at::native::(anonymous namespace)::kernel"
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    assert kernel_key(f"_Z39{nccl}24ncclDevKernelArgsStorageILm4096EE") == nccl
    assert kernel_key(f"{nccl}(ncclDevKernelArgsStorage<4096ul>)") == nccl


def test_check_kernel_agrees_with_the_collective() -> None:
    meta = {md.COLLECTIVE_NAME: "allreduce", md.DTYPE: "BFloat16", md.REDUCE_OP: "sum"}
    assert check_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", meta) is None
    assert "dtype" in check_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", meta)
    assert "reduction" in check_kernel("ncclDevKernel_AllReduce_Max_bf16_RING_LL(x)", meta)
    # NCCL runs max/min/product in its sum-specialised kernel: that is no contradiction
    assert check_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)",
                        dict(meta, **{md.REDUCE_OP: "max"})) is None
    assert "cannot carry" in check_kernel("ncclDevKernel_Broadcast_RING_LL(x)", meta)
    assert check_kernel("ncclDevKernel_AllReduce_PreMulSum_f32_RING_LL(x)",
                        {md.COLLECTIVE_NAME: "allreduce", md.DTYPE: "Float",
                         md.REDUCE_OP: "avg"}) is None
    assert check_kernel("ncclDevKernel_SendRecv(x)",
                        {md.COLLECTIVE_NAME: "batch_isend_irecv", md.DTYPE: "Float"}) is None


def test_cupti_absent_gives_no_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUPTI library anywhere: ids are None, nothing raises."""
    monkeypatch.setattr(cupti, "_candidates", lambda: ["/nonexistent/libcupti.so.13"])
    monkeypatch.setattr(cupti, "_tried", False)
    monkeypatch.setattr(cupti, "_lib", None)
    monkeypatch.setattr(cupti, "path", None)
    assert not cupti.available()
    assert cupti.node_id(0x1234) is None and cupti.graph_id(0x1234) is None
    assert cupti.exec_id(0x1234) is None and cupti.path is None


def test_hooks_install_and_restore_cudagraph_methods() -> None:
    import torch

    was = hooks.installed()                      # commviz installs them on import
    hooks.uninstall()
    before = {n: torch.cuda.CUDAGraph.__dict__.get(n) for n in ("replay", "capture_end")}
    assert torch.cuda.CUDAGraph.replay is not hooks._replay and hooks.capture_possible()
    hooks.install()
    hooks.install()                               # idempotent
    assert torch.cuda.CUDAGraph.replay is hooks._replay
    hooks.uninstall()
    assert {n: torch.cuda.CUDAGraph.__dict__.get(n) for n in before} == before
    if was:
        hooks.install()


def test_fixture_files_stay_small() -> None:
    # every real GPU run kept for CI, one set per case: the 2-GPU proof's 12 runs are 1.4 MB,
    # the 4-GPU proof's 9 (4 ranks each: 2-D meshes, 8-micro-batch pipelines, a 3-D job) 7 MB,
    # each verdict set 0.4 MB; a case's set stays under 1 MB a rank pair. torchtitan's own
    # compiled FSDP2 x TP trainer on 4 GPUs (the one real run of code nobody here wrote, its
    # ranks' traces 6.7 MB of JSON each) is 2.7 MB: the whole budget grew by that set alone
    sets = {d.name: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
            for d in FIX.iterdir() if d.is_dir()}
    assert sum(sets.values()) < 13_800_000, sets
    assert sets["proof-4x"] < 7_500_000 and sets["proof-2xh100"] < 1_600_000, sets
    assert sets["titan-fsdp-tp-4xh200"] < 2_800_000, sets
    for path in FIX.rglob("trace_rank*.json.gz"):
        assert json.loads(gzip.open(path).read())["traceEvents"]
