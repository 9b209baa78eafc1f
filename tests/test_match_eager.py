"""Eager NCCL kernels matched with real commviz records, on SYNTHETIC GPU traces.

There is no GPU here. The records come from a real 2-rank gloo job through commviz's wrappers;
the GPU side of each rank's trace is built around them to mirror what torch 2.11's profiler
writes on the H200 machines (``/work/shared/device-findings.md``): the profiler's own
``c10d::<op>`` event around each call on the calling thread (or, as commviz's traces had them
before 2026-11-26, ``commviz::<op>`` ranges), a ``record_param_comms`` op inside with the eager
keys, the launch
(``cuLaunchKernelEx``, ``cat: cuda_driver``) whose ``correlation`` the kernel repeats, NCCL
kernels carrying the eager keys in ``args`` except the ``ncclDevKernel_SendRecv`` of
``batch_isend_irecv`` (none), kernels of a ``cudaGraphLaunch`` replay (cbid 311) with only
stream/correlation, a DDP-style kernel no commviz call issued, and one with nothing at all.
The profiler's eager keys are worked out from the calls the job makes (``profiler_eager``),
never copied from the records, so a record that says otherwise is a conflict the tests see.
Tests on recorded GPU fixtures replace these when ``tests/fixtures/gpu/`` has them.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import commviz
from commviz import metadata as md
from commviz.match import instance_key, match_rank
from commviz.kernels import incompatibility
from commviz.kernels import parse_nccl
from commviz.trace.load import load_trace
from harness import run_ranks

WORLD = 2
STREAMS = {"0": 7, "1": 163}          # NCCL stream per process group, as seen on the H200s
KERNELS = {                           # what NCCL 2.28 names each call's kernel
    "all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    "broadcast": "ncclDevKernel_Broadcast_RING_LL",
    "all_gather_into_tensor": "ncclDevKernel_AllGather_RING_LL",
    "reduce_scatter_tensor": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
    "all_to_all_single": "ncclDevKernel_SendRecv",
    "send": "ncclDevKernel_SendRecv",
    "recv": "ncclDevKernel_SendRecv",
}
ARGS_STORAGE = "(ncclDevKernelArgsStorage<4096ul>)"
C10D_EVENTS = {                       # the dispatcher op each call reaches, as torch names it
    "all_reduce": "c10d::allreduce_", "broadcast": "c10d::broadcast_",
    "all_gather_into_tensor": "c10d::_allgather_base_",
    "reduce_scatter_tensor": "c10d::_reduce_scatter_base_",
    "all_to_all_single": "c10d::alltoall_base_", "send": "c10d::send", "recv": "c10d::recv_",
}
PROFILER_ONLY = ("Rank", "Global rank start", "Global rank stride")


def profiler_eager(world: int, groups: dict[str, str]) -> list[dict[str, Any]]:
    """What the eager profiler writes for each call of ``job``, in call order, worked out here
    from the calls themselves (tensor sizes, groups as torch names them) and the formats of
    ``record_param_comms`` in torch's ProcessGroupNCCL: the expectation owes nothing to
    commviz's records."""
    ranks = str(list(range(world)))

    def call(name: str, n_in: int, n_out: int, group: str) -> dict[str, Any]:
        return {"Collective name": name, "In msg nelems": n_in, "Out msg nelems": n_out,
                "Group size": world, "dtype": "Float", "In split size": "[]",
                "Out split size": "[]", "Process Group Name": groups[group],
                "Process Group Description": group, "Process Group Ranks": ranks}

    return [call("allreduce", 8, 8, "default_pg"), call("allreduce", 8, 8, "tp"),
            call("broadcast", 8, 8, "default_pg"),
            call("_allgather_base", 8, 8 * world, "tp"),
            call("_reduce_scatter_base", 4 * world, 4, "default_pg"),
            call("all_to_allv", 2 * world, 2 * world, "default_pg"),
            call("send", 8, 8, "default_pg"), call("recv", 8, 8, "default_pg"),
            call("allreduce", 8, 8, "default_pg")]


def job(rank: int, world: int) -> dict[str, Any]:
    """The calls issue_step makes on the GPU machines, here on gloo: their real records, and
    the eager profiler's view of the same calls (``profiler_eager``)."""
    import torch.distributed as td

    import commviz.distributed as cvd

    commviz.RECORDER.clear()
    commviz.enable(True)
    tp = td.new_group(list(range(world)), group_desc="tp")
    peer = rank ^ 1
    x = lambda n=8: torch.ones(n) * (rank + 1)  # noqa: E731
    cvd.all_reduce(x())
    cvd.all_reduce(x(), group=tp)
    cvd.broadcast(x(), src=0)
    cvd.all_gather_into_tensor(torch.zeros(8 * world), x(), group=tp)
    cvd.reduce_scatter_tensor(torch.zeros(4), x(4 * world))
    cvd.all_to_all_single(torch.zeros(2 * world), x(2 * world))
    for work in cvd.batch_isend_irecv([cvd.P2POp(cvd.isend, x(), peer),
                                       cvd.P2POp(cvd.irecv, torch.zeros(8), peer)]):
        work.wait()
    cvd.all_reduce(x(), async_op=True).wait()
    record = commviz.RECORDER.payload("explicit")
    groups = {"default_pg": td.group.WORLD.group_name, "tp": tp.group_name}
    record["profiler_eager"] = profiler_eager(world, groups)
    return record


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return run_ranks(job, WORLD, timeout=240)


def test_records_say_what_the_eager_profiler_says(records) -> None:
    """Every eager key of every record as the profiler writes it for the same call."""
    for record in records:
        calls = record["collectives"]
        assert [{k: c[k] for k in md.EAGER_KEYS} for c in calls] == record["profiler_eager"]


class GpuTrace:
    """Builds one rank's synthetic eager GPU trace around its record's calls."""

    def __init__(self, record: dict[str, Any], *, shapes: bool = True, c10d: bool = False
                 ) -> None:
        """``c10d``: each call is the profiler's own ``c10d::<op>`` event on the thread the
        record names; else a ``commviz::<op>`` range, its args the record's if ``shapes``."""
        self.record = record
        self.shapes, self.c10d = shapes, c10d
        self.base = min(c[md.T_BEGIN] for c in record["collectives"]) - 1_000_000
        self.events: list[dict[str, Any]] = []
        self.ids = iter(range(100, 10_000))
        self.pid = 4000 + record["rank"]
        self.tid = record["collectives"][0][md.TID] if c10d else 4000 + record["rank"]
        self.kernel_of: dict[int, int] = {}     # record position -> kernel event index
        for pos, meta in enumerate(record["collectives"]):
            self._call(pos, meta)

    def ts(self, ns: int) -> float:
        return (ns - self.base) / 1000

    def add(self, ev: dict[str, Any]) -> int:
        self.events.append(ev)
        return len(self.events) - 1

    def cpu(self, name: str, cat: str, t0: int, t1: int, args: dict[str, Any]) -> int:
        return self.add({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": self.tid,
                         "ts": self.ts(t0), "dur": (t1 - t0) / 1000, "args": args})

    def kernel(self, name: str, t0: int, stream: int, args: dict[str, Any]) -> int:
        base = {"queued": 0, "device": 0, "context": 1, "stream": stream,
                "registers per thread": 96, "shared memory": 0, "grid": [2, 1, 1],
                "block": [640, 1, 1]}
        return self.add({"ph": "X", "cat": "kernel", "name": name + ARGS_STORAGE,
                         "pid": 0, "tid": stream, "ts": self.ts(t0), "dur": 21.5,
                         "args": {**base, **args}})

    def eager(self, pos: int, **changed: Any) -> dict[str, Any]:
        """The eager keys record_param_comms writes for call ``pos`` (``profiler_eager``)."""
        return {**self.record["profiler_eager"][pos], **changed, "Rank": self.record["rank"],
                "Global rank start": 0, "Global rank stride": 1}

    def _call(self, pos: int, meta: dict[str, Any]) -> None:
        t0, t1 = meta[md.T_BEGIN], meta[md.T_END]
        span = {k: v for k, v in meta.items() if k not in (md.T_BEGIN, md.T_END)}
        if self.c10d:
            assert meta[md.TID] == self.tid          # the job made its calls on one thread
            self.cpu(C10D_EVENTS[meta[md.OP]], "cpu_op", t0 - 300, t1 + 300,
                     {"External id": next(self.ids), "Record function id": 0})
        else:
            self.cpu("commviz::" + meta[md.OP], "cpu_op", t0 - 300, t1 + 300,
                     {"External id": next(self.ids), **(span if self.shapes else {})})
        corr, ext = next(self.ids), next(self.ids)
        launch_at = t0 + 200
        self.cpu("record_param_comms", "cpu_op", t0 + 150, t0 + 400,
                 {"External id": ext, **self.eager(pos)})
        carried = {k: v for k, v in self.eager(pos).items() if k not in PROFILER_ONLY}
        self.cpu("cuLaunchKernelEx", "cuda_driver", launch_at, launch_at + 80,
                 {"External id": ext, "cbid": 652, "correlation": corr})
        self.kernel_of[pos] = self.kernel(
            KERNELS[meta[md.OP]], launch_at + 4000, STREAMS[meta[md.PG_NAME]],
            {"External id": ext, "correlation": corr, **carried})

    def bare_sendrecv(self) -> int:
        """The kernel of a p2p batch as NCCL launches it at the batch's end: linked to no
        record_param_comms, it carries no metadata (seen on the H200s)."""
        t0 = max(c[md.T_END] for c in self.record["collectives"]) + 20_000
        corr = next(self.ids)
        self.cpu("cuLaunchKernelEx", "cuda_driver", t0, t0 + 80,
                 {"External id": next(self.ids), "cbid": 652, "correlation": corr})
        return self.kernel(KERNELS["send"], t0 + 4000, STREAMS["0"], {"correlation": corr})

    def unrecorded_allreduce(self, pg: str = "0") -> int:
        """A DDP-reducer style all_reduce: the profiler's metadata, no commviz call around it."""
        t0 = max(c[md.T_END] for c in self.record["collectives"]) + 50_000
        eager = self.eager(0, **{md.IN_NELEMS: 4096, md.OUT_NELEMS: 4096})
        ext, corr = next(self.ids), next(self.ids)
        self.cpu("record_param_comms", "cpu_op", t0, t0 + 300, {"External id": ext, **eager})
        self.cpu("cuLaunchKernelEx", "cuda_driver", t0 + 100, t0 + 180,
                 {"External id": ext, "cbid": 652, "correlation": corr})
        carried = {k: v for k, v in eager.items() if k not in PROFILER_ONLY}
        return self.kernel(KERNELS["all_reduce"], t0 + 5000, STREAMS[pg],
                           {"External id": ext, "correlation": corr, **carried})

    def bare_kernel(self) -> int:
        """An NCCL kernel no call owns and the profiler said nothing about."""
        t0 = max(c[md.T_END] for c in self.record["collectives"]) + 90_000
        corr = next(self.ids)
        self.cpu("cuLaunchKernelEx", "cuda_driver", t0, t0 + 80, {"cbid": 652, "correlation": corr})
        return self.kernel(KERNELS["all_reduce"], t0 + 3000, 7, {"correlation": corr})

    def graph_replay(self, tag: dict[str, Any] | None = None) -> list[int]:
        """One cudaGraphLaunch whose NCCL kernels share its correlation and carry nothing else;
        ``tag``: inside a ``commviz::graph_replay`` range with these args."""
        t0 = max(c[md.T_END] for c in self.record["collectives"]) + 200_000
        corr = next(self.ids)
        if tag is not None:
            self.cpu("commviz::graph_replay", "user_annotation", t0 - 1000, t0 + 12_000, tag)
        self.cpu("cudaGraphLaunch", "cuda_runtime", t0, t0 + 10_000,
                 {"External id": next(self.ids), "cbid": 311, "correlation": corr})
        return [self.kernel(name, t0 + 20_000 + 30_000 * i, 7, {"correlation": corr})
                for i, name in enumerate((KERNELS["all_reduce"], KERNELS["broadcast"]))]

    def marked_kernel(self, mark: str) -> int:
        """A GEMM launched inside a ``commviz::mark::<mark>`` range."""
        t0 = max(c[md.T_END] for c in self.record["collectives"]) + 600_000
        corr = next(self.ids)
        self.cpu("commviz::mark::" + mark, "user_annotation", t0, t0 + 5000, {})
        self.cpu("cudaLaunchKernel", "cuda_runtime", t0 + 1000, t0 + 1500,
                 {"cbid": 211, "correlation": corr})
        return self.add({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_tn",
                         "pid": 0, "tid": 7, "ts": self.ts(t0 + 8000), "dur": 40.0,
                         "args": {"stream": 7, "correlation": corr, "device": 0}})

    def node_id_kernel(self) -> int:
        """A torch >= 2.12 graphed kernel: known by its "graph node id", no launch in sight."""
        t0 = max(c[md.T_END] for c in self.record["collectives"]) + 400_000
        return self.kernel(KERNELS["all_reduce"], t0, 7,
                           {"correlation": next(self.ids), "graph node id": (2 << 32) | 5})

    def write(self, path: Path) -> Path:
        groups = {c[md.PG_NAME]: c for c in self.record["collectives"]}
        doc = {
            "schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
            "distributedInfo": {
                "backend": "nccl", "rank": self.record["rank"], "world_size": WORLD,
                "pg_count": len(groups), "nccl_version": "2.28.9",
                "pg_config": [{"pg_name": pg, "pg_desc": c[md.PG_DESC],
                               "backend_config": "cuda:nccl", "pg_size": c[md.GROUP_SIZE],
                               "ranks": c[md.PG_RANKS]} for pg, c in groups.items()]},
            "baseTimeNanoseconds": self.base,
            "traceEvents": self.events}
        with gzip.open(path, "wt") as f:
            json.dump(doc, f)
        return path


def _trace(tmp_path: Path, builder: GpuTrace) -> Any:
    rank = builder.record["rank"]
    return load_trace(builder.write(tmp_path / f"trace_rank{rank}.json.gz"))


@pytest.mark.parametrize("shapes,c10d", [(True, True), (True, False), (False, False)],
                         ids=["c10d_events", "record_shapes", "no_shapes"])
def test_eager_kernels_keep_profiler_values_and_gain_commviz_keys(
        records, tmp_path, shapes, c10d) -> None:
    keys: dict[tuple, set[int]] = {}
    for record in records:
        rank = record["rank"]
        builder = GpuTrace(record, shapes=shapes, c10d=c10d)
        trace = _trace(tmp_path, builder)
        before = copy.deepcopy(trace.events)
        m = match_rank(trace, record, rank=rank)
        assert trace.events == before, "matching must not change the trace"
        calls = record["collectives"]
        assert not m.unmatched and not m.conflicts
        assert len(m.events) == len(calls) == m.stats["eager_matched"]
        assert m.stats.get("eager_filled", 0) == 0     # every kernel carries its metadata
        for ev in m.events:
            pos = ev.extra["record_index"]
            meta, k = calls[pos], builder.kernel_of[pos]
            kernel = trace.events[k]
            assert ev.extra["trace_index"] == k and ev.source == "kernel"
            assert ev.stream == STREAMS[meta[md.PG_NAME]] and not ev.graphed
            assert (ev.start_ns, ev.end_ns) == (trace.ns(kernel["ts"]),
                                                trace.ns(kernel["ts"] + kernel["dur"]))
            assert ev.args == meta and ev.key == instance_key(meta) is not None
            added = m.kernel_args[k]
            own = kernel["args"]
            assert not set(added) & set(own), "a profiler value was overwritten"
            assert {**own, **added}.items() >= {k: v for k, v in meta.items()
                                                if v is not None}.items()
            if meta[md.OP] == "batch_isend_irecv":
                assert set(md.EAGER_KEYS) <= set(added)          # filled from the record
            else:
                assert not set(md.EAGER_KEYS) & set(added)       # kept the profiler's
            keys.setdefault(ev.key, set()).add(rank)
        stat = "ranges_by_op" if c10d else "ranges_by_identity" if shapes else "ranges_by_time"
        assert m.stats[stat] == len(calls)
    assert all(ranks == set(range(WORLD)) for ranks in keys.values()), keys


def test_profiler_record_disagreement_is_reported_not_overwritten(records, tmp_path) -> None:
    record = records[0]
    trace = _trace(tmp_path, GpuTrace(record))
    wrong = copy.deepcopy(record)
    victim = next(c for c in wrong["collectives"] if c[md.OP] == "broadcast")
    victim[md.DTYPE] = "Half"
    m = match_rank(trace, wrong, rank=0)
    (conflict,) = m.conflicts
    assert (conflict.key, conflict.profiler, conflict.record) == (md.DTYPE, "Float", "Half")
    assert md.DTYPE not in m.kernel_args[conflict.index]
    ev = next(e for e in m.events if e.op == "broadcast")
    assert ev.args[md.DTYPE] == "Float" and m.stats["conflicts"] == 1


def test_truncated_rank_lists_and_wire_dtypes_agree(records, tmp_path) -> None:
    record = copy.deepcopy(records[0])
    builder = GpuTrace(record)
    pos = next(i for i, c in enumerate(record["collectives"]) if c[md.OP] == "broadcast")
    # what the profiler writes for a group past 30 ranks, here shortened to the same shape
    builder.events[builder.kernel_of[pos]]["args"][md.PG_RANKS] = "[0, ..., 1]"
    m = match_rank(_trace(tmp_path, builder), record, rank=0)
    assert not m.conflicts and not m.unmatched
    ev = next(e for e in m.events if e.extra["record_index"] == pos)
    assert ev.args[md.PG_RANKS] == record["collectives"][pos][md.PG_RANKS] == "[0, 1]"
    # a bool all_reduce runs as a u8 kernel; a float one cannot
    call = {md.COLLECTIVE_NAME: "allreduce", md.DTYPE: "Bool", md.REDUCE_OP: "max"}
    assert incompatibility(parse_nccl("ncclDevKernel_AllReduce_Max_u8_RING_LL"), call) is None
    assert "dtype" in incompatibility(parse_nccl("ncclKernel_AllReduce_RING_LL_Max_float"), call)
    # NCCL 2.28 runs max in its sum-named kernel (seen on the H200s); a max kernel can't sum
    assert incompatibility(parse_nccl("ncclDevKernel_AllReduce_Sum_u8_RING_LL"), call) is None
    assert "kernel reduction max" in incompatibility(
        parse_nccl("ncclDevKernel_AllReduce_Max_u8_RING_LL"), dict(call, **{md.REDUCE_OP: "sum"}))


def test_a_kernel_whose_name_contradicts_its_call_is_not_labelled(records, tmp_path) -> None:
    record = copy.deepcopy(records[1])
    builder = GpuTrace(record)
    pos = next(i for i, c in enumerate(record["collectives"]) if c[md.OP] == "broadcast")
    k = builder.kernel_of[pos]
    builder.events[k]["name"] = KERNELS["reduce_scatter_tensor"] + ARGS_STORAGE
    m = match_rank(_trace(tmp_path, builder), record, rank=1)
    (miss,) = m.unmatched
    assert miss.index == k and "ReduceScatter kernel cannot carry out 'broadcast'" in miss.reason
    assert k not in m.kernel_args
    ev = next(e for e in m.events if e.extra["record_index"] == pos)
    assert ev.source == "cpu"       # still one event per call: its CPU range


def test_unrecorded_bare_and_graphed_kernels(records, tmp_path) -> None:
    keys: dict[tuple, set[int]] = {}
    for record in records:
        rank = record["rank"]
        builder = GpuTrace(record)
        for k in builder.kernel_of.values():          # torch >= 2.12 writes 0 for eager kernels
            builder.events[k]["args"]["graph node id"] = 0
        ddp = builder.unrecorded_allreduce()
        bare = builder.bare_kernel()
        graphed = [*builder.graph_replay(), builder.node_id_kernel()]
        m = match_rank(_trace(tmp_path, builder), record, rank=rank)
        assert m.stats["graphed_kernels"] == 3 and m.stats["eager_kernels"] == len(
            record["collectives"]) + 2
        reasons = {u.index: u.reason for u in m.unmatched}
        assert set(reasons) == {bare, *graphed}
        assert "no collective metadata" in reasons[bare]
        assert not {bare, *graphed} & set(m.kernel_args)
        (derived,) = [e for e in m.events if e.extra["trace_index"] == ddp]
        assert derived.source == "kernel" and derived.op == "all_reduce"
        assert derived.args[md.IN_NELEMS] == 4096 and derived.args[md.BYTES_IN] == 4096 * 4
        assert derived.args[md.REDUCE_OP] == "sum" and derived.args[md.RANK] == rank
        assert md.SEQ not in derived.args          # its place in the group, not commviz's seq
        keys.setdefault(derived.key, set()).add(rank)
        assert len(m.events) == len(record["collectives"]) + 1
    assert {key.wire(): held for key, held in keys.items()} == {("nccl", "0", 1): {0, 1}}


def test_a_call_missing_from_the_record_falls_back_to_the_profiler(records, tmp_path) -> None:
    builder = GpuTrace(records[1])
    record = copy.deepcopy(records[1])
    pos = next(i for i, c in enumerate(record["collectives"]) if c[md.OP] == "broadcast")
    del record["collectives"][pos]          # as if the ring buffer had dropped it
    m = match_rank(_trace(tmp_path, builder), record, rank=1)
    (miss,) = m.unmatched
    assert builder.events[miss.index]["name"] == "commviz::broadcast"
    assert "no record entry" in miss.reason
    (derived,) = [e for e in m.events if e.extra["trace_index"] == builder.kernel_of[pos]]
    assert derived.key.wire() == ("nccl", "0", 1) and derived.op == "broadcast"
    assert len(m.events) == len(record["collectives"]) + 1


def test_graphed_kernels_and_marks_go_to_the_graph_matcher(records, tmp_path) -> None:
    record = records[0]
    builder = GpuTrace(record)
    graphed = [*builder.graph_replay(tag={"commviz.graph": 99, "commviz.replay": 1}),
               builder.node_id_kernel()]
    gemm = builder.marked_kernel("forward")
    m = match_rank(_trace(tmp_path, builder), record, rank=0)
    assert m.stats["graphed_kernels"] == 3
    # the record captured no graph: every graphed kernel is reported once, by the graph matcher
    assert sorted(u.index for u in m.unmatched) == sorted(graphed)
    assert all(u.reason != "graph matcher unavailable" for u in m.unmatched)
    assert not set(graphed) & set(m.kernel_args)
    # replay tags and mark regions are not calls; the mark labels its kernel
    assert m.stats["ranges"] == len(record["collectives"]) == m.stats["eager_matched"]
    assert m.marks[gemm]["commviz.mark"] == "forward"


def test_joins_without_launches_or_without_ranges(records, tmp_path) -> None:
    record = records[0]
    calls = record["collectives"]
    builder = GpuTrace(record, shapes=False)
    sendrecv = builder.events[builder.bare_sendrecv()]
    launches = [e for e in builder.events if e["cat"] == "cuda_driver"]
    # runtime activity off: kernels reach their call through record_param_comms' External id
    builder.events = [e for e in builder.events if e["cat"] != "cuda_driver"]
    m = match_rank(_trace(tmp_path, builder), record, rank=0)
    (miss,) = m.unmatched                       # linked to no record_param_comms
    assert builder.events[miss.index] is sendrecv
    assert sum(e.source == "kernel" for e in m.events) == len(calls)
    # no commviz ranges at all: each launch falls inside exactly one recorded call's time
    builder.events = [e for e in builder.events if not e["name"].startswith("commviz::")]
    builder.events += launches
    m = match_rank(_trace(tmp_path, builder), record, rank=0)
    assert [builder.events[u.index] for u in m.unmatched] == [sendrecv]   # outside every call
    assert m.stats["joined_by_call_time"] == len(calls)
    assert all(e.source == "kernel" for e in m.events) and len(m.events) == len(calls)


def test_plain_profiler_traces_without_records(records, tmp_path) -> None:
    keys: dict[tuple, dict[int, str]] = {}
    for record in records:
        rank = record["rank"]
        builder = GpuTrace(record)
        if rank == 1:       # left out: distributedInfo's process group table fills them in
            for k in builder.kernel_of.values():
                builder.events[k]["args"].pop(md.PG_RANKS, None)
                builder.events[k]["args"].pop(md.PG_DESC, None)
        sendrecv = builder.bare_sendrecv()
        m = match_rank(_trace(tmp_path, builder), None, rank=rank)
        calls = record["collectives"]
        (miss,) = m.unmatched
        assert miss.index == sendrecv and "no commviz record" in miss.reason
        assert len(m.events) == len(calls) == m.stats["derived_from_profiler"]
        for ev in m.events:
            meta = calls[next(p for p, k in builder.kernel_of.items()
                              if k == ev.extra["trace_index"])]
            assert {k: ev.args[k] for k in md.EAGER_KEYS} == {k: meta[k] for k in md.EAGER_KEYS}
            assert ev.args[md.PG_RANKS] == "[0, 1]" and ev.args[md.LANE] == meta[md.LANE]
            if meta[md.KIND] == "p2p":      # the profiler names no peer: no instance to join
                assert ev.key is None
                continue
            assert (ev.key.kind, ev.key.pg) == ("nccl", meta[md.PG_NAME])
            keys.setdefault(ev.key, {})[rank] = ev.args[md.COLLECTIVE_NAME]
    assert keys and all(len(v) == WORLD and len(set(v.values())) == 1 for v in keys.values())
