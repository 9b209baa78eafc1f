"""Bandwidth with nccl-tests' definitions: the formulas per collective type, and the size each
type reports from the metadata of real gloo collectives on 3 ranks (so 2(n-1)/n = 4/3 and
(n-1)/n = 2/3 tell the factors apart)."""

from __future__ import annotations

import math

import pytest
import torch

from commviz import metadata as md
from commviz.match.model import CommEvent, InstanceKey, KeyKind, Source, events_from_record
from commviz.record.store import load_record
from commviz.merge import bandwidth as bw
from commviz.merge.instances import build_instances
from harness import run_ranks

WORLD = 3
COUNT = 1024          # elements per rank's part
ESIZE = 4             # float32


# -- the formulas, on figures worked out by hand -------------------------------------------------

@pytest.mark.parametrize("ctype, n, factor", [
    ("all_reduce", 8, 1.75), ("all_reduce", 2, 1.0), ("all_reduce", 3, 4 / 3),
    ("all_gather", 8, 0.875), ("reduce_scatter", 8, 0.875), ("all_to_all", 8, 0.875),
    ("gather", 4, 0.75), ("scatter", 4, 0.75),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("p2p", 2, 1.0),
])
def test_bus_factor_per_type(ctype, n, factor):
    assert bw.bus_factor(ctype, n) == pytest.approx(factor)


def test_barrier_and_unknown_types_have_no_bandwidth():
    assert bw.bus_factor("barrier", 8) is None
    assert bw.bandwidth("barrier", 0, 1000, 8) is None
    assert bw.bandwidth("other", 1 << 20, 1000, 8) is None


def test_all_reduce_one_gib_in_ten_ms_on_eight_ranks():
    # nccl-tests prints algbw = S / t in GB (1e9 bytes) per second
    got = bw.bandwidth("all_reduce", 1 << 30, 10_000_000, 8)
    assert got.algbw_gbps == pytest.approx(107.3741824)
    assert got.busbw_gbps == pytest.approx(107.3741824 * 1.75)


def test_zero_or_missing_time_gives_no_bandwidth():
    assert bw.bandwidth("all_reduce", 1024, 0, 2) is None
    assert bw.bandwidth("all_reduce", 1024, None, 2) is None
    assert bw.bandwidth("all_reduce", None, 1000, 2) is None


def test_size_from_profiler_metadata_without_commviz_bytes():
    # what an eager NCCL kernel carries: nelems and a c10 dtype name, no commviz.bytes_*
    args = {"Collective name": "_allgather_base", "In msg nelems": 1024, "Out msg nelems": 8192,
            "dtype": "BFloat16"}
    assert bw.collective_type(args) == "all_gather"
    assert bw.size_bytes(args) == 8192 * 2
    assert bw.size_bytes({"dtype": "NoSuchType", "In msg nelems": 4}) is None


# -- sizes of real collectives -------------------------------------------------------------------

def _every_type(rank: int, world: int, run_dir: str) -> None:
    import commviz
    import commviz.distributed as dist

    commviz.start(run_dir, flush_interval=None)
    c = COUNT
    part = torch.ones(c)
    dist.all_reduce(part)
    dist.all_gather_into_tensor(torch.empty(c * world), part)
    dist.all_gather([torch.empty(c) for _ in range(world)], part)
    dist.reduce_scatter_tensor(torch.empty(c), torch.ones(c * world))
    dist.reduce_scatter(torch.empty(c), [torch.ones(c) for _ in range(world)])
    dist.all_to_all_single(torch.empty(c * world), torch.ones(c * world))
    try:
        dist.all_to_all([torch.empty(c) for _ in range(world)],
                        [torch.ones(c) for _ in range(world)])
    except RuntimeError:        # gloo has list all_to_all only from torch 2.13 on
        pass
    dist.broadcast(part, src=0)
    dist.reduce(part, dst=0)
    dist.gather(part, [torch.empty(c) for _ in range(world)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(c), [torch.ones(c) for _ in range(world)] if rank == 0 else None,
                 src=0)
    if rank == 0:
        dist.send(part, dst=1)
    elif rank == 1:
        dist.recv(torch.empty(c), src=0)
    dist.barrier()
    commviz.flush()


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bw") / "run"
    run_ranks(_every_type, WORLD, str(run_dir))
    events = [ev for r in range(WORLD)
              for ev in events_from_record(load_record(run_dir / f"commviz_rank{r}.pkl"))]
    return {i.op: i for i in build_instances(events)}


# nccl-tests' doc/PERFORMANCE.md and its per-test ``GetBw`` (all_reduce.cu, all_gather.cu, ...):
# busbw = algbw * factor, n ranks. Written here, not taken from commviz.
NCCL_TESTS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}

PART = COUNT * ESIZE
# op -> (nccl-tests type, S in bytes as nccl-tests reports it: the whole buffer of the
# all-to-all side, e.g. all_gather's output and reduce_scatter's input)
EXPECTED = {
    "all_reduce": ("all_reduce", PART),
    "all_gather_into_tensor": ("all_gather", WORLD * PART),
    "all_gather": ("all_gather", WORLD * PART),
    "reduce_scatter_tensor": ("reduce_scatter", WORLD * PART),
    "reduce_scatter": ("reduce_scatter", WORLD * PART),
    "all_to_all_single": ("all_to_all", WORLD * PART),
    "all_to_all": ("all_to_all", WORLD * PART),
    "broadcast": ("broadcast", PART),
    "reduce": ("reduce", PART),
    "gather": ("gather", WORLD * PART),
    "scatter": ("scatter", WORLD * PART),
}
# c10d's send and recv only enqueue (torch's send() waits afterwards, outside c10d): their
# records are launch-only on gloo, and give no bandwidth (on GPUs their kernels do)
LAUNCH_ONLY = {"send": ("p2p", PART)}


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_size_and_bandwidth_of_each_type(instances, op):
    ctype, size = EXPECTED[op]
    inst = instances[op]
    if any(md.ERROR in e.args for e in inst.events.values()):
        assert inst.bandwidth is None and inst.comm_ns is None     # a failed call moved nothing
        pytest.skip(f"{op}: {inst.events[0].args[md.ERROR]}")
    assert inst.ctype == ctype
    assert inst.size_bytes == size
    assert sorted(inst.events) == ([0, 1] if ctype == "p2p" else list(range(WORLD)))
    assert inst.comm_ns is not None and inst.comm_ns > 0
    got = inst.bandwidth
    assert got is not None and got.time_ns == inst.comm_ns
    seconds = inst.comm_ns / 1e9
    assert got.algbw_gbps == pytest.approx(size / seconds / 1e9)
    n = 2 if ctype == "p2p" else WORLD
    assert got.busbw_gbps == pytest.approx(got.algbw_gbps * NCCL_TESTS_FACTOR[ctype](n))


@pytest.mark.parametrize("op", sorted(LAUNCH_ONLY))
def test_launch_only_p2p_has_size_but_no_bandwidth(instances, op):
    ctype, size = LAUNCH_ONLY[op]
    inst = instances[op]
    assert (inst.ctype, inst.size_bytes, sorted(inst.events)) == (ctype, size, [0, 1])
    assert inst.launch_only and inst.bandwidth is None


def test_barrier_gets_no_bandwidth(instances):
    inst = instances["barrier"]
    assert inst.size_bytes == 0 and inst.bandwidth is None
    assert math.isfinite(inst.skew_ns)


@pytest.mark.parametrize("kind", [KeyKind.PROFILER, KeyKind.USER, KeyKind.COLLECTIVE])
def test_bus_factor_counts_the_group_whatever_numbers_the_instance(kind):
    """An all_reduce of 1 GiB over 4 ranks in 10 ms, numbered by commviz, by an annotation or
    (no record) by the profiler: busbw = 1 GiB / 10 ms x 2(4-1)/4, worked out by hand."""
    args = {md.COLLECTIVE_NAME: "allreduce", md.IN_NELEMS: 1 << 28, md.OUT_NELEMS: 1 << 28,
            md.DTYPE: "Float", md.PG_NAME: "0", md.PG_RANKS: "[0, 1, 2, 3]"}
    key = InstanceKey(kind, "0", 7)
    events = [CommEvent(rank=r, pg="0", op="all_reduce", start_ns=1_000_000,
                        end_ns=11_000_000, args=args, key=key, source=Source.KERNEL)
              for r in range(4)]
    (inst,) = build_instances(events)
    assert inst.size_bytes == 1 << 30 and inst.comm_ns == 10_000_000
    assert inst.bandwidth.algbw_gbps == pytest.approx(107.3741824)
    assert inst.bandwidth.busbw_gbps == pytest.approx(107.3741824 * 1.5)
