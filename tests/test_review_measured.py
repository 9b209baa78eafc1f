"""The report says, per process group, how much of its comm time was measured and how much is
launch only, and why: a real 2-rank gloo job mixing synchronous collectives (the call returns
when the transfer is done: measured) with functional collectives and ``async_op=True`` calls
(the call returns once the work is queued: launch only). The expected counts are what the
program issues (a hand count), each group's total is Flight Recorder's, and every transfer has
its worker range in the profiler's own events (``gloo:<op>``), as the report's reason says.

Whether an async call's worker range lies inside some ``c10d::`` op of its thread is a race (a
later call may span it), which is why the report does not pair them and this test does not
count them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from commviz.review.render.report_formats import (render_markdown, render_table, to_json,
                                                  write_report)
from fr_compare import FR_ENV, compare
from harness import run_ranks

STEPS = 3
# per step, by hand: world: all_reduce, broadcast (sync), all_reduce(async_op=True) + wait();
# tp: a functional all_reduce and all_gather (async on gloo)
WORLD_SYNC, WORLD_ASYNC, TP_ASYNC = 2, 1, 2


def _job(rank: int, world: int, run_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import commviz
    from fr_compare import snapshot

    commviz.start(run_dir)
    tp = dist.new_group([0, 1], group_desc="tp")
    with commviz.profile(run_dir, record_shapes=True):
        for _ in range(STEPS):
            t = torch.ones(1 << 14) * (rank + 1)
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            x = funcol.all_reduce(t, "sum", tp)
            y = funcol.all_gather_tensor(t, 0, tp)
            float((x + 1).sum() + y.sum())          # waits for both
            dist.all_reduce(t, async_op=True).wait()
    snap = snapshot()                       # before the gather's own side group
    commviz.gather(run_dir)
    return {"snap": snap, "world": dist.group.WORLD.group_name, "tp": tp.group_name}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("measured") / "run"
    results = run_ranks(_job, 2, str(run_dir), env=FR_ENV)
    return run_dir, results


def _worker_ranges(trace: Path) -> int:
    """The profiler's own ranges of gloo's worker threads (``gloo:<op>``): one per transfer,
    the async ones' included, which the report says nothing ties to their call."""
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sum(e.get("ph") == "X" and str(e.get("name")).startswith("gloo:") for e in events)


@pytest.mark.slow
def test_each_groups_measured_and_launch_only_share(job) -> None:
    run_dir, results = job
    names = results[0]
    for snap in results:
        counts = compare(snap["snap"])               # every record is Flight Recorder's
        assert sum(counts[names["world"]].values()) == STEPS * (WORLD_SYNC + WORLD_ASYNC)
        assert sum(counts[names["tp"]].values()) == STEPS * TP_ASYNC
    for rank in (0, 1):
        (trace,) = run_dir.glob(f"trace_rank{rank}*.json.gz")
        assert _worker_ranges(trace) == STEPS * (WORLD_SYNC + WORLD_ASYNC + TP_ASYNC)

    result = write_report(run_dir, fmt="json", plots=False)
    doc = json.loads(result.text)
    groups = {g["pg"]: g for g in doc["groups"]}
    world, tp = groups[names["world"]], groups[names["tp"]]
    assert (world["count"], world["measured"], world["launch_only"], world["unmeasured"]) == \
        (STEPS * 3, STEPS * WORLD_SYNC, {"async": STEPS * WORLD_ASYNC}, STEPS * WORLD_ASYNC)
    assert (tp["count"], tp["measured"], tp["launch_only"], tp["comm_ns"]) == \
        (STEPS * TP_ASYNC, 0, {"async": STEPS * TP_ASYNC}, 0)
    size = (1 << 14) * 4
    assert world["measured_bytes"] == STEPS * WORLD_SYNC * size
    assert tp["launch_only_bytes"] == STEPS * (size + 2 * size)     # all_reduce + all_gather out
    assert list(doc["launch_only_why"]) == ["async"]
    assert "functional collective" in doc["launch_only_why"]["async"]
    reasons = {i["launch_reason"] for i in doc["instances"] if i["pg"] == names["tp"]}
    assert reasons == {"async"}

    review = result.review
    md_text = render_markdown(review)
    table = render_table(review, width=400)
    for text in (md_text, " ".join(table.split())):      # the table's notes wrap
        assert "6 of 9 (67 %); launch only: 3 async" in text
        assert "0 of 6; launch only: 6 async" in text
        assert "comm time not measured (launch only) for 9 of 15 instances" in text
        assert "launch only (async): async_op=True, isend/irecv or a functional collective" in text
    assert to_json(review)["groups"] == doc["groups"]


def test_gpu_calls_outside_the_profiled_step_are_launch_only_for_want_of_a_kernel(
        tmp_path) -> None:
    """The 2 x H200 eager fixture: each group's calls before the profiled step have no kernel
    in the trace, and those of the step do (the profiler's NCCL kernels carry each group's
    name): the report says "no kernel", never "async", and the rest are measured."""
    import shutil

    from commviz.review.analyses.reviewing import review_run

    fixture = Path(__file__).parent / "fixtures" / "gpu" / "eager"
    run_dir = Path(shutil.copytree(fixture, tmp_path / "run"))
    kernels: dict[str, int] = {}
    (trace,) = run_dir.glob("trace_rank0.json.gz")
    for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]:
        pg = (e.get("args") or {}).get("Process Group Name")
        if e.get("cat") == "kernel" and pg is not None:
            kernels[pg] = kernels.get(pg, 0) + 1
    review = review_run(run_dir)
    assert {g.pg for g in review.groups} == set(kernels)
    for g in review.groups:
        assert set(g.launch_only) == {"no kernel"}, g
        assert 0 < g.measured and g.measured + g.launch_only["no kernel"] == g.count
    doc = to_json(review)
    assert list(doc["launch_only_why"]) == ["no kernel"]
    assert "NCCL" in doc["launch_only_why"]["no kernel"]
