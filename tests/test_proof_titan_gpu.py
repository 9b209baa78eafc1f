"""torchtitan's own Trainer on 4 x H200 (FSDP2 x TP, full activation checkpointing, compiled),
checked without a GPU, and the origin of a compiled graph's backward on CPU.

``fixtures/gpu/titan-fsdp-tp-4xh200/`` (README beside it): every NCCL kernel the profiler
traced carries commviz's metadata after ``commviz merge``, named by the record whose
profiler keys it has (the int64 all-reduces NCCL runs in its ``u64`` kernel included); every
record agrees with torch's Flight Recorder dumps (NCCL's barrier, which it runs as an
all-reduce of one Float, included).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from harness import run_ranks, script_module

HERE = Path(__file__).parent
RUN = HERE / "fixtures" / "gpu" / "titan-fsdp-tp-4xh200"
WORLD = 4
EAGER = ("Collective name", "dtype", "In msg nelems", "Out msg nelems", "Process Group Name")


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run copied and merged with the real CLI, once."""
    run = shutil.copytree(RUN, tmp_path_factory.mktemp("titan") / RUN.name)
    got = subprocess.run([sys.executable, "-m", "commviz", "merge", str(run)],
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    return run


def _profiler_kernels() -> dict[int, list[dict[str, Any]]]:
    """Per rank, the profiler's own keys on each NCCL kernel of its trace (no commviz)."""
    import gzip
    import json

    out = {}
    for rank in range(WORLD):
        trace = json.loads(gzip.decompress((RUN / f"trace_rank{rank}_step4.json.gz").read_bytes()))
        out[rank] = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"
                     and "nccl" in e.get("name", "").lower()]
    return out


def test_every_nccl_kernel_named_and_agreeing_with_torch(merged: Path) -> None:
    proof = script_module("gpu_proof")
    row = proof.prove(merged, None)
    kernels = _profiler_kernels()
    assert row["kernels"] == sum(map(len, kernels.values())) and row["named"] == row["kernels"], row
    for key in proof.MUST_BE_ZERO:
        assert row.get(key, 0) == 0, (key, row)
    assert row["verify"] == "OK" and row["fr_dumps"] == WORLD, row
    assert row["lanes"] > 0 and row["links"] > 0, row


def test_each_kernel_labelled_as_its_profiler_keys_say() -> None:
    """The matcher labels every NCCL kernel with a record whose eager keys are the profiler's
    own on that kernel; among them the int64 sums NCCL runs in its unsigned kernel."""
    from commviz.match import match_run
    from commviz.trace.run import load_run

    profiler = _profiler_kernels()
    matches = match_run(load_run(RUN))
    unsigned = 0
    for rank, m in matches.items():
        assert m.unmatched == [] and m.conflicts == [], (rank, m.unmatched[:3])
        events = [ev for ev in m.events if ev.extra.get("trace_index") is not None]
        assert len(events) == len(profiler[rank]), rank
        by_index = {ev.extra["trace_index"]: ev.args for ev in events}
        trace = next(iter(load_run(RUN).ranks[rank].load_traces([])))
        got = Counter(tuple(str(by_index[i].get(k)) for k in EAGER) for i in by_index)
        want = Counter(tuple(str(e["args"].get(k)) for k in EAGER) for e in profiler[rank])
        assert got == want, rank
        for i, args in by_index.items():
            if "_u64_" in trace.events[i]["name"]:
                unsigned += 1
                assert args["dtype"] == trace.events[i]["args"]["dtype"] == "Long", args
    # the profiler's own count: int64 all-reduces in the profiled steps, on every rank
    assert unsigned == sum(e["args"].get("dtype") == "Long" for ks in profiler.values()
                           for e in ks) > 0


def test_every_record_agrees_with_flight_recorder_barrier_included() -> None:
    import fr_compare

    from commviz.record.store import loads_plain
    from commviz.trace.run import load_run

    run = load_run(RUN)
    for rank, item in sorted(run.ranks.items()):
        path = RUN / "flight_recorder" / f"rank_{rank}"
        dump = loads_plain(path.read_bytes(), str(path))
        barriers = [e for e in dump["entries"] if e["profiling_name"] == "nccl:all_reduce_barrier"]
        snap = fr_compare.from_dump(dump, item.record["collectives"])
        counts = fr_compare.compare(snap)
        entries = sum(not e["p2p"] and not e["name"].endswith(":coalesced") for e in snap["fr"])
        assert sum(sum(c.values()) for c in counts.values()) == entries, rank
        assert len(barriers) == sum(c["barrier"] for c in counts.values()) == 1, rank


def test_nccl_barrier_is_compared_as_torch_runs_it() -> None:
    """A barrier's entry that is not NCCL's one-Float all-reduce is a difference."""
    import fr_compare

    entry = {"group": "0", "desc": "default_pg", "seq": 1, "p2p": False, "p2p_seq": None,
             "name": "nccl:all_reduce_barrier", "in": 1, "out": 1, "dtypes": ["Float"]}
    record = {"commviz.kind": "collective", "commviz.op": "barrier", "commviz.seq": 1,
              "Process Group Name": "0", "Process Group Ranks": "[0, 1]", "Group size": 2,
              "In msg nelems": 0, "Out msg nelems": 0, "dtype": "Byte"}
    groups = {"0": {"ranks": [0, 1], "desc": "default_pg"}}
    assert fr_compare.differences({"fr": [entry], "groups": groups, "records": [record]})[0] == []
    wrong = {**entry, "in": 2, "out": 2}
    assert fr_compare.differences({"fr": [wrong], "groups": groups, "records": [record]})[0]


def _compiled_job(rank: int, world: int, run_dir: str) -> list[dict[str, Any]]:
    """A compiled function whose forward all-gathers (functional, with autograd) and whose
    backward therefore reduce-scatters, three steps."""
    import torch
    import torch.distributed._functional_collectives as fc

    import commviz

    commviz.start(run_dir)

    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gathered = fc.all_gather_tensor_autograd(x * w, 0, torch.distributed.group.WORLD)
        return (gathered * gathered).sum()

    compiled = torch.compile(region, backend="aot_eager")
    x, w = torch.randn(4, 8), torch.randn(4, 8, requires_grad=True)
    for _ in range(3):
        compiled(x, w).backward()
    records = [dict(r) for r in commviz.RECORDER.records()]
    commviz.flush()
    return records


@pytest.mark.slow
def test_a_compiled_graphs_backward_reads_as_its_region(tmp_path: Path) -> None:
    """The reduce-scatter a compiled graph's backward issues is the compiled region's, in its
    backward (not the line that called ``backward()``, nor 'no Python caller')."""
    for records in run_ranks(_compiled_job, 2, str(tmp_path), timeout=300):
        ops = Counter((r["commviz.op"], r["commviz.origin"], r.get("commviz.origin_phase"))
                      for r in records)
        here = Path(__file__).name
        line = _compiled_job.__code__.co_firstlineno
        assert ops == {
            ("all_gather_into_tensor_coalesced", f"Torch-Compiled Region: "
             f"_compiled_job.<locals>.region ({here}:{line + 10})", None): 3,
            ("reduce_scatter_tensor_coalesced", f"Torch-Compiled Region: "
             f"_compiled_job.<locals>.region ({here}:{line + 10}) backward", "backward"): 3,
        }, ops
