"""CPU time commviz's c10d boundary recorder adds to a call, measured side by side.

Interleaved batches of one-element calls (gloo on CPU, or NCCL with ``--device cuda``); per
variant, median over the batches of wall clock and of the calling thread's CPU time per c10d
call. The variants run in child processes, one per *side*, each set up once:
  one      one rank, Flight Recorder off (``TORCH_FR_BUFFER_SIZE=0``):
           plain            no commviz kernel installed (torch as it ships)
           recording on     commviz's boundary kernel installed, recording
           recording off    installed, ``commviz.enable(False)``
           record_function  plain call inside ``torch.profiler.record_function`` (a yardstick)
           FSDP range       plain call inside a range commviz follows for origins (FSDP2's name)
           FSDP range, on   the same, recording on (against FSDP range)
           profiler         plain call while ``torch.profiler`` runs (CPU activity, shapes
                            recorded: what ``commviz.profile`` starts)
           profiler, on     the same, recording on (against profiler)
           annotate block   the call inside ``commviz.annotate_collective``, no kernel
                            installed: what the block itself costs
           annotate, on     the same block, recording on (against annotate block: what
                            recording the collective inside a block adds)
           record_function, profiled   record_function's call while the profiler runs
           annotate block, profiled    the annotate block's call while the profiler runs
           annotate, profiled, on      the same, recording on (against annotate block,
                            profiled): each against profiler, the blocks' own cost there
  fr       one rank, torch's Flight Recorder on (``TORCH_FR_BUFFER_SIZE=2000``, torch's default):
           Flight Recorder  plain call (against plain: what Flight Recorder costs)
           FR + on          recording on as well (against Flight Recorder)
  p2p      two ranks (the peer a process of its own, mirroring each call), Flight Recorder off;
           per point-to-point call, each exchange being one send and one receive:
           send/recv, isend/irecv (waited), batch_isend_irecv (one isend, one irecv), each
           plain and ``, on`` (against plain)
  gpu2     two ranks on two GPUs (``--device cuda``; the peer mirrors each call), NCCL with
           commviz's NCCL profiler plugin loaded (``commviz.record.nccl_plugin``):
           2 GPUs                 plain one-element all_reduce, GPU timing off
           2 GPUs, on             recording on (against 2 GPUs)
           2 GPUs, on + gputime   recording on and the plugin timing every op on the GPU
                                  (against 2 GPUs, on: what GPU times add to recording)
           2 GPUs, torch timing   plain call on a group made with torch's
                                  ``TORCH_NCCL_ENABLE_TIMING=1`` (against 2 GPUs: what torch's
                                  own GPU timing costs, a CUDA event pair per call)
  gpu2/4   the same, the plugin timing one call in four (``COMMVIZ_GPUTIME_EVERY=4``):
           2 GPUs/4, on             recording on (against 2 GPUs)
           2 GPUs/4, on + gputime   and the sampled GPU times (against 2 GPUs/4, on)
``--arrival unboxed`` makes the one-rank calls in ``torch.inference_mode`` on an inference
tensor: c10d's op then reaches commviz's kernel unboxed, the way functional collectives and
compiled code reach it (``boxed``, the default, is how torch.distributed's functions, DDP and
FSDP reach it).

What a variant adds (median) is the median over rounds of its time minus its base's in the
same round (the variants run in a new random order each round, seeded: what a batch costs
depends on the batch before it, most after a profiled one, whose profiler stop frees its
events, so a fixed or merely rotated order gave each variant the same predecessor and a bias of
its own, up to 5 us), so a host's slow drift cancels out,
with a bootstrap 95% interval of that median; (min) compares the best rounds. Targets (thread
CPU, median): recording on adds < 5 us and no more than Flight Recorder does; off < 0.5 us;
under a running profiler, inside an annotate_collective block and per p2p call: <= 2 us; an
annotate_collective block itself no more than a ``record_function`` block, with a profiler
running and without.

A host's noise (a few tenths of a microsecond on these medians) hides small costs, so
``--instructions`` (CPU only, needs valgrind) also counts the instructions each variant executes
per c10d call under callgrind, all threads of the measured rank and its calling thread alone
(with a p2p peer, what gloo's other threads spin waiting moves from run to run by thousands of
instructions per call; commviz's work is on the calling thread): one child per side under
valgrind (its peer, for p2p, outside it) sets up untimed, then for each variant in turn runs
warm-up calls, and callgrind counts exactly ``--count-calls`` calls (zeroed before, dumped
after). The count does not drift with the host's load; it moves by a few dozen instructions per
call from run to run.
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

# (torch, commviz: imported in the children only, where the side's environment is set first)

FR_OFF, FR_ON = "0", "2000"


@dataclass(frozen=True)
class Side:
    """A child process setting: how many ranks, whether Flight Recorder records."""

    world: int
    flight_recorder: str
    gputime: bool = False   # commviz's NCCL profiler plugin loaded (NCCL, one GPU a rank)
    every: int = 1          # the plugin times one call in ``every`` (COMMVIZ_GPUTIME_EVERY)


SIDES = {"one": Side(1, FR_OFF), "fr": Side(1, FR_ON), "p2p": Side(2, FR_OFF),
         "gpu2": Side(2, FR_OFF, gputime=True), "gpu2/4": Side(2, FR_OFF, gputime=True, every=4)}


@dataclass(frozen=True)
class Variant:
    """One way of making the call: the side that runs it, commviz's state, what it is
    measured against (``base``; None: nothing) and what a target says of it."""

    side: str
    kernel: bool            # commviz's boundary kernel installed
    recording: bool
    call: str               # a name of CALLS
    base: str | None = "plain"
    profiled: bool = False  # torch.profiler running around the batch
    gputime: bool = False   # the NCCL plugin times each op on the GPU (gpu2 side)


# variant -> its setting (the order is the table's)
VARIANTS: dict[str, Variant] = {
    "plain": Variant("one", False, True, "all_reduce", None),
    "recording on": Variant("one", True, True, "all_reduce"),
    "recording off": Variant("one", True, False, "all_reduce"),
    "record_function": Variant("one", False, True, "record_function"),
    "FSDP range": Variant("one", False, True, "fsdp_range"),
    "FSDP range, on": Variant("one", True, True, "fsdp_range", "FSDP range"),
    "profiler": Variant("one", False, True, "all_reduce", profiled=True),
    "profiler, on": Variant("one", True, True, "all_reduce", "profiler", profiled=True),
    "annotate block": Variant("one", False, True, "annotated"),
    "annotate, on": Variant("one", True, True, "annotated", "annotate block"),
    "record_function, profiled": Variant("one", False, True, "record_function", "profiler",
                                         profiled=True),
    "annotate block, profiled": Variant("one", False, True, "annotated", "profiler",
                                        profiled=True),
    "annotate, profiled, on": Variant("one", True, True, "annotated", "annotate block, profiled",
                                      profiled=True),
    "Flight Recorder": Variant("fr", False, True, "all_reduce"),
    "FR + on": Variant("fr", True, True, "all_reduce", "Flight Recorder"),
    "send/recv": Variant("p2p", False, True, "send_recv", None),
    "send/recv, on": Variant("p2p", True, True, "send_recv", "send/recv"),
    "isend/irecv": Variant("p2p", False, True, "isend_irecv", None),
    "isend/irecv, on": Variant("p2p", True, True, "isend_irecv", "isend/irecv"),
    "batch_isend_irecv": Variant("p2p", False, True, "batch", None),
    "batch_isend_irecv, on": Variant("p2p", True, True, "batch", "batch_isend_irecv"),
    "2 GPUs": Variant("gpu2", False, True, "all_reduce", None),
    "2 GPUs, on": Variant("gpu2", True, True, "all_reduce", "2 GPUs"),
    "2 GPUs, on + gputime": Variant("gpu2", True, True, "all_reduce", "2 GPUs, on",
                                    gputime=True),
    "2 GPUs, torch timing": Variant("gpu2", False, True, "timed_all_reduce", "2 GPUs"),
    "2 GPUs/4, on": Variant("gpu2/4", True, True, "all_reduce", "2 GPUs"),
    "2 GPUs/4, on + gputime": Variant("gpu2/4", True, True, "all_reduce", "2 GPUs/4, on",
                                      gputime=True),
}
# c10d calls per call of CALLS[name] (a p2p exchange sends once and receives once)
OPS_PER_CALL = {"send_recv": 2, "isend_irecv": 2, "batch": 2}
# Added cost (median thread CPU, us) each target allows: (variant, against, limit); a limit
# named by a variant is what that variant adds over its own base
TARGETS: list[tuple[str, str, float | str | tuple[str, float]]] = [
    ("recording on", "plain", 5.0),
    ("recording on", "plain", "Flight Recorder"),
    ("recording off", "plain", 0.5),
    ("profiler, on", "profiler", 2.0),
    ("annotate, on", "annotate block", 2.0),
    # an annotate_collective block costs no more than torch's record_function: without the
    # kernel and with it, without a profiler and under one
    ("annotate block", "plain", "record_function"),
    ("annotate, on", "recording on", "record_function"),
    ("annotate block, profiled", "profiler", "record_function, profiled"),
    ("annotate, profiled, on", "profiler, on", "record_function, profiled"),
    ("send/recv, on", "send/recv", 2.0),
    ("isend/irecv, on", "isend/irecv", 2.0),
    ("batch_isend_irecv, on", "batch_isend_irecv", 2.0),
    # GPU time of every NCCL op: <= 1 us over recording alone, <= a fifth of torch's timing
    ("2 GPUs, on + gputime", "2 GPUs, on", 1.0),
    ("2 GPUs, on + gputime", "2 GPUs, on", ("2 GPUs, torch timing", 0.2)),
    ("2 GPUs/4, on + gputime", "2 GPUs/4, on", 1.0),
    ("2 GPUs/4, on + gputime", "2 GPUs/4, on", ("2 GPUs, torch timing", 0.2)),
]


# -- the child: one side's process group, its calls ---------------------------------------------

def _calls(peer: int | None, mirror: bool) -> dict[str, Callable[..., object]]:
    """Each call by name; ``mirror``: the peer's side of a p2p exchange."""
    import torch
    import torch.distributed as td

    import commviz

    def record_function(t: torch.Tensor) -> None:
        with torch.profiler.record_function("all_reduce"):
            td.all_reduce(t)

    def fsdp_range(t: torch.Tensor) -> None:
        """The call inside a range commviz follows for origins, as FSDP2 opens it."""
        with torch.profiler.record_function("FSDP::all_gather (layers.0)"):
            td.all_reduce(t)

    def annotated(t: torch.Tensor) -> None:
        with commviz.annotate_collective("all_reduce", t, t):
            td.all_reduce(t)

    def send_recv(t: torch.Tensor) -> None:
        if mirror:
            td.recv(t, peer)
            td.send(t, peer)
        else:
            td.send(t, peer)
            td.recv(t, peer)

    def isend_irecv(t: torch.Tensor) -> None:
        for work in (td.isend(t, peer), td.irecv(t.clone() if mirror else t, peer)):
            work.wait()

    def batch(t: torch.Tensor) -> None:
        ops = [td.P2POp(td.isend, t, peer), td.P2POp(td.irecv, torch.empty_like(t), peer)]
        for work in td.batch_isend_irecv(ops):
            work.wait()

    return {"all_reduce": td.all_reduce, "record_function": record_function,
            "fsdp_range": fsdp_range, "annotated": annotated, "send_recv": send_recv,
            "isend_irecv": isend_irecv, "batch": batch}


class Child:
    """A side's rank: process group, commviz, and the variants it runs on command."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as td

        self.args = args
        self.rank = args.rank
        side = SIDES[args.child]
        if args.arrival == "unboxed" and side.world == 1:
            torch.inference_mode().__enter__()       # held for the process's life
        device = args.device
        if device == "cuda":
            torch.cuda.set_device(self.rank)
        td.init_process_group("nccl" if device == "cuda" else "gloo", rank=self.rank,
                              world_size=side.world)
        self.tensor = torch.ones(1, device=device)
        self.calls = _calls(1 - self.rank if side.world == 2 else None, mirror=self.rank == 1)
        if side.gputime:                 # a second group, made with torch's own GPU timing
            os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
            timed = td.new_group(list(range(side.world)))
            del os.environ["TORCH_NCCL_ENABLE_TIMING"]
            self.calls["timed_all_reduce"] = lambda t: td.all_reduce(t, group=timed)
        if self.rank == 0:
            import commviz

            commviz.start(tempfile.mkdtemp(prefix="commviz-bench-"), capacity=10_000,
                          flush_interval=None)

    def select(self, variant: Variant) -> None:
        """commviz's kernel in or out, recording on or off (the measured rank only); the NCCL
        plugin's GPU timing on or off (every rank: NCCL's kernels stamp on both)."""
        if SIDES[self.args.child].gputime:
            from commviz.record import nccl_plugin

            nccl_plugin.enable(variant.gputime)
        if self.rank != 0:
            return
        import commviz
        from commviz.record import boundary
        from commviz.record.boundary import Impl

        want = Impl.CPP if variant.kernel else None
        if boundary.BOUNDARY.impl is not want:
            boundary.uninstall()
            if want is not None:
                got = boundary.install(want)
                if got is not want:
                    raise SystemExit(f"bench_overhead: no C++ kernel: {boundary.BOUNDARY.problem}")
        commviz.enable(variant.recording)

    def around(self, variant: Variant) -> ContextManager[object]:
        """What a batch runs inside: the profiler ``commviz.profile`` starts, for the
        profiled variants (on the measured rank; its trace is not written)."""
        if not variant.profiled or self.rank != 0:
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.args.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        return profile(activities=activities, record_shapes=False)

    def batch(self, variant: Variant, calls: int, clocks: dict[str, Callable[[], int]]
              ) -> dict[str, float]:
        """``calls`` calls of ``variant``; ns per c10d call by each clock."""
        import torch

        fn, t = self.calls[variant.call], self.tensor
        self.select(variant)
        with self.around(variant):
            if self.args.device == "cuda":
                torch.cuda.synchronize()
            starts = {name: clock() for name, clock in clocks.items()}
            for _ in range(calls):
                fn(t)
            ends = {name: clock() for name, clock in clocks.items()}
        ops = calls * OPS_PER_CALL.get(variant.call, 1)
        return {name: (ends[name] - starts[name]) / ops for name in clocks}

    def count(self, variant: Variant, calls: int) -> None:
        """Warm-up calls, ``ready``, the counted calls, ``done``; the profiler of a profiled
        variant starts before and stops after the count (the parent says when)."""
        fn, t = self.calls[variant.call], self.tensor
        self.select(variant)
        with self.around(variant):
            for _ in range(300):
                fn(t)
            print("ready", flush=True)
            sys.stdin.readline()
            for _ in range(calls):
                fn(t)
            print("done", flush=True)
            sys.stdin.readline()

    def serve(self) -> None:
        """Commands on stdin, one a line: ``time VARIANT CALLS`` (prints wall and thread CPU
        ns per call), ``count VARIANT CALLS`` (``count``), ``quit``."""
        import torch.distributed as td

        clocks = {"wall": time.perf_counter_ns, "thread cpu": time.thread_time_ns}
        for line in sys.stdin:
            cmd, *rest = line.rstrip("\n").split("\t")
            if cmd == "quit":
                break
            variant, calls = VARIANTS[rest[0]], int(rest[1])
            if cmd == "time":
                got = self.batch(variant, calls, clocks)
                print(f"{got['wall']}\t{got['thread cpu']}", flush=True)
            elif cmd == "count":
                self.count(variant, calls)
        td.destroy_process_group()


# -- the parent: children, rounds, figures -------------------------------------------------------

class Proc:
    """One child process, talked to through its stdin and stdout."""

    def __init__(self, side: str, rank: int, port: int, args: argparse.Namespace,
                 callgrind: Path | None = None) -> None:
        cmd = [sys.executable, __file__, "--child", side, "--rank", str(rank),
               "--device", args.device, "--arrival", args.arrival]
        if callgrind is not None:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                   f"--callgrind-out-file={callgrind}", *cmd]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCH_FR_BUFFER_SIZE=SIDES[side].flight_recorder)
        if SIDES[side].gputime:          # NCCL loads the plugin at its first communicator
            from commviz.record import nccl_plugin

            env[nccl_plugin.PLUGIN_ENV] = str(nccl_plugin.build())
            env[nccl_plugin.EVERY] = str(SIDES[side].every)
            env[nccl_plugin.FILE_ENV] = os.path.join(
                tempfile.gettempdir(), f"commviz-bench-{os.getpid()}-{side[-1]}-{rank}.gputime")
        else:                            # commviz.start would time NCCL ops: recording alone
            env["COMMVIZ_GPUTIME"] = "off"
        if args.device == "cuda":        # NCCL's own recorder in torch 2.11
            env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = SIDES[side].flight_recorder
        self.name = f"{side} rank {rank}"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if callgrind else None, text=True,
                                     env=env)

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\t".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_overhead: the {self.name} child exited early "
                             f"({self.proc.wait()})")
        return line.strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.send("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Sides:
    """The children of the sides in use: the measured rank and, for p2p, its peer."""

    def __init__(self, names: list[str], args: argparse.Namespace,
                 callgrind: dict[str, Path] | None = None) -> None:
        self.procs: dict[str, list[Proc]] = {}
        try:
            for name in names:
                port = _port()
                self.procs[name] = [
                    Proc(name, rank, port, args,
                         callgrind.get(name) if callgrind and rank == 0 else None)
                    for rank in range(SIDES[name].world)]
        except BaseException:
            self.close()
            raise

    def send(self, side: str, *words: object) -> None:
        for proc in self.procs[side]:
            proc.send(*words)

    def time(self, name: str, calls: int) -> tuple[float, float]:
        """One batch of ``name``: (wall, thread CPU) ns per c10d call on the measured rank."""
        side = VARIANTS[name].side
        self.send(side, "time", name, calls)
        answers = [proc.read() for proc in self.procs[side]]
        wall, cpu = answers[0].split("\t")
        return float(wall), float(cpu)

    def close(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                proc.close()


def _median_interval(diffs: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``diffs`` (fixed seed: reruns print the same)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _sides(args: argparse.Namespace) -> list[str]:
    """The sides this run can have: p2p needs two devices on CUDA, gpu2 two GPUs."""
    names = list(SIDES)
    if args.device != "cuda":
        names.remove("gpu2")
        names.remove("gpu2/4")
    else:
        import torch

        if torch.cuda.device_count() < 2:
            print("(p2p and 2-GPU variants skipped: they need 2 GPUs, this host has "
                  f"{torch.cuda.device_count()})")
            names.remove("p2p")
            names.remove("gpu2")
            names.remove("gpu2/4")
    return names


def timed(args: argparse.Namespace, names: list[str]) -> None:
    """The interleaved rounds, by wall clock and thread CPU time."""
    variants = [v for v in VARIANTS if VARIANTS[v].side in names]
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    sides = Sides(names, args)
    try:
        for name in variants:                                   # warm-up
            sides.time(name, 200)
        order, shuffle = list(variants), random.Random(0).shuffle
        for _ in range(args.batches):
            shuffle(order)
            for name in order:
                results[name].append(sides.time(name, args.calls))
    finally:
        sides.close()

    print(f"commviz boundary overhead: 1-element calls, {'nccl' if args.device == 'cuda' else 'gloo'}, "
          f"arriving {args.arrival}, {args.batches} rounds x {args.calls} calls per variant; "
          "us per c10d call (p2p: per send or receive)")

    def diffs(name: str, base: str, clock: int) -> list[float]:
        """Per round, what ``name`` took over ``base``, in us."""
        return [(v[clock] - b[clock]) / 1000 for v, b in zip(results[name], results[base])]

    def best(name: str, clock: int) -> float:
        return min(r[clock] for r in results[name]) / 1000

    wide = max(map(len, variants)) + 2
    print(f"{'variant':<{wide}}{'base':<{wide}}{'wall med':>9}{'added':>8}{'cpu med':>9}"
          f"{'added':>8}{'95% interval':>18}{'cpu min':>9}{'added':>8}")
    for name in variants:
        base = VARIANTS[name].base
        row = f"{name:<{wide}}{base or '':<{wide}}"
        for clock in (0, 1):
            row += f"{statistics.median(r[clock] for r in results[name]) / 1000:>9.2f}"
            row += f"{statistics.median(diffs(name, base, clock)):>+8.2f}" if base else " " * 8
        if base:
            low, high = _median_interval(diffs(name, base, 1))
            row += f"{low:>+9.2f} .. {high:>+5.2f}{best(name, 1):>9.2f}"
            row += f"{best(name, 1) - best(base, 1):>+8.2f}"
        else:
            row += " " * 18 + f"{best(name, 1):>9.2f}"
        print(row)
    print("(added: median of the per-round differences from the base; cpu min: the best "
          "round and its difference from the base's best round)")
    for name, base, limit in TARGETS:
        if name not in results or base not in results:
            continue
        got = statistics.median(diffs(name, base, 1))
        if isinstance(limit, (str, tuple)):
            other, part = (limit, 1.0) if isinstance(limit, str) else limit
            if other not in results:
                continue
            bound = part * statistics.median(diffs(other, VARIANTS[other].base or "plain", 1))
            what = f"<= {'' if part == 1 else f'{part:g} x '}{other}'s {bound:+.2f}"
        else:
            bound, what = limit, f"<= {limit:g}"
        print(f"target: {name} adds {got:+.2f} us thread cpu over {base} ({what}: "
              f"{'met' if got <= bound else 'MISSED'})")


def _counted(sides: Sides, side: str, name: str, calls: int, out: Path, dumps: int
             ) -> tuple[float, float]:
    """Instructions per c10d call of ``name`` on ``side``'s measured rank (already under
    callgrind), counted between a zeroing and a dump: (all its threads, the calling thread)."""
    proc = sides.procs[side][0]
    pid = str(proc.proc.pid)
    sides.send(side, "count", name, calls)
    for p in sides.procs[side]:
        if p.read() != "ready":
            raise SystemExit(f"bench_overhead: the {p.name} child did not get ready")
    for switch in (["-z"], ["-i", "on"]):
        subprocess.run(["callgrind_control", *switch, pid], check=True, capture_output=True)
    sides.send(side, "")
    for p in sides.procs[side]:
        if p.read() != "done":
            raise SystemExit(f"bench_overhead: the {p.name} child did not finish")
    for switch in (["-i", "off"], ["--dump"]):
        subprocess.run(["callgrind_control", *switch, pid], check=True, capture_output=True)
    sides.send(side, "")                       # the child may stop its profiler now
    main = Path(f"{out}.{dumps}-01")          # one file per thread; the main thread's first
    for _ in range(600):
        if main.exists() and re.search(r"^totals: \d+", main.read_text(), re.M):
            break
        time.sleep(0.1)
    totals = {path: re.search(r"^totals: (\d+)", path.read_text(), re.M)
              for path in out.parent.glob(f"{out.name}.{dumps}-*")}
    if totals.get(main) is None:
        raise SystemExit(f"bench_overhead: no totals in {main}")
    ops = calls * OPS_PER_CALL.get(VARIANTS[name].call, 1)
    return (sum(int(t.group(1)) for t in totals.values() if t) / ops,
            int(totals[main].group(1)) / ops)


def instructions(args: argparse.Namespace, names: list[str]) -> None:
    """Instructions per c10d call of each variant, twice each in alternation."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_overhead: --instructions needs valgrind (callgrind_control)")
    counts: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS
                                                    if VARIANTS[v].side in names}
    with tempfile.TemporaryDirectory(prefix="commviz-callgrind-") as tmp:
        outs = {side: Path(tmp) / f"{side}.out" for side in names}
        sides = Sides(names, args, callgrind=outs)
        dumps = dict.fromkeys(names, 0)
        try:
            for repeat in range(2):
                for name in counts:
                    side = VARIANTS[name].side
                    dumps[side] += 1
                    counts[name].append(_counted(sides, side, name, args.count_calls,
                                                 outs[side], dumps[side]))
        finally:
            sides.close()
    import torch

    print(f"instructions per c10d call (callgrind, gloo, arriving {args.arrival}, "
          f"{args.count_calls} calls, two runs each; torch {torch.__version__}): all threads of "
          "the measured rank, then its calling thread alone (a p2p peer's timing moves what "
          "gloo's other threads spin)")

    def mean(name: str, which: int) -> float:
        return statistics.mean(g[which] for g in counts[name])

    for which, what in ((0, "all threads"), (1, "calling thread")):
        print(f" {what}:")
        for name, got in counts.items():
            base = VARIANTS[name].base
            extra = ""
            if base:
                added = mean(name, which) - mean(base, which)
                extra = f"  adds {added:+,.0f} over {base} ({added / mean(base, which):+.2%})"
            print(f"  {name:<27}{' / '.join(f'{g[which]:,.0f}' for g in got)}{extra}")
        if "annotate, on" in counts:
            added = mean("annotate, on", which) - mean("annotate block", which)
            print(f"  annotate, on over annotate block: {added:+,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=41, help="rounds of every variant")
    parser.add_argument("--arrival", default="boxed", choices=["boxed", "unboxed"],
                        help="how the op reaches commviz's kernel (unboxed: inference mode)")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"which sides to run, of {', '.join(SIDES)}")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per call under callgrind (CPU only)")
    parser.add_argument("--count-calls", type=int, default=2000,
                        help="calls counted per variant with --instructions")
    parser.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Child(args).serve()
        return
    if args.instructions and args.device != "cpu":
        raise SystemExit("bench_overhead: --instructions counts the CPU (gloo) path only")
    names = [n for n in _sides(args) if n in args.sides.split(",")]
    if not names:
        raise SystemExit(f"bench_overhead: none of {args.sides} runs here (2-GPU sides: "
                         "--device cuda on 2 GPUs)")
    if "one" not in names and any(v.base == "plain" and v.side in names
                                  for v in VARIANTS.values()):
        raise SystemExit("bench_overhead: the one side's plain call is every side's yardstick")
    timed(args, names)
    if args.instructions:
        instructions(args, names)


if __name__ == "__main__":
    main()
