"""Generate realistic per-rank torch.profiler (Kineto) Chrome JSON traces for benchmarks.

Deliberately free of commviz imports: the benchmark measures commviz against inputs shaped the
way the profiler writes them, not the way commviz would like them. One rank's trace holds what a
tensor+data parallel training step on GPUs produces under ``torch.profiler`` with
``record_shapes=True``:

- CPU ops nested several levels deep on two threads (forward on the main thread, backward on the
  autograd thread), ``ProfilerStep#N`` ranges, ``cuda_runtime`` launches with ``ac2g`` flows to
  their kernels (matched by ``correlation``), memcpys;
- kernels on a compute stream, a side stream that overlaps it, and occasional overlapping
  kernels on one stream (programmatic dependent launch does this in real traces);
- NCCL kernels on one stream per process group (tp, dp, default) with the eager collective
  metadata and ``record_param_comms`` CPU ops, ``ncclDevKernel_SendRecv`` kernels without any
  metadata (as ``batch_isend_irecv`` leaves them); collectives end together on every member rank;
- ``distributedInfo``, ``deviceProperties``, ``baseTimeNanoseconds`` with timestamps relative to it.

All ranks are generated in lockstep (so a collective ends at the same time on every member) and
streamed to disk event by event, so memory stays small at any size.

    python scripts/gen_traces.py OUT_DIR --ranks 8 --events 200000
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

BASE_NS = 1_790_857_026_000_000_000      # Kineto rounds its base down to a whole second
T0_US = 4_456_381_101_432.016            # first timestamp, relative to BASE_NS (like a real trace)
COMPUTE, SIDE = 7, 13                    # CUDA stream ids of compute and side work
GEMM = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
        "execute_segment_k_off_kernel__5x_cublas")
GELU = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
        "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::"
        "{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul> >(int, at::native::GeluCUDAKernelImpl, std::array<char*, 2ul>)")
ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
        "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
        "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, float*, double, "
        "double, double, double, double, bool, float*, float*>")
NORM = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
        "float>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, "
        "float*, float*, c10::BFloat16*)")
NCCL_NEW = {
    "allreduce": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "_reduce_scatter_base":
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "_allgather_base": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "barrier": "ncclDevKernel_AllReduce_Sum_u8_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "send/recv": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
}
NCCL_OLD = {
    "allreduce": "ncclKernel_AllReduce_RING_LL_Sum_bf16(ncclDevComm*, unsigned long, ncclWork*)",
    "_reduce_scatter_base":
        "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
    "_allgather_base": "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, "
                       "ncclWork*)",
    "barrier": "ncclKernel_AllReduce_RING_LL_Sum_uint8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "send/recv": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, "
                 "ncclWork*)",
}
DTYPE_BYTES = {"BFloat16": 2, "Float": 4, "Byte": 1}


@dataclass(frozen=True)
class Group:
    """A process group as torch.distributed names it."""

    name: str          # "Process Group Name": creation order, as a string
    desc: str          # "Process Group Description"
    ranks: tuple[int, ...]
    stream: int        # the CUDA stream its NCCL kernels run on (one per communicator)

    @property
    def ranks_str(self) -> str:
        return "[" + ", ".join(map(str, self.ranks)) + "]"


def process_groups(world: int, tp: int = 2) -> list[Group]:
    """default_pg, then tp groups of ``tp`` consecutive ranks, then strided dp groups."""
    tp = max(1, min(tp, world))
    groups = [Group("0", "default_pg", tuple(range(world)), 23)]
    for i in range(0, world, tp):
        groups.append(Group(str(len(groups)), "tp", tuple(range(i, min(i + tp, world))), 27))
    for j in range(tp):
        groups.append(Group(str(len(groups)), "dp", tuple(range(j, world, tp)), 31))
    return groups


def _r3(x: float) -> float:
    return round(x, 3)


@dataclass
class _Rank:
    """One rank's clocks, counters and output stream."""

    rank: int
    world: int
    groups: list[Group]
    out: BinaryIO
    rng: random.Random
    pid: int = 0
    tid_main: int = 0
    tid_bwd: int = 0
    device: int = 0
    cpu: dict[int, float] = field(default_factory=dict)          # thread -> CPU cursor (us)
    stream_free: dict[int, float] = field(default_factory=dict)  # stream -> busy until (us)
    corr: int = 1
    ext: int = 1
    ev_idx: int = 0
    count: int = 0
    buf: list[bytes] = field(default_factory=list)

    def group(self, desc: str) -> Group:
        return next(g for g in self.groups if g.desc == desc and self.rank in g.ranks)

    def emit(self, ev: dict[str, Any]) -> None:
        self.buf.append(orjson.dumps(ev))
        self.count += 1
        if len(self.buf) >= 4096:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.out.write(b",\n".join(self.buf) + b",\n")
            self.buf.clear()

    def cpu_op(self, name: str, tid: int, ts: float, dur: float, cat: str = "cpu_op",
               args: dict[str, Any] | None = None) -> int:
        ext = self.ext
        self.ext += 1
        a: dict[str, Any] = {"External id": ext, "Record function id": 0, "Ev Idx": self.ev_idx}
        self.ev_idx += 1
        if args:
            a.update(args)
        self.emit({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": tid,
                   "ts": _r3(ts), "dur": _r3(dur), "args": a})
        return ext

    def launch(self, kernel: str, tid: int, ts: float, gpu_dur: float, stream: int, ext: int,
               *, after: float = 0.0, overlap: float = 0.0, cat: str = "kernel",
               runtime: str = "cudaLaunchKernel", cbid: int = 211,
               kargs: dict[str, Any] | None = None,
               span: tuple[float, float] | None = None) -> tuple[float, float]:
        """A runtime launch at CPU time ``ts`` and its GPU work; returns the work's (start, end).

        ``after``: a cross-stream dependency; ``overlap``: start this long before the stream's
        previous work ends (the overlapping kernels real traces show); ``span``: a fixed
        (start, end) (collectives finish together on every member).
        """
        corr = self.corr
        self.corr += 1
        rt_dur = 3.0 + self.rng.random() * 4.0
        self.emit({"ph": "X", "cat": "cuda_runtime", "name": runtime, "pid": self.pid,
                   "tid": tid, "ts": _r3(ts), "dur": _r3(rt_dur),
                   "args": {"External id": ext, "cbid": cbid, "correlation": corr}})
        if span is None:
            free = self.stream_free.get(stream, 0.0)
            start = max(ts + 4.0 + self.rng.random() * 2.0,
                        free - overlap if overlap else free + 1.5, after)
            span = (start, start + gpu_dur)
        start, end = span
        self.stream_free[stream] = end
        args: dict[str, Any] = {"External id": ext, "queued": 0, "device": self.device,
                                "context": 1, "stream": stream, "correlation": corr}
        if cat == "kernel":
            args.update({"registers per thread": 128, "shared memory": 49152,
                         "blocks per SM": 1.2, "warps per SM": 9.6, "grid": [132, 1, 1],
                         "block": [384, 1, 1], "est. achieved occupancy %": 12})
        if kargs:
            args.update(kargs)
        self.emit({"ph": "X", "cat": cat, "name": kernel, "pid": self.device, "tid": stream,
                   "ts": _r3(start), "dur": _r3(end - start), "args": args})
        self.emit({"ph": "s", "id": corr, "pid": self.pid, "tid": tid, "ts": _r3(ts),
                   "cat": "ac2g", "name": "ac2g"})
        self.emit({"ph": "f", "id": corr, "pid": self.device, "tid": stream, "ts": _r3(start),
                   "cat": "ac2g", "name": "ac2g", "bp": "e"})
        return start, end


def _shapes(n: int, dims: list[list[int]]) -> dict[str, Any]:
    return {"Input Dims": dims + [[]] * (n - len(dims)),
            "Input type": ["c10::BFloat16"] * len(dims) + [""] * (n - len(dims)),
            "Input Strides": ([[d[-1], 1] if len(d) == 2 else [] for d in dims]
                              + [[]] * (n - len(dims))),
            "Concrete Inputs": [""] * n}


def _linear(r: _Rank, tid: int, h: int) -> None:
    """aten::linear > (aten::t > aten::transpose > aten::as_strided, aten::addmm > launch)."""
    start = t = r.cpu[tid]
    t += 2.0
    r.cpu_op("aten::t", tid, t, 9.0, args=_shapes(1, [[h, h]]))
    r.cpu_op("aten::transpose", tid, t + 2.0, 6.0, args=_shapes(3, [[h, h]]))
    r.cpu_op("aten::as_strided", tid, t + 4.0, 2.5, args=_shapes(4, [[h, h]]))
    t += 11.0
    ext = r.cpu_op("aten::addmm", tid, t, 24.0, args=_shapes(5, [[h], [4096, h], [h, h]]))
    r.launch(GEMM, tid, t + 12.0, 40.0 + r.rng.random() * 80.0, COMPUTE, ext)
    t += 26.0
    r.cpu_op("aten::linear", tid, start, t - start, args=_shapes(3, [[4096, h], [h, h], [h]]))
    r.cpu[tid] = t + 2.0


def _elementwise(r: _Rank, tid: int, name: str, kernel: str, stream: int = COMPUTE,
                 overlap: float = 0.0) -> None:
    t = r.cpu[tid]
    ext = r.cpu_op(name, tid, t, 14.0, args=_shapes(2, [[4096, 1024]]))
    r.launch(kernel, tid, t + 6.0, 5.0 + r.rng.random() * 10.0, stream, ext, overlap=overlap)
    r.cpu[tid] = t + 16.0


def _comm_meta(g: Group, coll: str, nelems_in: int, nelems_out: int, dtype: str
               ) -> dict[str, Any]:
    return {"Collective name": coll, "In msg nelems": nelems_in, "Out msg nelems": nelems_out,
            "Group size": len(g.ranks), "dtype": dtype, "In split size": "[]",
            "Out split size": "[]", "Process Group Name": g.name,
            "Process Group Description": g.desc, "Process Group Ranks": g.ranks_str}


def _collective(ranks: list[_Rank], desc: str, coll: str, nelems: int, dtype: str,
                tid_of: str, names: dict[str, str], *, blocking: bool,
                with_metadata: bool = True) -> None:
    """One collective issued by every rank on its ``desc`` group; kernels end together per group."""
    starts: dict[int, tuple[_Rank, float, float, int, dict[str, Any], int]] = {}
    for r in ranks:
        g = r.group(desc)
        tid = getattr(r, tid_of)
        t = r.cpu[tid]
        size = len(g.ranks)
        n_in, n_out = {"_allgather_base": (nelems // size, nelems),
                       "_reduce_scatter_base": (nelems, nelems // size)}.get(coll, (nelems, nelems))
        meta = _comm_meta(g, coll, n_in, n_out, dtype)
        op = {"allreduce": "c10d::allreduce_", "_allgather_base": "c10d::_allgather_base_",
              "_reduce_scatter_base": "c10d::_reduce_scatter_base_", "barrier": "c10d::barrier",
              "send/recv": "c10d::send"}[coll]
        r.cpu_op(op, tid, t, 60.0, args=_shapes(6, [[nelems]]))
        rpc_args = dict(meta, **{"Rank": r.rank, "Global rank start": g.ranks[0],
                                  "Global rank stride": (g.ranks[1] - g.ranks[0]
                                                         if size > 1 else 1)})
        ext = r.cpu_op("record_param_comms", tid, t + 4.0, 50.0,
                       args=rpc_args if with_metadata else None)
        r.cpu_op(f"nccl:{coll.strip('_').replace('_base', '')}", tid, t + 8.0, 40.0,
                 cat="user_annotation")
        free = max(r.stream_free.get(g.stream, 0.0), r.stream_free.get(COMPUTE, 0.0))
        launch_ts = t + 20.0
        starts[r.rank] = (r, max(launch_ts + 5.0, free + 1.5), launch_ts, ext, meta, tid)
        r.cpu[tid] = t + 62.0
    by_group: dict[tuple[int, ...], list[int]] = {}
    for r in ranks:
        by_group.setdefault(r.group(desc).ranks, []).append(r.rank)
    nbytes = nelems * DTYPE_BYTES[dtype]
    for members in by_group.values():
        last = max(starts[m][1] for m in members)
        end = last + 8.0 + nbytes / 150_000.0          # about 150 GB/s once the last rank arrives
        for m in members:
            r, start, launch_ts, ext, meta, tid = starts[m]
            _, kend = r.launch(names[coll], tid, launch_ts, 0.0, r.group(desc).stream, ext,
                               runtime="cudaLaunchKernelExC", cbid=430,
                               kargs=meta if with_metadata else None, span=(start, end))
            if blocking:
                r.stream_free[COMPUTE] = max(r.stream_free.get(COMPUTE, 0.0), kend)


def _step(ranks: list[_Rank], step: int, layers: int, names: dict[str, str]) -> None:
    """One training step on every rank: forward (tp all_reduce per layer), backward
    (dp reduce_scatter per layer, overlapping compute, side stream), optimizer, p2p, barrier."""
    step_start = {}
    for r in ranks:
        # ranks drift a little apart on the CPU, as real ones do
        for tid in (r.tid_main, r.tid_bwd):
            r.cpu[tid] = max(r.cpu.values()) + 5.0 + r.rng.random() * 20.0
        step_start[r.rank] = r.cpu[r.tid_main]
        t = r.cpu[r.tid_main]
        ext = r.cpu_op("aten::copy_", r.tid_main, t, 30.0, args=_shapes(3, [[4096, 1024]] * 2))
        r.launch("Memcpy HtoD (Pageable -> Device)", r.tid_main, t + 10.0, 12.0, COMPUTE, ext,
                 cat="gpu_memcpy", runtime="cudaMemcpyAsync", cbid=41,
                 kargs={"bytes": 8388608, "memory bandwidth (GB/s)": 22.4})
        r.cpu[r.tid_main] = t + 32.0
    for _layer in range(layers):
        for r in ranks:
            _elementwise(r, r.tid_main, "aten::layer_norm", NORM)
            _linear(r, r.tid_main, 1024)
            _elementwise(r, r.tid_main, "aten::gelu", GELU)
            _linear(r, r.tid_main, 1024)
        _collective(ranks, "tp", "allreduce", 4096 * 1024, "BFloat16", "tid_main", names,
                    blocking=True)
    for r in ranks:
        r.cpu[r.tid_bwd] = max(r.cpu[r.tid_bwd], r.cpu[r.tid_main] + 10.0)
    for layer in range(layers):
        for r in ranks:
            tid = r.tid_bwd
            t = r.cpu[tid]
            r.cpu[tid] = t + 3.0
            _linear(r, tid, 1024)
            _linear(r, tid, 1024)
            _elementwise(r, tid, "aten::add_", ADAM, stream=SIDE,
                         overlap=2.0 if layer % 3 == 0 else 0.0)
            r.cpu_op("autograd::engine::evaluate_function: AddmmBackward0", tid, t,
                     r.cpu[tid] - t)
        _collective(ranks, "dp", "_reduce_scatter_base", 1 << 20, "Float", "tid_bwd", names,
                    blocking=False)
    for r in ranks:
        r.cpu[r.tid_main] = max(r.cpu[r.tid_main], r.cpu[r.tid_bwd] + 5.0)
    _collective(ranks, "dp", "_allgather_base", 1 << 20, "BFloat16", "tid_main", names,
                blocking=True)
    for i in range(4):
        for r in ranks:
            _elementwise(r, r.tid_main, "aten::_fused_adam_", ADAM, overlap=1.0 if i else 0.0)
    _collective(ranks, "dp", "send/recv", 1 << 16, "BFloat16", "tid_main", names,
                blocking=False, with_metadata=False)
    _collective(ranks, "default_pg", "barrier", 1, "Byte", "tid_main", names, blocking=True)
    for r in ranks:
        t = r.cpu[r.tid_main]
        sync_end = max(r.stream_free.values()) + 3.0
        r.cpu_op("cudaDeviceSynchronize", r.tid_main, t, sync_end - t, cat="cuda_runtime")
        r.cpu[r.tid_main] = sync_end + 2.0
        r.cpu_op(f"ProfilerStep#{step}", r.tid_main, step_start[r.rank] - 1.0,
                 r.cpu[r.tid_main] - step_start[r.rank], cat="user_annotation")


def _header(r: _Rank) -> bytes:
    pgs = [g for g in r.groups if r.rank in g.ranks]
    head = {
        "schemaVersion": 1,
        "deviceProperties": [{"id": r.device, "name": "NVIDIA H100 80GB HBM3",
                              "totalGlobalMem": 85045182464, "computeMajor": 9,
                              "computeMinor": 0, "maxThreadsPerBlock": 1024,
                              "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
                              "warpSize": 32, "sharedMemPerBlock": 49152,
                              "numSms": 132, "sharedMemPerMultiprocessor": 233472}],
        "distributedInfo": {"backend": "nccl", "rank": r.rank, "world_size": r.world,
                            "pg_count": len(pgs),
                            "pg_config": [{"pg_name": g.name, "pg_desc": g.desc,
                                           "backend_config": "cuda:nccl",
                                           "pg_size": len(g.ranks), "ranks": list(g.ranks)}
                                          for g in pgs],
                            "nccl_version": "2.28.9"},
        "record_shapes": 1,
        "with_stack": 0,
        "trace_id": f"{r.rank:032X}",
        "host_name": f"node{r.rank // 8}",
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": BASE_NS,
    }
    text = orjson.dumps(head)
    return text[:-1] + b',\n"traceEvents": [\n'


def _metadata(r: _Rank) -> None:
    ts = T0_US
    for ev in (
        {"name": "process_name", "pid": r.pid, "args": {"name": "python3"}},
        {"name": "process_labels", "pid": r.pid, "args": {"labels": "CPU"}},
        {"name": "process_sort_index", "pid": r.pid, "args": {"sort_index": r.pid}},
        {"name": "thread_name", "pid": r.pid, "tid": r.tid_main,
         "args": {"name": f"thread {r.tid_main} (python3)"}},
        {"name": "thread_name", "pid": r.pid, "tid": r.tid_bwd,
         "args": {"name": f"thread {r.tid_bwd} (pt_autograd_0)"}},
        {"name": "process_name", "pid": r.device, "args": {"name": "python3"}},
        {"name": "process_labels", "pid": r.device, "args": {"labels": f"GPU {r.device}"}},
        {"name": "process_sort_index", "pid": r.device, "args": {"sort_index": 5000000 + r.device}},
        *({"name": "thread_name", "pid": r.device, "tid": s, "args": {"name": f"stream {s}"}}
          for s in sorted({COMPUTE, SIDE, *(g.stream for g in r.groups)})),
    ):
        ev.setdefault("tid", 0)
        r.emit({"ph": "M", "ts": ts, **ev})


def _footer(r: _Rank) -> bytes:
    end = max(r.cpu.values())
    tail = [
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": T0_US - 70.0, "dur": _r3(end - T0_US + 80.0),
         "args": {"Op count": 0}},
        {"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": "Traces",
         "tid": "Trace PyTorch Profiler", "ts": T0_US - 70.0},
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "",
         "ts": _r3(end + 20.0)},
    ]
    r.count += len(tail)
    body = b",\n".join(orjson.dumps(e) for e in tail)
    return body + b'\n],\n"traceName": "trace_rank' + str(r.rank).encode() + b'.json"\n}\n'


def trace_path(run_dir: Path, rank: int, compress: bool) -> Path:
    return run_dir / f"trace_rank{rank}.json{'.gz' if compress else ''}"


def write_run(run_dir: str | Path, ranks: int, events: int, *, layers: int = 16,
              compress: bool = True, old_nccl_names: bool = False, seed: int = 0,
              tp: int = 2) -> dict[int, int]:
    """Write ``trace_rank{R}.json[.gz]`` for ``ranks`` ranks of about ``events`` events each.

    Returns the number of trace events written per rank.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    groups = process_groups(ranks, tp)
    names = NCCL_OLD if old_nccl_names else NCCL_NEW
    files = []
    rs: list[_Rank] = []
    for rank in range(ranks):
        path = trace_path(run_dir, rank, compress)
        f: Any = gzip.open(path, "wb", compresslevel=1) if compress else open(path, "wb")
        files.append(f)
        r = _Rank(rank, ranks, groups, f, random.Random(seed * 100_003 + rank),
                  pid=40000 + 97 * rank, device=rank % 8)
        r.tid_main, r.tid_bwd = r.pid, r.pid + 11
        r.cpu = {r.tid_main: T0_US + r.rng.random() * 50.0, r.tid_bwd: T0_US}
        f.write(_header(r))
        _metadata(r)
        rs.append(r)
    step = 0
    while min(r.count for r in rs) < events:
        _step(rs, step, layers, names)
        step += 1
    counts = {}
    for r, f in zip(rs, files):
        r.flush()
        f.write(_footer(r))
        f.close()
        counts[r.rank] = r.count
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="run directory to write trace_rank{R}.json.gz into")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=200_000, help="trace events per rank (about)")
    ap.add_argument("--layers", type=int, default=16, help="layers per training step")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel group size")
    ap.add_argument("--no-gzip", action="store_true", help="write plain .json")
    ap.add_argument("--old-nccl-names", action="store_true",
                    help="ncclKernel_* (NCCL < 2.19) kernel names instead of ncclDevKernel_*")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    counts = write_run(a.out, a.ranks, a.events, layers=a.layers, compress=not a.no_gzip,
                       old_nccl_names=a.old_nccl_names, seed=a.seed, tp=a.tp)
    print(f"wrote {a.ranks} traces, {sum(counts.values()):,} events, to {a.out} "
          f"in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
