"""``annotate_collective``'s profiler ranges on real gloo ranks: one ``commviz::<name>`` range
a block, carrying no metadata of commviz's (every arg would cost the job about a µs);
``commviz annotate TRACE RECORD`` gives each range its own block's metadata, paired by time, even
where one line runs many blocks (a block's number and sizes are its own, not the line's first
block's), checked against torch's Flight Recorder (number, elements, dtype) and the test
program's own sizes and line."""

from __future__ import annotations

import gzip
import inspect
import json
from pathlib import Path
from typing import Any

import torch

import commviz
from commviz import metadata as md
from commviz.cli import main
from fr_compare import FR_ENV, snapshot
from harness import run_ranks

SIZES = (4, 4, 8, 8, 4)          # one line's blocks: the size changes twice


def _job(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch.distributed as td

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    with commviz.profile(run_dir):
        for n in SIZES:
            t = torch.ones(n)
            line = inspect.currentframe().f_lineno + 1
            with commviz.annotate_collective("my_allreduce", t, t, note="custom"):
                td.all_reduce(t)
        with commviz.annotate_collective("all_gather", torch.ones(4), [torch.zeros(4)] * 2):
            pass                                      # no c10d call inside
    snap = snapshot()
    snap["line"] = line
    commviz.RECORDER.flush()
    return snap


def _ranges(path: Path, name: str) -> list[dict[str, Any]]:
    """The args of the trace's events called ``name``, in time order."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e["args"] for e in sorted((e for e in events if e.get("name") == name),
                                      key=lambda e: e["ts"])]


def test_each_block_has_its_own_range_args(tmp_path: Path) -> None:
    snaps = run_ranks(_job, 2, str(tmp_path), env=FR_ENV)
    for rank, snap in enumerate(snaps):
        fr = [e for e in snap["fr"] if e["name"] == "gloo:all_reduce"]
        trace = tmp_path / f"trace_rank{rank}.json.gz"
        blocks = [r for r in snap["records"] if r[md.OP] == "my_allreduce"]
        # the bare trace: a range a block, none with a key of its record (the profiler's own
        # args aside)
        bare = _ranges(trace, "commviz::my_allreduce")
        assert len(bare) == len(SIZES) and all(not set(a) & set(rec)
                                               for a, rec in zip(bare, blocks))
        annotated = tmp_path / f"annotated_rank{rank}.json"
        assert main(["annotate", str(trace), str(tmp_path / f"commviz_rank{rank}.pkl"),
                     "-o", str(annotated)]) == 0
        ranges = _ranges(annotated, "commviz::my_allreduce")
        assert [e["in"] for e in fr] == list(SIZES)
        assert [a[md.IN_NELEMS] for a in ranges] == [a[md.OUT_NELEMS] for a in ranges] == \
            list(SIZES)
        assert [a[md.SEQ] for a in ranges] == [e["seq"] for e in fr]
        assert [a[md.DTYPE] for a in ranges] == [e["dtypes"][0] for e in fr]
        assert [a[md.BYTES_IN] for a in ranges] == [4 * n for n in SIZES]
        site = f"{__file__}:{snap['line']}"
        assert {(a[md.CALLSITE], a[md.RANK], a["note"]) for a in ranges} == \
            {(site, rank, "custom")}
        # the annotated range's args are the block's record, its times included
        assert len(blocks) == len(ranges)
        for args, rec in zip(ranges, blocks):
            assert {k: args.get(k) for k in rec} == rec
        (gather,) = _ranges(annotated, "commviz::all_gather")
        assert (gather[md.IN_NELEMS], gather[md.OUT_NELEMS]) == (4, 8)
