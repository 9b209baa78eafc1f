"""CPU time commviz's c10d boundary recorder adds to a collective, measured side by side.

One process, one rank (gloo on CPU, or NCCL on one GPU with ``--device cuda``), interleaved
batches of one-element ``torch.distributed.all_reduce`` calls; per call, median and minimum
over the batches, by wall clock and by this thread's CPU time:
  plain            no commviz kernel installed (torch as it ships)
  recording on     commviz's boundary kernel installed, recording
  recording off    installed, ``commviz.enable(False)``
  record_function  plain call inside ``torch.profiler.record_function`` (a familiar yardstick)
Targets (thread CPU, median): recording on adds < 5 us, recording off < 0.5 us. What a variant
adds (median) is the median over rounds of its time minus plain's in the same round (the order
of the variants rotates each round), so a host's slow drift cancels out; (min) compares each
variant's best round.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as td

import commviz
from commviz.record import boundary
from commviz.record.boundary import Impl


def _per_call_ns(tensor: torch.Tensor, calls: int, clock: Callable[[], int],
                 fn: Callable[[torch.Tensor], object]) -> float:
    t0 = clock()
    for _ in range(calls):
        fn(tensor)
    return (clock() - t0) / calls


def _with_record_function(t: torch.Tensor) -> None:
    with torch.profiler.record_function("all_reduce"):
        td.all_reduce(t)


# variant -> (boundary implementation or None for plain, recording on, call)
VARIANTS: dict[str, tuple[Impl | None, bool, Callable[[torch.Tensor], object]]] = {
    "plain": (None, True, td.all_reduce),
    "recording on": (Impl.CPP, True, td.all_reduce),
    "recording off": (Impl.CPP, False, td.all_reduce),
    "record_function": (None, True, _with_record_function),
}


def _select(impl: Impl | None, recording: bool) -> None:
    if boundary.BOUNDARY.impl is not impl:
        boundary.uninstall()
        if impl is not None:
            got = boundary.install(impl)
            if got is not impl:
                raise SystemExit(f"bench_overhead: wanted the {impl.value} kernel, got "
                                 f"{got.value}: {boundary.BOUNDARY.problem}")
    commviz.enable(recording)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=15)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    td.init_process_group(backend, rank=0, world_size=1)
    tensor = torch.ones(1, device=args.device)
    commviz.start(tempfile.mkdtemp(prefix="commviz-bench-"), capacity=10_000, flush_interval=None)
    clocks = {"wall": time.perf_counter_ns, "thread cpu": time.thread_time_ns}
    results: dict[tuple[str, str], list[float]] = {(v, c): [] for v in VARIANTS for c in clocks}
    for name, (impl, recording, fn) in VARIANTS.items():      # warm-up
        _select(impl, recording)
        _per_call_ns(tensor, 200, time.perf_counter_ns, fn)
    names = list(VARIANTS)
    for round_ in range(args.batches):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            impl, recording, fn = VARIANTS[name]
            _select(impl, recording)
            for cname, clock in clocks.items():
                if args.device == "cuda":
                    torch.cuda.synchronize()
                results[(name, cname)].append(_per_call_ns(tensor, args.calls, clock, fn))
    _select(Impl.CPP, True)

    print(f"commviz boundary overhead: all_reduce of 1 element, {backend}, 1 rank, "
          f"{args.batches} batches x {args.calls} calls, torch {torch.__version__}")
    stats = {"median": statistics.median, "min": min}

    def added(name: str, clock: str, stat: str) -> float:
        """What ``name`` adds over plain, in us: the median of the per-round differences, or
        the difference of the best rounds."""
        mine, plain = results[(name, clock)], results[("plain", clock)]
        if stat == "min":
            return (min(mine) - min(plain)) / 1000
        return statistics.median(v - p for v, p in zip(mine, plain)) / 1000

    print(f"{'variant':<17}" + "".join(f"{c.split()[-1] + ' ' + s:>16}"
                                       for c in clocks for s in stats))
    for name in VARIANTS:
        row = f"{name:<17}"
        for c in clocks:
            for s, f in stats.items():
                row += f"{f(results[(name, c)]) / 1000:>9.2f}" + (
                    f"{added(name, c, s):>+7.2f}" if name != "plain" else " " * 7)
        print(row)
    print("(columns: us per call, then us added over plain: median of the per-round "
          "differences, difference of the best rounds)")
    for s in stats:
        on = added("recording on", "thread cpu", s)
        off = added("recording off", "thread cpu", s)
        print(f"targets ({s}, thread cpu): recording on adds {on:.2f} us "
              f"(< 5: {'met' if on < 5 else 'MISSED'}), off adds {off:.2f} us "
              f"(< 0.5: {'met' if off < 0.5 else 'MISSED'})")
    td.destroy_process_group()


if __name__ == "__main__":
    main()
