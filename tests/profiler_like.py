"""Traces shaped as torch.profiler writes them, and the commviz records beside them, at any
size: the inputs of the tests that measure how the after-the-job work grows.

Free of commviz imports: each event is shaped as in the recorded fixtures (2 x H200, torch
2.11: ``tests/fixtures/gpu/graphed`` for graph replays, ``gpipe-2xh200`` for coalesced p2p),
each record entry as the recorder writes it there.

- ``write_graph_replays``: per profiler step, on one CPU thread, a ``ProfilerStep#N`` range
  holding nested CPU ops, an input copy (``cudaMemcpyAsync`` and its ``gpu_memcpy``), one
  ``cudaGraphLaunch`` (cbid 311) whose ``correlation`` every kernel of the replay carries, all
  on one stream, and a ``cudaStreamSynchronize``. Launch flows are Kineto's ``ac2g``: one
  ``s`` at the launch call and one ``f`` (``"bp": "e"``) at each piece of GPU work, ``id``
  the correlation. ``graph_record`` is the record of a job that captured that graph.
- ``write_p2p_groups``: a pipeline stage's ``batch_isend_irecv`` groups (send to rank 1,
  receive from it): the calls' ``commviz::send`` / ``commviz::recv`` ranges, ProcessGroupNCCL's
  ``nccl:coalesced``, then the group's one ``ncclDevKernel_SendRecv`` (``cuLaunchKernelEx``).
- ``write_any_source_recvs``: gloo receives from any source (``dist.recv(t)`` without
  ``src``): their ranges and record entries share op, group and (absent) sequence numbers.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

BASE_NS = 1_790_857_026_000_000_000
T0_US = 4_466_504_272_551.523
PID, TID, DEVICE, STREAM, P2P_STREAM = 763, 763, 0, 7, 17
GRAPH_LAUNCH_CBID, MEMCPY_CBID, SYNC_CBID, LAUNCH_EX_CBID = 311, 41, 131, 652
NCCL_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
KERNELS = (       # what a graphed transformer layer runs, in order
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::"
    "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}"
    "::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native"
    "::GeluCUDAKernelImpl, std::array<char*, 2ul>)",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
    "(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, "
    "float*, c10::BFloat16*)",
    NCCL_ALL_REDUCE,
)
GRID, BLOCK = [2, 1, 1], [512, 1, 1]
CPU_OPS = ("aten::to", "aten::_to_copy", "aten::copy_")      # one nested chain
PG0 = {"Group size": 2, "Process Group Name": "0", "Process Group Description": "default_pg",
       "Process Group Ranks": "[0, 1]", "commviz.rank": 0,
       "commviz.lane": 1050209}        # commviz.metadata.lane_id("0"), as the records hold it


class Launch(NamedTuple):
    correlation: int
    ts: float             # the runtime call's start, µs
    dur: float


@dataclass
class _Writer:
    events: list[dict[str, Any]] = field(default_factory=list)
    ts: float = T0_US + 100.0
    gpu_free: float = 0.0
    corr: int = 1
    ext: int = 1

    def cpu(self, name: str, ts: float, dur: float, cat: str = "cpu_op",
            args: dict[str, Any] | None = None) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": TID,
                            "ts": round(ts, 3), "dur": round(dur, 3),
                            "args": {"External id": self.ext, "Record function id": 0,
                                     **(args or {})}})
        self.ext += 1

    def launch(self, name: str, cbid: int, work: list[tuple[str, str, float]],
               cat: str = "cuda_runtime", stream: int = STREAM) -> Launch:
        """A launch call now, and the GPU work (cat, name, duration) it launched."""
        corr = self.corr
        self.corr += 1
        call = Launch(corr, round(self.ts, 3), 6.0)
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": TID,
                            "ts": call.ts, "dur": call.dur,
                            "args": {"External id": self.ext, "cbid": cbid,
                                     "correlation": corr}})
        if work:
            self.events.append({"ph": "s", "id": corr, "pid": PID, "tid": TID, "ts": call.ts,
                                "cat": "ac2g", "name": "ac2g"})
        start = max(self.gpu_free, self.ts + 20.0)
        for kind, kernel, dur in work:
            args: dict[str, Any] = {"External id": self.ext, "queued": 0, "device": DEVICE,
                                    "context": 1, "stream": stream, "correlation": corr}
            if kind == "kernel":
                args.update({"registers per thread": 96, "shared memory": 103808,
                             "blocks per SM": 0.015152, "warps per SM": 0.242424,
                             "grid": GRID, "block": BLOCK, "est. achieved occupancy %": 0})
            self.events.append({"ph": "X", "cat": kind, "name": kernel, "pid": DEVICE,
                                "tid": stream, "ts": round(start, 3), "dur": dur,
                                "args": args})
            self.events.append({"ph": "f", "id": corr, "pid": DEVICE, "tid": stream,
                                "ts": round(start, 3), "cat": "ac2g", "name": "ac2g",
                                "bp": "e"})
            start += dur + 1.024
        self.gpu_free = start
        self.ts += 8.0
        return call

    def step(self, number: int, kernels: int, cpu_chains: int) -> Launch:
        """One profiler step replaying the graph; returns its graph launch."""
        begin = self.ts
        self.ts += 2.0
        for _ in range(cpu_chains):
            for depth, name in enumerate(CPU_OPS):
                self.cpu(name, self.ts + depth, 9.0 - 2 * depth)
            self.ts += 10.0
        self.launch("cudaMemcpyAsync", MEMCPY_CBID,
                    [("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1.152)])
        graph = self.launch("cudaGraphLaunch", GRAPH_LAUNCH_CBID,
                            [("kernel", KERNELS[k % len(KERNELS)], 4.064 + k % 3)
                             for k in range(kernels)])
        self.ts = max(self.ts, self.gpu_free)
        self.launch("cudaStreamSynchronize", SYNC_CBID, [])
        self.cpu(f"ProfilerStep#{number}", begin, self.ts - begin + 1.0, "user_annotation")
        self.ts += 5.0
        return graph

    def save(self, path: Path) -> None:
        meta = [("process_name", PID, 0, {"name": "python3"}),
                ("process_labels", PID, 0, {"labels": "CPU"}),
                ("thread_name", PID, TID, {"name": f"thread {TID} (python3)"}),
                ("process_name", DEVICE, 0, {"name": "python3"}),
                ("process_labels", DEVICE, 0, {"labels": f"GPU {DEVICE}"}),
                *(("thread_name", DEVICE, s, {"name": f"stream {s} "})
                  for s in (STREAM, P2P_STREAM))]
        events = [{"name": name, "ph": "M", "ts": T0_US, "pid": pid, "tid": tid, "args": args}
                  for name, pid, tid, args in meta] + self.events + [
            {"ph": "X", "cat": "Trace", "ts": T0_US, "dur": round(self.ts - T0_US, 3),
             "pid": "Spans", "tid": "PyTorch Profiler", "name": "PyTorch Profiler (0)",
             "args": {"Op count": 0}}]
        doc = {"schemaVersion": 1, "deviceProperties": [{"id": DEVICE, "name": "NVIDIA H200"}],
               "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS, "traceEvents": events,
               "traceName": path.name}
        path.write_bytes(gzip.compress(orjson.dumps(doc), compresslevel=1))


def wall_ns(ts_us: float) -> int:
    """A trace time (µs after ``baseTimeNanoseconds``) as the recorder's wall clock reads it."""
    return BASE_NS + round(ts_us * 1000)


def write_graph_replays(path: Path, *, kernels: int, replays: int,
                        cpu_chains: int = 4) -> list[Launch]:
    """One rank's trace of ``replays`` steps, each replaying a graph of ``kernels`` kernels on
    one stream (``cpu_chains`` nested CPU op chains before each); returns the graph launches."""
    w = _Writer()
    launches = [w.step(n, kernels, cpu_chains) for n in range(replays)]
    w.save(path)
    return launches


def graph_record(kernels: int, launches: list[Launch], keys: dict[str, str]) -> dict[str, Any]:
    """The record of the job that captured the graph (graph 1: one node per kernel, each after
    the one before, as a capture on one stream makes them) and replayed it at ``launches``
    (each replay's window around its launch). Its every ``NCCL_ALL_REDUCE`` node is an
    ``all_reduce`` on group 0 (ordinal 1, 2, ...). ``keys``: kernel name -> the capture's key
    for it (``commviz.capture.names.kernel_key``)."""
    nodes, collectives = [], []
    for i in range(kernels):
        name = KERNELS[i % len(KERNELS)]
        ordinal = len(collectives) + 1 if name == NCCL_ALL_REDUCE else None
        nodes.append({"index": i, "node": None, "local": i, "tools": None, "kernel": keys[name],
                      "dims": GRID + BLOCK, "after": [i - 1] if i else [],
                      "lane": PG0["commviz.lane"], "ordinal": ordinal,
                      "op": "all_reduce" if ordinal else None, "marks": [], "mark_lane": None})
        if ordinal:
            collectives.append({
                "Collective name": "allreduce", "In msg nelems": 4096, "Out msg nelems": 4096,
                "dtype": "BFloat16", "In split size": "[]", "Out split size": "[]", **PG0,
                "commviz.op": "all_reduce", "commviz.kind": "collective",
                "commviz.async_op": False, "commviz.bytes_in": 8192, "commviz.bytes_out": 8192,
                "commviz.callsite": "train.py:88", "commviz.device": "cuda",
                "commviz.seq": ordinal, "commviz.reduce_op": "sum", "commviz.captured": True,
                "commviz.graph": 1, "commviz.ordinal": ordinal,
                "commviz.t_begin_ns": BASE_NS + ordinal, "commviz.t_end_ns": BASE_NS + ordinal})
    names: dict[str, int] = {}
    for n in nodes:
        names[n["kernel"]] = names.get(n["kernel"], 0) + 1
    return {"rank": 0, "world_size": 2, "collectives": collectives,
            "graphs": [{"graph": 1, "capture_id": 1, "exec_ids": [2], "complete": True,
                        "kernel_count": kernels, "kernel_names": names, "nodes": nodes}],
            "replays": [{"graph": 1, "replay": n + 1, "t_begin_ns": wall_ns(call.ts) - 1000,
                         "t_end_ns": wall_ns(call.ts + call.dur) + 1000, "tid": TID}
                        for n, call in enumerate(launches)]}


def _p2p(op: str, seq: int, t_begin: int, t_end: int) -> dict[str, Any]:
    src, dst = (0, 1) if op == "send" else (1, 0)
    return {"Collective name": op, "In msg nelems": 2048, "Out msg nelems": 2048,
            "dtype": "Float", "In split size": "[]", "Out split size": "[]", **PG0,
            "commviz.op": op, "commviz.kind": "p2p", "commviz.async_op": True,
            "commviz.bytes_in": 8192, "commviz.bytes_out": 8192, "commviz.callsite": "pp.py:43",
            "commviz.device": "cuda", "commviz.peer": 1, "commviz.src": src,
            "commviz.dst": dst, "commviz.p2p_seq": seq, "commviz.t_begin_ns": t_begin,
            "commviz.t_end_ns": t_end}


def _call(w: _Writer, meta: dict[str, Any], dur: float) -> dict[str, Any]:
    """A recorded call's range now (its args: the metadata, times aside); its record entry."""
    start = w.ts
    entry = {**meta, "commviz.t_begin_ns": wall_ns(start) + 500,
             "commviz.t_end_ns": wall_ns(start + dur) - 500}
    w.cpu(f"commviz::{meta['commviz.op']}", start, dur, args={
        k: v for k, v in meta.items() if not k.startswith("commviz.t_")})
    w.ts += dur + 4.0
    return entry


def write_p2p_groups(path: Path, *, groups: int) -> tuple[list[dict[str, Any]], list[int]]:
    """A stage's ``groups`` coalesced send/recv pairs; returns the record's collectives and
    the SendRecv kernels' correlations, in group order."""
    w = _Writer()
    collectives, launches = [], []
    for g in range(1, groups + 1):
        collectives.append(_call(w, _p2p("send", g, 0, 0), 20.0))
        collectives.append(_call(w, _p2p("recv", g, 0, 0), 20.0))
        w.cpu("nccl:coalesced", w.ts, 30.0, "user_annotation")
        w.ts += 3.0
        launches.append(w.launch("cuLaunchKernelEx", LAUNCH_EX_CBID,
                                 [("kernel", SENDRECV, 15.0)], "cuda_driver",
                                 P2P_STREAM).correlation)
        w.ts += 40.0
    w.save(path)
    return collectives, launches


def write_any_source_recvs(path: Path, *, calls: int) -> list[dict[str, Any]]:
    """A gloo rank's ``calls`` receives from any source; returns their record entries."""
    w = _Writer()
    meta = {"Collective name": "recv", "In msg nelems": 16, "Out msg nelems": 16,
            "dtype": "Float", "In split size": "[]", "Out split size": "[]", **PG0,
            "commviz.op": "recv", "commviz.kind": "p2p", "commviz.async_op": True,
            "commviz.bytes_in": 64, "commviz.bytes_out": 64, "commviz.callsite": "ps.py:12",
            "commviz.device": "cpu", "commviz.dst": 0}
    entries = []
    for _ in range(calls):
        w.cpu("aten::empty", w.ts, 2.0)
        w.ts += 3.0
        entries.append(_call(w, meta, 25.0))
    w.save(path)
    return entries
