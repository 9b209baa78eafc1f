"""Scale benchmark: ``commviz overview`` of 64, 256 and 1,024 ranks, and a detail merge of 8.

Each simulated run dir holds one matched run per rank, made by commviz's own code
(``commviz.match.artifact.RankArtifact``, saved with ``artifact.save``) from synthetic matched
collectives shaped like a TP × DP job (TP groups of 8, DP groups across them, one world
all_reduce per step, eager keys and commviz keys on every event, a GPU op per kernel), and the
comm table each rank's node makes from it (``commviz.merge.table.write_table``). Rank 5 is
late by 4 ms at every third DP collective (its DP peers wait). The 8 ranks of the detail merge also get real-shaped
profiler traces (``scripts/gen_traces.py``) and records; the others have none, as on a job
whose ranks kept their traces on their nodes.

Printed per size: time and peak RSS of the overview and of the detail merge (each in a child
process of its own, Linux VmHWM), the bytes rank 0 received per rank through the real tables-only
gather (``commviz.gather(mode="tables")`` on 4 gloo processes, each in a run dir of its own
holding one sampled rank's comm table: ranks 0, 5, world/2 and world-1), beside one rank's
matched run, and the output sizes. Then one rank's matched run and comm table as its trace
grows (more GPU ops, the same collectives): the bytes gathered do not grow with the trace.

    .venv/bin/python scripts/bench_scale.py                  # 64, 256, 1024 ranks
    .venv/bin/python scripts/bench_scale.py --sizes 64 --keep /tmp/scale
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_traces  # noqa: E402

from commviz import metadata as md  # noqa: E402
from commviz.match import artifact  # noqa: E402
from commviz.match.artifact import Clock, PgInfo, RankArtifact  # noqa: E402
from commviz.match.model import CommEvent, Source, instance_key  # noqa: E402
from commviz.merge.table import from_artifact, table_path, write_table  # noqa: E402
from commviz.merge.table import save as save_table  # noqa: E402
from commviz.trace.gpu import GpuOp  # noqa: E402

TP = 8
STEPS, LAYERS = 2, 16
LATE_RANK, LATE_NS = 5, 4_000_000
DESYNC_N = 60                       # the schedule's collective where one rank's size differs
DETAIL = list(range(8))
T0 = 1_700_000_000_000_000_000


def _groups(world: int) -> dict[str, list[int]]:
    """pg name -> ranks: world "0", TP groups "tp{i}", DP groups "dp{j}"."""
    groups = {"0": list(range(world))}
    for i in range(world // TP):
        groups[f"tp{i}"] = list(range(i * TP, (i + 1) * TP))
    for j in range(TP):
        groups[f"dp{j}"] = list(range(j, world, TP))
    return groups


def _schedule() -> list[tuple[str, str, int]]:
    """Per step, in issue order: (group kind, op, bytes)."""
    out = []
    for _ in range(STEPS):
        for _layer in range(LAYERS):
            out += [("tp", "all_reduce", 8 << 20), ("tp", "all_reduce", 8 << 20),
                    ("tp", "all_gather_into_tensor", 4 << 20)]
        for _layer in range(LAYERS // 2):
            out += [("dp", "reduce_scatter_tensor", 32 << 20), ("dp", "all_gather_into_tensor",
                                                                 32 << 20)]
        out.append(("world", "all_reduce", 4))
    return out


def _artifact(rank: int, world: int, groups: dict[str, list[int]]) -> RankArtifact:
    """One rank's matched run: each collective a kernel on stream 7, with its GPU op."""
    rng = random.Random(rank)
    mine = {"tp": f"tp{rank // TP}", "dp": f"dp{rank % TP}", "world": "0"}
    seqs: dict[str, int] = {}
    events, ops = [], []
    for n, (kind, op, size) in enumerate(_schedule()):
        pg = mine[kind]
        seqs[pg] = seqs.get(pg, 0) + 1
        base = T0 + n * 6_000_000                             # one collective every 6 ms
        late = kind == "dp" and n % 3 == 0 and LATE_RANK in groups[pg]
        t = base + rng.randrange(20_000) + (LATE_NS if late and rank == LATE_RANK else 0)
        dur = (LATE_NS if late else 0) + 50_000 + size // 40_000 - (t - base)
        ranks = groups[pg]
        if n == DESYNC_N and rank == desync_rank(world):
            size *= 2                                       # its peers disagree: a desync
        args = {md.COLLECTIVE_NAME: op.replace("_tensor", "").replace("_into", ""),
                md.IN_NELEMS: size // 2, md.OUT_NELEMS: size // 2, md.GROUP_SIZE: len(ranks),
                md.DTYPE: "BFloat16", md.PG_NAME: pg, md.PG_DESC: pg.rstrip("0123456789"),
                md.PG_RANKS: str(ranks), md.OP: op, md.KIND: "collective", md.SEQ: seqs[pg],
                md.RANK: rank, md.BYTES_IN: size, md.BYTES_OUT: size,
                md.CALLSITE: "train.py:120", md.LANE: md.lane_id(pg), md.DEVICE: "cuda",
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


def make_run(run_dir: Path, world: int, detail_traces: Path) -> None:
    """Every rank's comm table, as its node makes it from its matched run; the matched runs
    stay on the nodes (a tables-only gather) except the detail ranks' and the last rank's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    groups = _groups(world)
    for rank in range(world):
        art = _artifact(rank, world, groups)
        if rank in DETAIL or rank == world - 1:
            artifact.save(art, artifact.matched_path(run_dir, rank))
        save_table(from_artifact(art), table_path(run_dir, rank))
    for path in detail_traces.iterdir():                # the detail ranks' own traces
        shutil.copy(path, run_dir / path.name)


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
    t = time.perf_counter()
    if kind == "overview":
        from commviz.review.overview import write_overview

        res = write_overview(run_dir, out, progress=False)
        extra: dict[str, Any] = {"stragglers": res.stragglers, "instances": res.instances}
    else:
        from commviz.merge import merge_run

        merged = merge_run(run_dir, out, progress=False, ranks=DETAIL)
        extra = {"ranks": merged.stats["merged_ranks"], "problems": len(merged.problems)}
    print(json.dumps({"seconds": time.perf_counter() - t, "rss_mib": _hwm_mib(),
                      "bytes": Path(out).stat().st_size, **extra}))


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
        print(f"machine: {os.cpu_count()} CPUs; per rank {len(_schedule())} collectives; "
              f"detail ranks {DETAIL[0]}-{DETAIL[-1]} with ~{args.events} trace events each")
        print(f"{'ranks':>6} {'overview s':>10} {'RSS MiB':>8} {'MB out':>7} "
              f"{'detail8 s':>9} {'RSS MiB':>8} {'MB out':>7} {'gathered B/rank':>22} "
              f"{'matched B/rank':>14} {'stragglers':>12}")
        for world in (int(s) for s in args.sizes.split(",")):
            run_dir = base / f"run{world}"
            make_run(run_dir, world, traces)
            ov = measure("overview", run_dir, base / f"overview{world}.pftrace")
            de = measure("detail", run_dir, base / f"detail{world}.pftrace")
            got = gather_bytes(run_dir, world, base / f"gather-run{world}")
            sent = "/".join(str(got[r]) for r in sorted(got))
            matched = artifact.matched_path(run_dir, world - 1).stat().st_size
            print(f"{world:>6} {ov['seconds']:>10.2f} {ov['rss_mib']:>8.1f} "
                  f"{ov['bytes'] / 1e6:>7.2f} {de['seconds']:>9.2f} {de['rss_mib']:>8.0f} "
                  f"{de['bytes'] / 1e6:>7.2f} {sent:>22} {matched:>14} "
                  f"{json.dumps(ov['stragglers']):>12}")
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
