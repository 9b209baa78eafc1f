"""Per-stream kernel classes and HTA's comm/compute overlap, on a small Kineto-format trace whose
intervals are chosen so every figure can be worked out by hand (and, on 2 GPUs, on a real NCCL
job with a CUDA-event timing of the same all_reduce beside commviz's bus bandwidth)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from commviz.trace.gpu import gpu_ops
from commviz.review.analyses.overlap import (COMMUNICATION, COMPUTATION, MEMORY, OTHER,
                                             hta_kernel_type, intersection, merge,
                                             overlap_table)
from commviz.review.analyses.streams import stream_table
from commviz.trace.load import load_trace
from harness import torchrun

BASE_NS = 1_700_000_000_000_000_000
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "ampere_sgemm_128x64_tn"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
SYNC = "gpuSyncKernel"
MEMCPY = "Memcpy HtoD (Pageable -> Device)"


def _gpu(name: str, ts: float, dur: float, stream: int, corr: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr, "device": 0}}


def _write_trace(path: Path) -> Path:
    events = [
        _gpu(NCCL, 0, 100, 7, 1),            # comm   [0, 100]
        _gpu(GEMM, 50, 100, 0, 2),           # comp   [50, 150], 50 of it under comm
        _gpu(ELEMENTWISE, 200, 60, 0, 3),    # comp   [200, 260]
        _gpu(NCCL, 300, 50, 7, 4),           # comm   [300, 350], launched by a graph replay
        _gpu(SYNC, 360, 10, 0, 5),           # other  [360, 370]
        _gpu(MEMCPY, 400, 20, 0, 6, cat="gpu_memcpy"),   # memory [400, 420]
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1,
         "ts": 290, "dur": 5, "args": {"cbid": 311, "correlation": 4}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 40, "dur": 5,
         "args": {}},
    ]
    doc = {"traceEvents": events, "baseTimeNanoseconds": BASE_NS,
           "distributedInfo": {"rank": 3, "world_size": 4}}
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def ops(tmp_path):
    return gpu_ops(load_trace(_write_trace(tmp_path / "trace_rank3.json")))


def test_gpu_ops_are_the_stream_events_with_wall_times(ops):
    assert [o.name for o in ops] == [NCCL, GEMM, ELEMENTWISE, NCCL, SYNC, MEMCPY]
    assert ops[0].start_ns == BASE_NS and ops[0].end_ns == BASE_NS + 100_000
    assert [o.graphed for o in ops] == [False, False, False, True, False, False]
    assert {o.rank for o in ops} == {3}


def test_streams_table(ops):
    rows = {r.stream: r for r in stream_table(ops)}
    assert list(rows) == [0, 7]                  # busiest first: 190 µs on 0, 150 µs on 7
    comm = rows[7]
    assert comm.count["communication"] == 2 and comm.time_ns["communication"] == 150_000
    assert comm.graphed == 1
    compute = rows[0]
    assert compute.count == {"communication": 0, "gemm": 1, "memcpy/memset": 1, "other": 2}
    assert compute.time_ns["gemm"] == 100_000
    assert compute.time_ns["other"] == 70_000
    assert compute.time_ns["memcpy/memset"] == 20_000


@pytest.mark.parametrize("name, kind", [
    (NCCL, COMMUNICATION), ("ncclKernel_AllGather_RING_LL_Sum_int8_t", COMMUNICATION),
    (MEMCPY, MEMORY), ("Memset (Device)", MEMORY), ("dma_copy", MEMORY),
    (GEMM, COMPUTATION), (ELEMENTWISE, COMPUTATION),
    (SYNC, OTHER), ("fooMemcpyKernel", OTHER),   # HTA's regex: "Memcpy" anywhere is not compute
])
def test_hta_kernel_types(name, kind):
    assert hta_kernel_type(name) == kind


def test_interval_helpers():
    assert merge([(5, 9), (0, 3), (3, 4), (8, 12)]) == [(0, 4), (5, 12)]
    assert intersection([(0, 10), (20, 30)], [(5, 25)]) == 5 + 5
    assert intersection([(0, 1)], []) == 0


def test_overlap_with_hta_definitions(ops):
    (row,) = overlap_table(ops)
    assert row.rank == 3
    assert row.comm_ns == 150_000                # [0,100] + [300,350]
    assert row.compute_ns == 160_000             # [50,150] + [200,260]
    assert row.overlap_ns == 50_000              # [50,100]
    assert row.overlap_pct == pytest.approx(100 * 50 / 150)
    assert row.kernel_ns == 420_000              # 0 .. 420
    assert row.idle_ns == 420_000 - (150 + 60 + 50 + 10 + 20) * 1000
    assert row.non_compute_ns == row.kernel_ns - row.compute_ns - row.idle_ns


def test_rank_without_gpu_ops_has_no_overlap_row():
    assert overlap_table([]) == []


# -- on GPUs ------------------------------------------------------------------------------------

GPU_JOB = textwrap.dedent('''
    import os, sys, torch
    import torch.distributed as td
    import commviz, commviz.distributed as dist
    run_dir = sys.argv[1]
    rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
    td.init_process_group("nccl", device_id=torch.device("cuda", rank))
    commviz.start(run_dir, flush_interval=None)
    x = torch.ones(64 << 20, device="cuda")           # 256 MiB of float32
    a = torch.randn(8192, 8192, device="cuda")
    side = torch.cuda.Stream()
    with commviz.unrecorded():
        for _ in range(3):
            td.all_reduce(x)                          # warm-up, unrecorded
        with torch.cuda.stream(side):
            a @ a                                     # cuBLAS sets up its side-stream workspace
        td.barrier(); torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    with commviz.profile(run_dir):
        for s, e in zip(starts, ends):                # back to back: launches hide behind kernels
            s.record(); dist.all_reduce(x); e.record()
        torch.cuda.synchronize()
        dist.all_reduce(x, async_op=True)             # one more, with a matmul beside it
        with torch.cuda.stream(side):
            a @ a
        torch.cuda.synchronize()
    commviz.flush()
    if rank == 0:
        with open(os.path.join(run_dir, "cuda_events.txt"), "w") as f:
            f.write(" ".join(str(int(s.elapsed_time(e) * 1e6)) for s, e in zip(starts, ends)))
    td.barrier(); torch.cuda.synchronize()
    os._exit(0)
''')


@pytest.mark.gpu(count=2)
def test_nccl_all_reduce_busbw_beside_cuda_events(tmp_path, run_dir):
    from commviz.review.analyses.reviewing import review_run

    job = tmp_path / "job.py"
    job.write_text(GPU_JOB)
    proc = torchrun([str(job), str(run_dir)], nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    review = review_run(run_dir)
    big = [i for i in review.instances if i.op == "all_reduce" and i.size_bytes == 256 << 20]
    assert len(big) == 6
    assert all(e.source == "kernel" for i in big for e in i.events.values())
    timed = sorted(big, key=lambda i: i.seq)[:5]
    assert all(i.bandwidth is not None for i in timed)
    cuda_ns = sorted(int(t) for t in (run_dir / "cuda_events.txt").read_text().split())
    commviz_bus = sorted(i.bandwidth.busbw_gbps for i in timed)[2]       # medians
    event_bus = (256 << 20) / (cuda_ns[2] / 1e9) / 1e9     # 2 ranks: busbw = algbw
    print(f"\nall_reduce 256 MiB busbw (median of 5): commviz {commviz_bus:.1f} GB/s, CUDA "
          f"events {event_bus:.1f} GB/s, ratio {commviz_bus / event_bus:.3f}", file=sys.stderr)
    assert 0.5 < commviz_bus / event_bus < 2.0
    streams = {(s.rank, s.stream): s for s in review.streams}
    assert any(s.count["communication"] for s in streams.values())
    assert any(s.count["gemm"] for s in streams.values())
    assert {o.rank for o in review.overlap} == {0, 1}
    assert all(o.comm_ns > 0 and o.compute_ns > 0 for o in review.overlap)
    assert all(o.overlap_ns > 0 for o in review.overlap)     # the matmul beside all_reduce #6


# -- real GPU traces recorded on 2 x H200 (tests/fixtures/gpu) -----------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


@pytest.mark.skipif(not (FIXTURES / "graphed").is_dir(), reason="GPU fixtures not present")
def test_gpu_fixture_review():
    from commviz.review.analyses.reviewing import review_run

    for name in ("eager", "graphed"):
        review = review_run(FIXTURES / name)
        kernel_groups = {(e.rank, e.pg) for i in review.instances for e in i.events.values()
                         if e.source == "kernel"}
        assert kernel_groups
        for inst in review.instances:
            # an NCCL call's CPU span (its record outside the profiled window) is only its launch
            if any(e.source != "kernel" and (e.rank, e.pg) in kernel_groups
                   for e in inst.events.values()):
                assert inst.launch_only and inst.bandwidth is None and inst.straggler is None
            elif all(e.source == "kernel" for e in inst.events.values()) and inst.size_bytes:
                assert inst.bandwidth is not None
        assert {o.rank for o in review.overlap} == {0, 1}
        assert all(s.count["communication"] for s in review.streams
                   if s.time_ns["communication"])
    graphed = review_run(FIXTURES / "graphed")
    assert any(s.graphed for s in graphed.streams)
    replays = [i for i in graphed.instances if len(i.key) > 4]
    assert replays and len({(i.pg, i.label) for i in replays}) == len(replays)
