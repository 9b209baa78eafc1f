"""Scale benchmark: ``commviz overview`` of 64 to 131,072 ranks, and a detail merge of 8.

Each simulated run dir holds every rank's comm table, made by commviz's own code from a matched
run per rank (``commviz.match.artifact.RankArtifact`` -> ``commviz.merge.table.from_artifact``)
of synthetic matched collectives shaped like a TP × PP × DP job (TP groups of 8, pipelines of
4 stages with their p2p sends and receives, 4 microbatches each way, DP groups across the
replicas, one world all_reduce per step, eager keys and commviz keys on every event, a GPU op
per kernel). Rank 5 is late by 4 ms at every third DP collective (its DP peers wait); rank
world-2 records twice its DP peers' bytes at one collective (a desync). As after a tables-only
gather, the matched runs stay on the nodes, except the last rank's and those of the 8 ranks
of the detail merge, which also get real-shaped profiler traces (``scripts/gen_traces.py``).

The replicas holding a planted or detail rank, and a template replica, are made rank by rank;
every other replica behaves alike, so its tables are the template's with the ranks, hosts and
group names replaced (``_Derived``): the way the overview folds them, and minutes instead of
half an hour at 131,072 ranks.

Printed per size: the tables' making (wall, and CPU of its processes), wall and CPU time (the
overview's process and, from 4,096 ranks, its second table reader) and peak RSS (each
process's own) of the overview, its bytes (and per rank), the ranks it kept at full detail
(above 64 ranks alike ranks fold, and alike groups); the same for the detail merge (its own
process); the bytes rank 0 received per rank through the real tables-only gather
(``commviz.gather(mode="tables")`` on 4 gloo processes, each in a run dir of its own holding
one sampled rank's comm table: ranks 0, 5, world/2 and world-1), beside one rank's matched
run; and the 1-minute load average before and after (a shared machine's other work shows in
the wall time, not in the CPU time). Under each size after the first, its figures over the
previous size's. Then one rank's matched run and comm table as its trace grows (more GPU ops,
the same collectives): the bytes gathered do not grow with it.

    .venv/bin/python scripts/bench_scale.py                  # 64, 256, 1024 ranks
    .venv/bin/python scripts/bench_scale.py --sizes 16384,65536,131072 --keep /tmp/scale
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_traces  # noqa: E402

from commviz import metadata as md  # noqa: E402
from commviz.match import artifact  # noqa: E402
from commviz.match.artifact import Clock, PgInfo, RankArtifact  # noqa: E402
from commviz.match.model import CommEvent, Source, instance_key  # noqa: E402
from commviz.merge.table import from_artifact, table_path, to_json, write_table  # noqa: E402
from commviz.trace.gpu import GpuOp  # noqa: E402

TP, PP = 8, 4
REPLICA = TP * PP                   # one model replica: a TP group per pipeline stage
MICRO = 4                           # microbatches per step through the pipeline
STEPS, LAYERS = 2, 16
LATE_RANK, LATE_NS = 5, 4_000_000
DESYNC_N = 60                       # the schedule's collective where one rank's size differs
DETAIL = list(range(8))
T0 = 1_700_000_000_000_000_000
SLOT_NS = 6_000_000                 # one collective (or pipeline boundary's transfer) a slot


@functools.lru_cache(maxsize=2)
def _groups(world: int) -> dict[str, list[int]]:
    """pg name -> ranks: world "0", TP groups "tp{i}" (8 ranks in a row), pipeline groups
    "pp{j}" (replica j // TP, TP position j % TP: one rank per stage), DP groups "dp{k}" (the
    ranks at place k of every replica)."""
    groups = {"0": list(range(world))}
    for i in range(world // TP):
        groups[f"tp{i}"] = list(range(i * TP, (i + 1) * TP))
    for j in range(world // PP):
        base = j // TP * REPLICA + j % TP
        groups[f"pp{j}"] = list(range(base, base + REPLICA, TP))
    for k in range(REPLICA):
        groups[f"dp{k}"] = list(range(k, world, REPLICA))
    return groups


def _mine(rank: int) -> dict[str, str]:
    """A rank's group of each kind."""
    return {"tp": f"tp{rank // TP}", "pp": f"pp{rank // REPLICA * TP + rank % TP}",
            "dp": f"dp{rank % REPLICA}", "world": "0"}


def _schedule() -> list[tuple[str, str, int, int]]:
    """Per step, in issue order: (group kind, op, bytes, pipeline stage that sends or -1).
    A pipeline transfer's slot is one boundary's: stage s sends to s + 1 (forward, op "send")
    or s + 1 sends to s (backward, op "recv" of stage s), one slot per microbatch each way."""
    out = []
    for _ in range(STEPS):
        for _layer in range(LAYERS):
            out += [("tp", "all_reduce", 8 << 20, -1), ("tp", "all_reduce", 8 << 20, -1),
                    ("tp", "all_gather_into_tensor", 4 << 20, -1)]
        for _layer in range(LAYERS // 2):
            out += [("dp", "reduce_scatter_tensor", 32 << 20, -1),
                    ("dp", "all_gather_into_tensor", 32 << 20, -1)]
        out.append(("world", "all_reduce", 4, -1))
        for _micro in range(MICRO):
            out += [("pp", "fwd", 16 << 20, s) for s in range(PP - 1)]
        for _micro in range(MICRO):
            out += [("pp", "bwd", 16 << 20, s) for s in reversed(range(1, PP))]
    return out


@functools.lru_cache(maxsize=4096)
def _ranks_arg(world: int, pg: str) -> str:
    """A group's ``md.PG_RANKS`` text, formatted once (90 kB for a 16,384-rank world)."""
    return str(_groups(world)[pg])


def _artifact(rank: int, world: int, groups: dict[str, list[int]]) -> RankArtifact:
    """One rank's matched run: each collective a kernel on stream 7, with its GPU op; its
    stage's pipeline transfers (sends and receives of the pipeline schedule)."""
    rng = random.Random(rank)
    mine = _mine(rank)
    stage = rank // TP % PP
    seqs: dict[str, int] = {}
    events, ops = [], []
    for n, (kind, op, size, sender) in enumerate(_schedule()):
        pg = mine[kind]
        base = T0 + n * SLOT_NS
        ranks = groups[pg]
        if kind == "pp":
            peer = sender + 1 if op == "fwd" else sender - 1
            if stage not in (sender, peer):
                continue
            src, dst = ranks[sender], ranks[peer]
            seqs[f"{src}>{dst}"] = p2p_seq = seqs.get(f"{src}>{dst}", 0) + 1
            op = "send" if stage == sender else "recv"
            t = base + rng.randrange(20_000)
            dur = 50_000 + size // 40_000
            args = {md.COLLECTIVE_NAME: op, md.PG_NAME: pg, md.PG_DESC: "pp",
                    md.PG_RANKS: _ranks_arg(world, pg), md.OP: op, md.KIND: "p2p",
                    md.P2P_SEQ: p2p_seq, md.SRC: src, md.DST: dst, md.RANK: rank,
                    md.BYTES_IN: size, md.BYTES_OUT: size, md.DTYPE: "BFloat16",
                    md.ORIGIN_KIND: md.OriginKind.PIPELINE.value, md.CALLSITE: "pipe.py:80",
                    md.LANE: md.lane_id(pg), md.DEVICE: "cuda",
                    md.T_BEGIN: t - 30_000, md.T_END: t - 20_000}
        else:
            seqs[pg] = seqs.get(pg, 0) + 1
            late = kind == "dp" and n % 3 == 0 and LATE_RANK in ranks
            t = base + rng.randrange(20_000) + (LATE_NS if late and rank == LATE_RANK else 0)
            dur = (LATE_NS if late else 0) + 50_000 + size // 40_000 - (t - base)
            if n == DESYNC_N and rank == desync_rank(world):
                size *= 2                                   # its peers disagree: a desync
            args = {md.COLLECTIVE_NAME: op.replace("_tensor", "").replace("_into", ""),
                    md.IN_NELEMS: size // 2, md.OUT_NELEMS: size // 2,
                    md.GROUP_SIZE: len(ranks), md.DTYPE: "BFloat16", md.PG_NAME: pg,
                    md.PG_DESC: pg.rstrip("0123456789"), md.PG_RANKS: _ranks_arg(world, pg),
                    md.OP: op, md.KIND: "collective", md.SEQ: seqs[pg], md.RANK: rank,
                    md.BYTES_IN: size, md.BYTES_OUT: size, md.CALLSITE: "train.py:120",
                    md.LANE: md.lane_id(pg), md.DEVICE: "cuda",
                    md.T_BEGIN: t - 30_000, md.T_END: t - 20_000}
        events.append(CommEvent(rank=rank, pg=pg, op=op, start_ns=t, end_ns=t + dur, args=args,
                                key=instance_key(args), source=Source.KERNEL, stream=7))
        ops.append(GpuOp(rank, 7, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "kernel", t,
                         t + dur, False))
    pgs = {pg: PgInfo(pg.rstrip("0123456789"), groups[pg]) for pg in set(mine.values())}
    return RankArtifact(rank=rank, host=f"node{rank // 8}", inputs=f"synthetic-{rank}",
                        record_inputs=None, clock=Clock(0, "measured"), events=events,
                        gpu_ops=ops, pgs=pgs, labels=[], stats={"comm_events": len(events)})


def desync_rank(world: int) -> int:
    """The rank whose bytes differ from its DP peers' at collective ``DESYNC_N``."""
    return world - 2


MADE = "bench_scale.json"        # in a kept run dir: what made it (reused when it matches)
Shape = Callable[[RankArtifact], RankArtifact]


def _own(art: RankArtifact) -> RankArtifact:
    return art


def planted_replicas(world: int, more: tuple[int, ...] = ()) -> set[int]:
    """The replicas made rank by rank: those of the planted and detail ranks (``more``: a
    caller's own planted ranks), and the template (replica 1) the others are derived from."""
    ranks = {LATE_RANK, desync_rank(world), world - 1, *DETAIL, *more}
    return {r // REPLICA for r in ranks} | {min(1, world // REPLICA - 1)}


def _table_text(art: RankArtifact, shape: Shape) -> str:
    return to_json(from_artifact(shape(art))).decode()


class _Derived:
    """Replica d's tables from the template replica's (1), as text: a replica alike the
    template differs only in its ranks, hosts and group names (tp, pp), so each table is the
    template's with those replaced; what a run's node writes (``from_artifact``) is the same
    for it, the planted replicas are made rank by rank."""

    def __init__(self, world: int, shape: Shape) -> None:
        groups = _groups(world)
        self.texts = [_table_text(_artifact(rank, world, groups), shape)
                      for rank in range(REPLICA, 2 * REPLICA)]
        self.world = world

    def text(self, rank: int) -> str:
        d, place = divmod(rank, REPLICA)
        delta = (d - 1) * REPLICA
        old, new = REPLICA + place, rank
        text = self.texts[place]
        tp_old, tp_new = old // TP, new // TP
        pp_old = _mine(old)["pp"]
        pp_new = _mine(new)["pp"]
        pp_old_ranks, pp_new_ranks = (_groups(self.world)[pp] for pp in (pp_old, pp_new))
        swaps = [(f'"rank":{old},', f'"rank":{new},'), (f'"node{old // 8}"', f'"node{new // 8}"'),
                 (f'"synthetic-{old}"', f'"synthetic-{new}"'),
                 (f'"tp{tp_old}"', f'"tp{tp_new}"'),
                 (str(list(range(tp_old * TP, tp_old * TP + TP))).replace(" ", ""),
                  str(list(range(tp_new * TP, tp_new * TP + TP))).replace(" ", "")),
                 (str(pp_old_ranks).replace(" ", ""), str(pp_new_ranks).replace(" ", ""))]
        for a in pp_old_ranks:          # p2p keys: ["p","pp8",src,dst,seq]
            for b in pp_old_ranks:
                if abs(a - b) == TP:
                    swaps.append((f'"{pp_old}",{a},{b},', f'"{pp_new}",{a + delta},{b + delta},'))
        swaps.append((f'"{pp_old}"', f'"{pp_new}"'))
        for a, b in swaps:
            text = text.replace(a, b)
        return text


def _make_ranks(run_dir: Path, world: int, ranks: range, shape: Shape = _own,
                planted: frozenset[int] = frozenset()) -> None:
    groups = _groups(world)
    derived = None
    for rank in ranks:
        if rank // REPLICA in planted:
            art = _artifact(rank, world, groups)
            if rank in DETAIL or rank == world - 1:
                artifact.save(art, artifact.matched_path(run_dir, rank))
            table_path(run_dir, rank).write_text(_table_text(art, shape))  # as its node writes it
            continue
        derived = derived or _Derived(world, shape)
        table_path(run_dir, rank).write_text(derived.text(rank))


def write_tables(run_dir: Path, world: int, shape: Shape = _own, more: tuple[int, ...] = ()
                 ) -> None:
    """Every rank's comm table, by as many processes as there are cores: the planted replicas
    (``planted_replicas``) rank by rank, the others derived from the template's tables."""
    if world % REPLICA:
        raise SystemExit(f"{world} ranks: a multiple of {REPLICA} (TP {TP} x PP {PP}) is needed")
    run_dir.mkdir(parents=True, exist_ok=True)
    planted = frozenset(planted_replicas(world, more))
    cores = len(os.sched_getaffinity(0))
    step = -(-world // (4 * cores))
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(cores, mp_context=ctx) as pool:
        for got in [pool.submit(_make_ranks, run_dir, world, range(a, min(a + step, world)),
                                shape, planted) for a in range(0, world, step)]:
            got.result()


def make_run(run_dir: Path, world: int, detail_traces: Path) -> None:
    """Every rank's comm table, as its node makes it from its matched run; the matched runs
    stay on the nodes (a tables-only gather) except the detail ranks' and the last rank's.
    A kept run dir made alike is reused."""
    made = {"world": world, "schedule": len(_schedule()), "late": [LATE_RANK, LATE_NS],
            "desync": [desync_rank(world), DESYNC_N], "pp": [PP, MICRO]}
    marker = run_dir / MADE
    if marker.is_file() and json.loads(marker.read_text()) == made:
        return
    write_tables(run_dir, world)
    for path in detail_traces.iterdir():                # the detail ranks' own traces
        shutil.copy(path, run_dir / path.name)
    marker.write_text(json.dumps(made))


SAMPLE = 4


def _gather_rank(rank: int, base: str, port: int, tables: list[str]) -> None:
    """One gloo process of the gather measurement: its own run dir, one sampled comm table."""
    import torch.distributed as dist

    import commviz

    node = Path(base) / f"node{rank}"
    node.mkdir(parents=True, exist_ok=True)
    shutil.copy(tables[rank], table_path(node, rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=SAMPLE)
    commviz.gather(node, mode="tables")
    dist.destroy_process_group()


def gather_bytes(run_dir: Path, world: int, base: Path) -> dict[int, int]:
    """Bytes rank 0 received from each sampled rank through the real tables-only gather."""
    import socket

    import torch.multiprocessing as mp

    from commviz.gathered import load_summary

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sample = [0, LATE_RANK, world // 2, world - 1]
    tables = [str(table_path(run_dir, r)) for r in sample]
    mp.spawn(_gather_rank, args=(str(base), port, tables), nprocs=SAMPLE, join=True)
    received = load_summary(base / "node0")["received"]
    return {sample[int(r)]: n for r, n in received.items() if int(r) != 0}


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(kind: str, run_dir: str, out: str) -> None:
    import resource

    t = time.perf_counter()
    if kind == "overview":
        from commviz.review.overview import write_overview

        res = write_overview(run_dir, out, progress=False)
        extra: dict[str, Any] = {"kept": sorted(res.kept), "folded": res.folded,
                                 "desyncs": len(res.desyncs), "stragglers": res.stragglers}
    else:
        from commviz.merge import merge_run

        merged = merge_run(run_dir, out, progress=False, ranks=DETAIL)
        extra = {"ranks": merged.stats["merged_ranks"], "problems": len(merged.problems)}
    wall = time.perf_counter() - t
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(json.dumps({"seconds": wall, "cpu": me.ru_utime + me.ru_stime,
                      "cpu_children": kids.ru_utime + kids.ru_stime, "rss_mib": _hwm_mib(),
                      "children_rss_mib": kids.ru_maxrss / 1024,
                      "bytes": Path(out).stat().st_size, **extra}))


def _timed(fn: Callable[..., None], *args: Any) -> dict[str, float]:
    """Wall and CPU seconds (this process and its children) of ``fn(*args)``."""
    import resource

    def cpu() -> float:
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
    t, c = time.perf_counter(), cpu()
    fn(*args)
    return {"seconds": time.perf_counter() - t, "cpu": cpu() - c}


def over_previous(world: int, figures: list[float], prev: tuple[int, list[float]],
                  widths: tuple[int, ...]) -> str:
    """The line under a size's row: each figure over the previous size's, in its column."""
    was, old = prev
    cells = [f"{v / o:.2f}x" if o else "-" for v, o in zip(figures, old)]
    return (f"{'x' + format(world / was, 'g'):>6} "
            + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + f"   (over {was} ranks)")


def measure(kind: str, run_dir: Path, out: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(run_dir), str(out)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--events", type=int, default=20_000,
                    help="profiler events per detail rank's trace")
    ap.add_argument("--keep", help="keep the run dirs here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="commviz-scale-"))
    try:
        traces = base / "detail-traces"
        gen_traces.write_run(traces, len(DETAIL), args.events, tp=2)
        print(f"machine: {len(os.sched_getaffinity(0))} CPUs; a schedule of {len(_schedule())} "
              f"slots (collectives, pipeline transfers); detail ranks {DETAIL[0]}-{DETAIL[-1]} with ~{args.events} trace "
              "events each")
        print(f"{'ranks':>6} {'tables s':>8} {'CPU s':>6} {'overview s':>10} {'CPU s':>11} "
              f"{'RSS MiB':>11} {'MB out':>7} {'kB/rank':>7} {'kept':>9} {'detail8 s':>9} "
              f"{'RSS MiB':>8} {'MB out':>7} {'gathered B/rank':>22} {'matched B/rank':>14} "
              f"{'load':>9}")
        prev: tuple[int, list[float]] | None = None
        for world in (int(s) for s in args.sizes.split(",")):
            run_dir = base / f"run{world}"
            made = _timed(make_run, run_dir, world, traces)
            load = os.getloadavg()[0]
            ov = measure("overview", run_dir, base / f"overview{world}.pftrace")
            load_after = os.getloadavg()[0]
            de = measure("detail", run_dir, base / f"detail{world}.pftrace")
            got = gather_bytes(run_dir, world, base / f"gather-run{world}")
            sent = "/".join(str(got[r]) for r in sorted(got))
            matched = artifact.matched_path(run_dir, world - 1).stat().st_size
            cpu = f"{ov['cpu']:.1f}" + (f"+{ov['cpu_children']:.1f}" if ov["cpu_children"] else "")
            rss = f"{ov['rss_mib']:.0f}" + (f"/{ov['children_rss_mib']:.0f}"
                                            if ov["cpu_children"] else "")
            kept = ",".join(map(str, ov["kept"])) if ov["folded"] else "all"
            print(f"{world:>6} {made['seconds']:>8.1f} {made['cpu']:>6.1f} {ov['seconds']:>10.2f} "
                  f"{cpu:>11} {rss:>11} "
                  f"{ov['bytes'] / 1e6:>7.2f} {ov['bytes'] / world / 1e3:>7.3f} {kept:>9} "
                  f"{de['seconds']:>9.2f} {de['rss_mib']:>8.0f} {de['bytes'] / 1e6:>7.2f} "
                  f"{sent:>22} {matched:>14} {load:>4.1f}-{load_after:<4.1f}")
            figures = [made["seconds"], made["cpu"], ov["seconds"],
                       ov["cpu"] + ov["cpu_children"], ov["rss_mib"], ov["bytes"],
                       ov["bytes"] / world]
            if prev is not None:
                print(over_previous(world, figures, prev, (8, 6, 10, 11, 11, 7, 7)))
            prev = (world, figures)
            if not args.keep:
                shutil.rmtree(run_dir)
        # bytes gathered vs trace size: one rank's matched run with more and more GPU ops
        print("\nbytes rank 1 sends to rank 0 (its comm table) as its trace grows:")
        for extra in (0, 50_000, 500_000):
            d = base / f"gather{extra}"
            d.mkdir()
            art = _artifact(1, 64, _groups(64))
            art.gpu_ops += [GpuOp(1, 7, f"void gemm_kernel<{i % 97}>", "kernel", T0 + 10 * i,
                                  T0 + 10 * i + 5, False) for i in range(extra)]
            artifact.save(art, artifact.matched_path(d, 1))
            write_table(d, 1)
            print(f"  {len(art.gpu_ops):>7} GPU ops: matched run "
                  f"{artifact.matched_path(d, 1).stat().st_size:>10} B, comm table "
                  f"{table_path(d, 1).stat().st_size:>7} B")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
