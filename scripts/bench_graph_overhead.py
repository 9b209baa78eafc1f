"""What commviz costs around CUDA graphs: replay time and capture time (one GPU is enough).

Run: ``torchrun --nproc_per_node N scripts/bench_graph_overhead.py [--out FILE.json]``

1. Replay: the same step (``--collectives`` all_reduces and a matmul between each) captured once
   with commviz recording (the boundary kernel, the CUDA graph hooks) and once with plain torch
   (recording off, no hooks). Both graphs must have the same node count: commviz adds no
   work to a graph. Replays are timed in alternating rounds (CUDA-synchronised wall time per
   replay, no profiler running); the figure is the ratio of the medians (target 1.00 +- 0.02).
2. Capture: ``--capture-collectives`` (500) all_reduces captured with commviz annotating every
   one vs plain torch, in alternating rounds; the ratio of the median capture times (capture
   begin to instantiated graph) is the figure (target <= 1.1), and beside it the ratio of the
   best round of each and the median over rounds of each round's own ratio (the GPU hosts here
   are noisy: they switch between a fast and a slow state for runs of rounds, which moves each
   side's median; the sides of one round share a state). Rounds alternate which side goes
   first. The headline is the backend a job gets (``commviz.capture.bindings``' default),
   each backend's three ratios below it. Printed beside it: the same capture with commviz
   recording but skipping the capture work, the time commviz then spends finishing its records
   (after the capture, before they are written), the time in each part of the capture work
   (timed apart, in one more capture), and what one driver query of a capturing stream costs
   (cuStreamGetCaptureInfo, which the boundary kernel makes once per captured collective as it
   returns, timed through ctypes beside a ctypes call that does no work).
Rank 0 prints the figures and writes them as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import commviz
from commviz.capture import bindings, graphs, hooks, region
from commviz.record import capturing


def node_count(g: torch.cuda.CUDAGraph) -> int | None:
    if not bindings.available():
        return None
    return len(bindings.nodes(int(g.raw_cuda_graph())))


RESOLVE_SECONDS: list[float] = []     # commviz finishing its records after each capture


def capture(fn, *, annotated: bool, keep_graph: bool = False) -> tuple[torch.cuda.CUDAGraph, float]:
    """Capture ``fn`` with or without commviz; returns the graph and the seconds it took (the
    record commviz finishes afterwards is timed apart, into ``RESOLVE_SECONDS``)."""
    if annotated:
        commviz.patch()
        hooks.install()
    else:
        commviz.unpatch()
        hooks.uninstall()
    g = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    with torch.cuda.graph(g):
        fn()
    if keep_graph:
        g.instantiate()
    took = time.perf_counter() - t0
    if annotated:
        t0 = time.perf_counter()
        graphs.resolve_all()
        RESOLVE_SECONDS.append(time.perf_counter() - t0)
    return g, took


@contextlib.contextmanager
def wrappers_only():
    """commviz's wrappers record as usual but skip the capture work (where the time goes)."""
    saved = capturing.capture_possible
    capturing.capture_possible = lambda: False
    capturing.changed()
    try:
        yield
    finally:
        capturing.capture_possible = saved
        capturing.changed()


class Parts:
    """Seconds spent in each part of commviz's capture path (wrapping its functions)."""

    TARGETS = ((region, "enter"), (region, "exit"), (graphs, "adopt_native"),
               (graphs.GraphState, "read"), (graphs.GraphState, "_native_waiting"),
               (bindings, "read"),
               (bindings, "nodes"), (bindings, "edges"), (bindings, "kernels"),
               (graphs.GraphState, "_read_ids"))

    def __init__(self) -> None:
        self.seconds = {self.label(o, n): 0.0 for o, n in self.TARGETS}
        self._saved = []

    @staticmethod
    def label(owner, name: str) -> str:
        return f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

    def __enter__(self) -> "Parts":
        for owner, name in self.TARGETS:
            original = getattr(owner, name)
            label = self.label(owner, name)

            def timed(*a, _f=original, _l=label, **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.seconds[_l] += time.perf_counter() - t0
            self._saved.append((owner, name, original))
            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def describe(record: dict) -> list[tuple]:
    """What a capture record says, without its ids (equal across backends and captures)."""
    return [(n["kernel"], tuple(n["dims"]), n["lane"], n["ordinal"], tuple(n["after"]),
             tuple(n["marks"])) for n in record["nodes"]]


def query_us(fn, n: int = 2000) -> tuple[float, float]:
    """Microseconds per cuStreamGetCaptureInfo of the stream capturing ``fn``'s graph (through
    ctypes), and per ctypes call of cuDriverGetVersion (next to no work: ctypes' own cost)."""
    import ctypes

    driver = bindings._Driver()
    version, out = driver_version_fn(), ctypes.c_int()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
        stream = torch.cuda.current_stream().cuda_stream
        t0 = time.perf_counter()
        for _ in range(n):
            driver.capture_info(stream)
        t1 = time.perf_counter()
        for _ in range(n):
            version(ctypes.byref(out))
        t2 = time.perf_counter()
    del g
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def driver_version_fn():
    import ctypes

    fn = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion
    fn.restype = ctypes.c_int
    return fn


def time_replays(g: torch.cuda.CUDAGraph, n: int, *, annotated: bool) -> float:
    """Mean seconds per replay over ``n`` back-to-back replays."""
    if annotated:
        hooks.install()
    else:
        hooks.uninstall()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--collectives", type=int, default=20)
    ap.add_argument("--capture-collectives", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--capture-rounds", type=int, default=41)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=0,
                    help="cProfile one annotated capture; print this many top functions")
    ap.add_argument("--backends", default="driver,bindings",
                    help="capture backends to time (commviz.capture.bindings)")
    args = ap.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                            timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    commviz.start(None)
    x = torch.ones(1 << 18, device="cuda")                   # 1 MiB of float32
    m = torch.randn(512, 512, device="cuda")
    out = torch.empty_like(m)
    small = torch.ones(1024, device="cuda")

    def step() -> None:
        for _ in range(args.collectives):
            torch.distributed.all_reduce(x)
            out.copy_(m @ m)

    def many() -> None:
        for _ in range(args.capture_collectives):
            torch.distributed.all_reduce(small)

    for _ in range(3):                                          # warm up eagerly
        step()
        many()
    torch.cuda.synchronize()

    plain, _ = capture(step, annotated=False, keep_graph=True)
    annotated, _ = capture(step, annotated=True, keep_graph=True)
    nodes = (node_count(plain), node_count(annotated))
    for g in (plain, annotated):                               # first replays: warm up
        for _ in range(10):
            g.replay()
    plain_t, annotated_t = [], []
    for _ in range(args.rounds):
        plain_t.append(time_replays(plain, args.replays, annotated=False))
        annotated_t.append(time_replays(annotated, args.replays, annotated=True))
    replay_ratio = statistics.median(annotated_t) / statistics.median(plain_t)
    del plain, annotated

    backends = [b for b in args.backends.split(",") if b]
    agree = {}
    for name in backends:                                     # same records from every backend
        bindings.use(name)
        g, _ = capture(step, annotated=True)
        agree[name] = describe(commviz.RECORDER.graphs[-1])
        del g
    backends_agree = all(v == agree[backends[0]] for v in agree.values())
    cap_plain, cap_wrapped, cap_annotated, parts = [], [], {b: [] for b in backends}, {}
    cap_resolve: list[float] = []
    def plain_side() -> None:
        g, took = capture(many, annotated=False)
        cap_plain.append(took)
        del g

    def wrapped_side() -> None:
        with wrappers_only():
            g, took = capture(many, annotated=True)
        cap_wrapped.append(took)
        del g

    def annotated_side(name: str) -> None:
        bindings.use(name)
        g, took = capture(many, annotated=True)
        cap_annotated[name].append(took)
        cap_resolve.append(RESOLVE_SECONDS[-1])
        del g

    sides = [plain_side, wrapped_side] + [lambda b=b: annotated_side(b) for b in backends]
    for i in range(args.capture_rounds):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            side()
    for name in backends:                       # where the time goes (instrumented, apart)
        bindings.use(name)
        with Parts() as p:
            g, _ = capture(many, annotated=True)
        parts[name] = p.seconds
        del g
    commviz.unpatch()
    hooks.uninstall()
    query, ctypes_call = query_us(many)
    if args.profile:
        import cProfile
        import io
        import pstats

        bindings.use(backends[0])
        prof = cProfile.Profile()
        prof.enable()
        g, _ = capture(many, annotated=True)
        prof.disable()
        del g
        if rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile)
            print(text.getvalue())
    bindings.use(None)                          # the backend a job gets: the headline
    best = bindings.backend().name if bindings.backend().name in backends else backends[0]
    capture_ratio = statistics.median(cap_annotated[best]) / statistics.median(cap_plain)
    # best of the rounds on each side: what a capture costs when the host leaves it alone
    capture_ratio_min = min(cap_annotated[best]) / min(cap_plain)
    # each round's own ratio: both sides of a round see the host in the same state
    paired = statistics.median(a / p for a, p in zip(cap_annotated[best], cap_plain))
    paired_wrapped = statistics.median(w / p for w, p in zip(cap_wrapped, cap_plain))
    per_backend = {b: {"capture_ms": statistics.median(cap_annotated[b]) * 1e3,
                       "ratio": statistics.median(cap_annotated[b]) / statistics.median(cap_plain),
                       "ratio_best_of_rounds": min(cap_annotated[b]) / min(cap_plain),
                       "ratio_same_round": statistics.median(
                           a / p for a, p in zip(cap_annotated[b], cap_plain)),
                       "parts_ms": {k: v * 1e3 for k, v in parts[b].items()}}
                   for b in backends}

    figures = {
        "replay_collectives": args.collectives, "graph_nodes_plain": nodes[0],
        "graph_nodes_annotated": nodes[1],
        "replay_us_plain": statistics.median(plain_t) * 1e6,
        "replay_us_annotated": statistics.median(annotated_t) * 1e6,
        "replay_ratio": replay_ratio,
        "capture_collectives": args.capture_collectives,
        "capture_ms_plain": statistics.median(cap_plain) * 1e3,
        "capture_backend": best,
        "capture_ms_annotated": statistics.median(cap_annotated[best]) * 1e3,
        "capture_ratio": capture_ratio,
        "capture_ratio_best_of_rounds": capture_ratio_min,
        "capture_ratio_same_round": paired, "wrappers_only_ratio_same_round": paired_wrapped,
        "capture_ms_plain_best": min(cap_plain) * 1e3,
        "capture_ms_annotated_best": min(cap_annotated[best]) * 1e3,
        "capture_us_per_collective_added": (statistics.median(cap_annotated[best])
                                            - statistics.median(cap_plain))
        / args.capture_collectives * 1e6,
        "capture_backends": per_backend, "backends_agree": backends_agree,
        "capture_ms_wrappers_only": statistics.median(cap_wrapped) * 1e3,
        "resolve_ms_after_capture": statistics.median(cap_resolve) * 1e3,
        "capture_query_us": query, "ctypes_call_us": ctypes_call,
        "capture_rounds_ms": {"plain": [t * 1e3 for t in cap_plain],
                              "wrappers_only": [t * 1e3 for t in cap_wrapped],
                              **{b: [t * 1e3 for t in cap_annotated[b]] for b in backends}},
        "torch": torch.__version__, "device": torch.cuda.get_device_name(),
    }
    if rank == 0:
        print(f"replay: {figures['replay_us_plain']:.1f} us plain vs "
              f"{figures['replay_us_annotated']:.1f} us with commviz -> ratio {replay_ratio:.3f} "
              f"(nodes {nodes[0]} vs {nodes[1]})")
        print(f"capture of {args.capture_collectives} collectives: "
              f"{figures['capture_ms_plain']:.1f} ms plain vs "
              f"{figures['capture_ms_annotated']:.1f} ms annotated -> ratio {capture_ratio:.2f} "
              f"({figures['capture_us_per_collective_added']:.1f} us added per collective, "
              f"{best} backend); best of {args.capture_rounds} rounds each: "
              f"{figures['capture_ms_plain_best']:.1f} vs "
              f"{figures['capture_ms_annotated_best']:.1f} ms -> ratio {capture_ratio_min:.2f}; "
              f"median of each round's ratio {paired:.3f} (wrappers without the capture work: "
              f"{paired_wrapped:.3f})")
        for name, fig in per_backend.items():
            print(f"  {name}: {fig['capture_ms']:.1f} ms, ratio {fig['ratio']:.2f} (best of "
                  f"rounds {fig['ratio_best_of_rounds']:.2f}, median of each round's ratio "
                  f"{fig['ratio_same_round']:.3f}), parts "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in fig["parts_ms"].items()))
        print(f"  backends give the same records: {backends_agree}; wrappers without the "
              f"capture work: {figures['capture_ms_wrappers_only']:.1f} ms; records finished "
              f"after the capture (not in it): {figures['resolve_ms_after_capture']:.1f} ms")
        print(f"  one capture query (cuStreamGetCaptureInfo via ctypes): {query:.2f} us; a "
              f"ctypes call doing no work: {ctypes_call:.2f} us")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(figures, f, indent=1)
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


if __name__ == "__main__":
    main()
