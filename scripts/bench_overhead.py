"""CPU time commviz's c10d boundary recorder adds to a collective, measured side by side.

One process, one rank (gloo on CPU, or NCCL on one GPU with ``--device cuda``), interleaved
batches of one-element ``torch.distributed.all_reduce`` calls; per call, median and minimum
over the batches, by wall clock and by this thread's CPU time:
  plain            no commviz kernel installed (torch as it ships)
  recording on     commviz's boundary kernel installed, recording
  recording off    installed, ``commviz.enable(False)``
  record_function  plain call inside ``torch.profiler.record_function`` (a familiar yardstick)
  FSDP range       plain call inside a range commviz follows for origins (FSDP2's name)
  FSDP range, on   the same, recording on (what it adds is printed against FSDP range)
``--arrival unboxed`` makes the same calls in ``torch.inference_mode`` on an inference tensor:
c10d's op then skips torch's Autograd fallback and reaches commviz's kernel unboxed, the way
functional collectives and compiled code reach it (the default, ``boxed``, is how
torch.distributed's functions, DDP and FSDP reach it).
Targets (thread CPU, median): recording on adds < 5 us, recording off < 0.5 us. What a variant
adds (median) is the median over rounds of its time minus plain's in the same round (the order
of the variants rotates each round), so a host's slow drift cancels out, with a bootstrap 95%
interval of that median; (min) compares each variant's best round.

A host's noise (a few tenths of a microsecond on these medians) hides what recording off
costs, so ``--instructions`` (CPU only, needs valgrind) also counts the instructions each
variant executes per call, all threads, under callgrind: a child process per variant sets up
untimed, then callgrind counts exactly ``--count-calls`` calls. The count does not drift with
the host's load; it moves by a few dozen instructions per call from run to run.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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


def _in_fsdp_range(t: torch.Tensor) -> None:
    """The call inside a range commviz follows for origins, as FSDP2 opens it."""
    with torch.profiler.record_function("FSDP::all_gather (layers.0)"):
        td.all_reduce(t)


# variant -> (boundary implementation or None for plain, recording on, call)
VARIANTS: dict[str, tuple[Impl | None, bool, Callable[[torch.Tensor], object]]] = {
    "plain": (None, True, td.all_reduce),
    "recording on": (Impl.CPP, True, td.all_reduce),
    "recording off": (Impl.CPP, False, td.all_reduce),
    "record_function": (None, True, _with_record_function),
    "FSDP range": (None, True, _in_fsdp_range),
    "FSDP range, on": (Impl.CPP, True, _in_fsdp_range),
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


# Held entered for the whole process with --arrival unboxed.
_INFERENCE = torch.inference_mode()


def _setup(device: str, arrival: str) -> torch.Tensor:
    """One-rank process group and commviz's recorder; the tensor every variant reduces."""
    if arrival == "unboxed":
        _INFERENCE.__enter__()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    if device == "cuda":
        torch.cuda.set_device(0)
    td.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    commviz.start(tempfile.mkdtemp(prefix="commviz-bench-"), capacity=10_000, flush_interval=None)
    return torch.ones(1, device=device)


def _median_interval(diffs: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``diffs`` (fixed seed: reruns print the same)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def timed(args: argparse.Namespace) -> None:
    """The interleaved rounds, by wall clock and thread CPU time."""
    tensor = _setup(args.device, args.arrival)
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

    print(f"commviz boundary overhead: all_reduce of 1 element, {td.get_backend()}, 1 rank, "
          f"arriving {args.arrival}, {args.batches} batches x {args.calls} calls, "
          f"torch {torch.__version__}")
    stats = {"median": statistics.median, "min": min}

    def diffs(name: str, clock: str) -> list[float]:
        """Per round, what ``name`` took over plain, in us."""
        return [(v - p) / 1000 for v, p in zip(results[(name, clock)], results[("plain", clock)])]

    def added(name: str, clock: str, stat: str) -> float:
        """What ``name`` adds over plain, in us: the median of the per-round differences, or
        the difference of the best rounds."""
        if stat == "min":
            return (min(results[(name, clock)]) - min(results[("plain", clock)])) / 1000
        return statistics.median(diffs(name, clock))

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
    for name in ("recording on", "recording off"):
        low, high = _median_interval(diffs(name, "thread cpu"))
        print(f"  {name}: 95% interval of the median added thread cpu {low:+.2f} .. {high:+.2f} us")
    # inside a range commviz follows (FSDP2's, pipelining's): against the same call without it
    ranged = [(v - p) / 1000 for v, p in zip(results[("FSDP range, on", "thread cpu")],
                                             results[("FSDP range", "thread cpu")])]
    low, high = _median_interval(ranged)
    print(f"  inside an FSDP range, recording on adds {statistics.median(ranged):+.2f} us thread "
          f"cpu over the same call without commviz (95%: {low:+.2f} .. {high:+.2f}; < 5: "
          f"{'met' if statistics.median(ranged) < 5 else 'MISSED'})")
    td.destroy_process_group()


def count_child(args: argparse.Namespace) -> None:
    """Under callgrind (instrumentation off): set up, then call while the parent counts."""
    tensor = _setup("cpu", args.arrival)
    impl, recording, fn = VARIANTS[args.count_child]
    _select(impl, recording)
    for _ in range(300):
        fn(tensor)
    for step in ("ready", "done"):   # the parent switches callgrind's counting on, then off
        print(step, flush=True)
        sys.stdin.readline()
        if step == "ready":
            for _ in range(args.count_calls):
                fn(tensor)
    td.destroy_process_group()


def _counted(variant: str, args: argparse.Namespace, out: Path) -> float:
    """Instructions per call of ``variant``, all threads, counted by callgrind."""
    calls = args.count_calls
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         sys.executable, __file__, "--count-child", variant, "--count-calls", str(calls),
         "--arrival", args.arrival],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})  # a port of its own
    assert proc.stdin is not None and proc.stdout is not None
    for step, switch in (("ready", "on"), ("done", "off")):
        while (line := proc.stdout.readline()) and line.strip() != step:
            pass
        if not line:
            raise SystemExit(f"bench_overhead: the {variant!r} child under valgrind exited early")
        subprocess.run(["callgrind_control", "-i", switch, str(proc.pid)], check=True,
                       capture_output=True)
        proc.stdin.write("\n")
        proc.stdin.flush()
    if proc.wait() != 0:
        raise SystemExit(f"bench_overhead: the {variant!r} child failed ({proc.returncode})")
    totals = re.search(r"^totals: (\d+)", out.read_text(), re.M)
    if totals is None:
        raise SystemExit(f"bench_overhead: no totals in {out}")
    return int(totals.group(1)) / calls


def instructions(args: argparse.Namespace) -> None:
    """Instructions per call of each variant, twice each in alternation."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_overhead: --instructions needs valgrind (callgrind_control)")
    counts: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="commviz-callgrind-") as tmp:
        for repeat in range(2):
            for i, name in enumerate(VARIANTS):
                counts[name].append(_counted(name, args, Path(tmp) / f"{repeat}-{i}.out"))
    plain = statistics.mean(counts["plain"])
    print(f"instructions per call (callgrind, all threads, gloo, arriving {args.arrival}, "
          f"{args.count_calls} calls, two runs each; torch {torch.__version__})")
    for name, got in counts.items():
        added = statistics.mean(got) - plain
        extra = "" if name == "plain" else f"  adds {added:+,.0f} ({added / plain:+.2%} of plain)"
        print(f"  {name:<17}{' / '.join(f'{g:,.0f}' for g in got)}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=41)
    parser.add_argument("--arrival", default="boxed", choices=["boxed", "unboxed"],
                        help="how the op reaches commviz's kernel (unboxed: inference mode)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per call under callgrind (CPU only)")
    parser.add_argument("--count-calls", type=int, default=5000,
                        help="calls counted per variant with --instructions")
    parser.add_argument("--count-child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        count_child(args)
        return
    timed(args)
    if args.instructions:
        if args.device != "cpu":
            raise SystemExit("bench_overhead: --instructions counts the CPU (gloo) path only")
        instructions(args)


if __name__ == "__main__":
    main()
