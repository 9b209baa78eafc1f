"""CPU time a commviz-wrapped collective adds over the raw torch.distributed call.

Measured side by side in one process, interleaved batches, median per call:
  raw            torch.distributed.all_reduce
  wrapped/on     commviz.distributed.all_reduce, recording on (no profiler running)
  wrapped/off    commviz.distributed.all_reduce, recording off
  record_function  the raw call inside torch.profiler.record_function (the cost to beat)
Targets: on < 5 us, off < 1 us added per call. Runs on one gloo rank (CPU) by default, or
with --device cuda on one GPU through NCCL (a 1-rank NCCL group).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as td

import commviz
import commviz.distributed as cvd


def _per_call_ns(fn, tensor, calls: int, clock) -> float:
    t0 = clock()
    for _ in range(calls):
        fn(tensor)
    return (clock() - t0) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=15)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    td.init_process_group(backend, rank=0, world_size=1)
    tensor = torch.ones(1, device=args.device)
    run_dir = tempfile.mkdtemp(prefix="commviz-bench-")
    commviz.start(run_dir, capacity=10_000, flush_interval=None)

    def record_function(t):
        with torch.profiler.record_function("all_reduce"):
            td.all_reduce(t)

    def wrapped_on(t):
        cvd.all_reduce(t)

    variants = {"raw": (td.all_reduce, True), "wrapped/on": (wrapped_on, True),
                "wrapped/off": (cvd.all_reduce, False), "record_function": (record_function, True)}
    clocks = {"wall": time.perf_counter_ns, "thread cpu": time.thread_time_ns}
    results = {(name, c): [] for name in variants for c in clocks}
    for name, (fn, _) in variants.items():  # warm-up
        commviz.enable(variants[name][1])
        _per_call_ns(fn, tensor, 200, time.perf_counter_ns)
    for _ in range(args.batches):
        for name, (fn, recording) in variants.items():
            commviz.enable(recording)
            for cname, clock in clocks.items():
                if args.device == "cuda":
                    torch.cuda.synchronize()
                results[(name, cname)].append(_per_call_ns(fn, tensor, args.calls, clock))
    commviz.enable(True)

    print(f"commviz wrapper overhead: all_reduce of 1 element, {backend}, 1 rank, "
          f"{args.batches} batches x {args.calls} calls, torch {torch.__version__}")
    # Median per call over the batches, and the minimum (timeit's estimator: the batch least
    # disturbed by the rest of the machine), both as added time over the raw call.
    stats = {"median": statistics.median, "min": min}
    print(f"{'variant':<18}" + "".join(f"{c.split()[-1] + ' ' + s:>16}"
                                       for c in clocks for s in stats))
    base = {(c, s): f(results[("raw", c)]) for c in clocks for s, f in stats.items()}
    for name in variants:
        row = f"{name:<18}"
        for c in clocks:
            for s, f in stats.items():
                value = f(results[(name, c)])
                row += f"{value / 1000:>9.2f}" + (f"{(value - base[(c, s)]) / 1000:>+7.2f}"
                                                  if name != "raw" else " " * 7)
        print(row)
    print("(columns: us per call, then us added over raw)")
    for s, f in stats.items():
        on = (f(results[("wrapped/on", "thread cpu")]) - base[("thread cpu", s)]) / 1000
        off = (f(results[("wrapped/off", "thread cpu")]) - base[("thread cpu", s)]) / 1000
        print(f"targets ({s}, thread cpu): recording on adds {on:.2f} us "
              f"(< 5: {'met' if on < 5 else 'MISSED'}), off adds {off:.2f} us "
              f"(< 1: {'met' if off < 1 else 'MISSED'})")
    td.destroy_process_group()


if __name__ == "__main__":
    main()
