"""A run dir may hold anything else: commviz reads its own files, the traces it was told of and
the files whose start is a profiler trace, names once what it skipped, and no stray file makes
merge, report or verify fail. And the report's timeline is drawn whatever the trace's size, from
a window of it: a trace above the size limit (lowered here by its parameter) reads only what
the window needs and draws what the whole read draws.

The run is a real 2-rank gloo job under two profiled steps; what the pictures must show is
counted by hand from what the program issues."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import orjson
import pytest

from commviz import cli
from commviz.merge import merge_run
from commviz.review.render.timeline import (default_window, read_timeline, read_window,
                                            report_timeline, write_preview)
from commviz.trace.load import looks_like_trace, read_header
from commviz.trace.run import load_run
from commviz.verify import verify_pftrace
from harness import run_ranks

STEPS = 2
PER_STEP = ["all_reduce", "broadcast", "all_gather"]      # each step's collectives, by hand

# The strays: a user's JSON with a rank in its name (torchtitan's case), binary junk, a JSON
# whose keys are a trace's names holding other things, an empty file; and a file that is no
# JSON at all, which is not even looked at.
STRAYS = {
    "titan_rank0.json": orjson.dumps({"step": 3, "loss": 1.25, "rank": 0}),
    "junk_rank1.json.gz": b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8,
    "notes_rank1.json": orjson.dumps({"traceEvents": {"ph": "X", "ts": 1},
                                      "config": {"traceEvents": [{"ph": "X", "ts": 1}]},
                                      "distributedInfo": {"rank": 1}}),
    "empty_rank0.json": b"",
}
IGNORED = {"blob_rank2.bin": os.urandom(512)}


def _job(rank: int, world: int, run_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import commviz

    commviz.start(run_dir)
    sched = torch.profiler.schedule(wait=0, warmup=0, active=STEPS, repeat=1)
    with commviz.profile(run_dir, schedule=sched) as prof:
        for _ in range(STEPS):
            t = torch.ones(4096) * (rank + 1)
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            out = [torch.zeros(4096) for _ in range(world)]
            dist.all_gather(out, t)
            (t @ t).item()
            prof.step()
    commviz.gather(run_dir)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("stray") / "run"
    run_ranks(_job, 2, str(run_dir))
    return run_dir


@pytest.fixture
def cluttered(recorded: Path, tmp_path: Path) -> Path:
    run_dir = Path(shutil.copytree(recorded, tmp_path / "run"))
    for name, data in {**STRAYS, **IGNORED}.items():
        (run_dir / name).write_bytes(data)
    return run_dir


def _said(text: str) -> str:
    """What a command said of the skipped files, once (asserted), its lines unwrapped."""
    flat = " ".join(text.split())
    assert flat.count("that are neither commviz's nor profiler traces") == 1, text
    return flat


@pytest.mark.slow
def test_strays_are_named_once_and_merge_report_verify_pass(cluttered: Path, capsys) -> None:
    run = load_run(cluttered)
    assert run.problems == [] and sorted(run.ranks) == [0, 1]
    assert sorted(p.name for p in run.skipped) == sorted(STRAYS)
    assert all(p.name.startswith("trace_rank") for inp in run.ranks.values()
               for p in inp.trace_paths)

    assert cli.main(["merge", str(cluttered), "--workers", "1"]) == 0
    err = _said(capsys.readouterr().err)
    assert "problem" not in err and "blob_rank2.bin" not in err
    assert all(err.count(name) == 1 for name in STRAYS)

    assert cli.main(["report", str(cluttered), "--format", "markdown"]) == 0
    out = _said(capsys.readouterr().out)
    assert all(out.count(name) == 1 for name in STRAYS) and "Problems" not in out
    assert (cluttered / "plots" / "timeline.png").is_file()
    assert cli.main(["report", str(cluttered), "--format", "json", "--no-plots"]) == 0
    capsys.readouterr()
    doc = json.loads((cluttered / "report.json").read_text())
    assert sorted(doc["skipped"]) == sorted(STRAYS) and doc["problems"] == []

    merged = cluttered / "merged.pftrace"
    assert cli.main(["verify", str(merged), "--run", str(cluttered)]) == 0
    out = _said(capsys.readouterr().out)           # report.json is commviz's: not named
    assert "OK" in out and all(out.count(name) == 1 for name in STRAYS)
    report = verify_pftrace(merged, inputs=load_run(cluttered))
    assert report.ok and sum(st["matched"] for st in report.inputs.values()) > 0
    assert load_run(cluttered).skipped and load_run(cluttered).problems == []   # again: same


def test_traces_are_told_by_their_start(recorded: Path, tmp_path: Path) -> None:
    """A profiler trace under any name (a user's name, gzip or not, a bare event list) is read;
    the strays are not, whatever their names say."""
    (trace,) = recorded.glob("trace_rank1*.json.gz")
    text = gzip.decompress(trace.read_bytes())
    doc = orjson.loads(text)
    shapes = {"mine.pt.trace.json": text, "pretty.json.gz": gzip.compress(
        json.dumps(doc, indent=2).encode()), "bare.json": orjson.dumps(doc["traceEvents"])}
    for name, data in {**shapes, **STRAYS}.items():
        (tmp_path / name).write_bytes(data)
        assert read_header(tmp_path / name).is_trace is (name in shapes), name
    assert not looks_like_trace('{"traceEvents": []}')
    assert not looks_like_trace('{"run": {"traceEvents": [{"ph": "X"}]}}')
    # a start cut inside a long first value: the key decides where the header ran out
    cut = '{"deviceProperties": [' + '{"a": 1}, ' * 10 + '{"b'
    assert not looks_like_trace(cut) and not looks_like_trace(cut, cut=True)
    assert looks_like_trace('{"traceEvents": [{"ph": "X", "name": "a' + "x" * 50, cut=True)
    # a trace the record lists, or named as commviz names them, is read even when broken:
    # its problem is named (not skipped)
    copy = Path(shutil.copytree(recorded, tmp_path / "run"))
    (broken,) = copy.glob("trace_rank1*.json.gz")
    broken.write_bytes(b"")
    run = load_run(copy)
    assert run.skipped == [] and run.ranks[1].trace_paths == [broken]


@pytest.mark.slow
def test_big_trace_timeline_is_its_window(recorded: Path, tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(recorded, tmp_path / "run"))
    merged = merge_run(run_dir, workers=1, progress=False).out
    whole = read_timeline(merged)
    window = default_window(whole)
    assert window.what == "ProfilerStep#0"
    tl, chosen, got = read_window(merged)
    assert chosen == window and tl.origin_ns == whole.origin_ns
    assert got.passed > 0                       # tracks not drawn, and past the window: unread

    def drawn(t):
        return sorted((ln.rank, ln.title, b) for ln in t.lanes for b in ln.boxes
                      if window.holds(ln.rank, b[0]))
    assert drawn(tl) == drawn(whole)
    small = write_preview(merged, tmp_path / "whole.png")
    big = write_preview(merged, tmp_path / "window.png", whole_max_bytes=0)
    assert (big.collectives, big.compute, big.flows, big.what, big.window_ns) == \
        (small.collectives, small.compute, small.flows, small.what, small.window_ns)
    assert big.collectives == len(PER_STEP) * 2         # one step's calls on both ranks
    assert big.flows == len(PER_STEP)                   # each joined across the two ranks
    plots = tmp_path / "plots"
    written, problems = report_timeline(run_dir, plots, whole_max_bytes=1)
    assert problems == [] and written == [plots / "timeline.png"] and written[0].stat().st_size
    ms = write_preview(merged, tmp_path / "ms.png", window="0:1000", whole_max_bytes=0)
    assert ms.collectives == write_preview(merged, tmp_path / "ms2.png", window="0:1000").collectives
