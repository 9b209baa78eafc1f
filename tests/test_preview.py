"""``commviz preview``: a real merged trace drawn as a PNG. What was drawn is checked against
counts taken from the .pftrace with perfetto's protos directly, from the profiler's own
trace files and from the job's code (a hand count), and the PNG is decoded by matplotlib."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from commviz import cli
from commviz.merge import merge_run
from commviz.review.render.timeline import TIMELINE_PNG, Timeline, Window, draw, read_timeline
from commviz.review.render.report_formats import write_report
from harness import run_ranks

WORLD, STEPS = 4, 2
PER_STEP = 4          # collectives each rank issues per step in _job
EVERYTHING = Window(-(1 << 62), 1 << 62, "everything")
GPU_EAGER = Path(__file__).parent / "fixtures" / "gpu" / "eager"


def _job(rank: int, world: int, run_dir: str) -> None:
    import torch
    import torch.distributed as td

    import commviz

    commviz.start(run_dir)
    groups = {}
    for name, layout in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]])):
        for ranks in layout:
            g = td.new_group(ranks, group_desc=name)
            if rank in ranks:
                groups[name] = g
    td.barrier()                                        # before the profiler: not in a step
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=STEPS, repeat=1)
    with commviz.profile(run_dir, schedule=schedule) as prof:
        for _ in range(STEPS):
            t = torch.ones(256) * (rank + 1)
            td.all_reduce(t)
            td.all_reduce(t, group=groups["tp"])
            td.broadcast(t, group_src=0, group=groups["dp"])
            out = [torch.zeros(256) for _ in range(2)]
            td.all_gather(out, t, group=groups["tp"])
            torch.mm(torch.ones(64, 64), torch.ones(64, 64))
            prof.step()
    commviz.gather(run_dir)


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("preview") / "run"
    run_ranks(_job, WORLD, str(run_dir))
    return merge_run(run_dir, workers=1, progress=False).out


@pytest.fixture(scope="module")
def timeline(merged: Path) -> Timeline:
    return read_timeline(merged)


@pytest.fixture(scope="module")
def gpu_merged(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("gpu") / "eager"
    shutil.copytree(GPU_EAGER, run_dir)
    return merge_run(run_dir, workers=1, progress=False).out


def raw_lanes(path: Path) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Straight from the protos: per rank the slices begun on its comm lanes (the tracks named
    "PG ..." under a "rank R · ..." process), and each cross-rank flow id's ranks."""
    trace = pb.Trace.FromString(path.read_bytes())
    rank_of_proc, parent = {}, {}
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            m = re.match(r"rank (\d+) ", d.process.process_name) if d.HasField("process") else None
            if m:
                rank_of_proc[d.uuid] = int(m.group(1))
            elif d.name.startswith("PG ") and d.HasField("parent_uuid"):
                parent[d.uuid] = d.parent_uuid
    lanes = {u: rank_of_proc[p] for u, p in parent.items() if p in rank_of_proc}
    begun: dict[int, int] = defaultdict(int)
    flows: dict[int, list[int]] = defaultdict(list)
    default_track: dict[int, int] = {}            # sequence -> its packets' default track
    for p in trace.packet:
        if p.HasField("trace_packet_defaults"):
            default_track[p.trusted_packet_sequence_id] = (
                p.trace_packet_defaults.track_event_defaults.track_uuid)
        te = p.track_event
        track = (te.track_uuid if te.HasField("track_uuid")
                 else default_track.get(p.trusted_packet_sequence_id))
        if (p.HasField("track_event") and te.type == pb.TrackEvent.TYPE_SLICE_BEGIN
                and track in lanes):
            rank = lanes[track]
            begun[rank] += 1
            for f in te.flow_ids:
                if f >> 63:
                    flows[f].append(rank)
    return dict(begun), dict(flows)


def links(flows: dict[int, list[int]], ranks: set[int]) -> int:
    """Lines joining each instance's consecutive ranks among ``ranks``."""
    return sum(max(len(set(r) & ranks) - 1, 0) for r in flows.values())


def decode(png: Path) -> np.ndarray:
    image = mpimg.imread(png)
    assert image.ndim == 3 and image.shape[1] >= 1000
    assert len(np.unique(image.reshape(-1, image.shape[2]), axis=0)) > 20   # not blank
    return image


def rank_bands(image: np.ndarray) -> int:
    """Rank header bands in the picture: runs of pixel rows mostly of the band's light grey
    (#e8ebef), counted in the decoded PNG itself."""
    grey = np.array([0xE8, 0xEB, 0xEF]) / 255
    rows = (np.abs(image[:, :, :3] - grey).max(axis=2) < 0.01).mean(axis=1) > 0.5
    return int(np.count_nonzero(rows[1:] & ~rows[:-1]) + rows[0])


def rank_processes(path: Path) -> int:
    """Processes named "rank R ..." in the trace's track descriptors."""
    trace = pb.Trace.FromString(path.read_bytes())
    return len({p.track_descriptor.uuid for p in trace.packet
                if p.HasField("track_descriptor") and p.track_descriptor.HasField("process")
                and re.match(r"rank \d+ ", p.track_descriptor.process.process_name)})


def test_everything_drawn_matches_the_trace(merged: Path, timeline: Timeline,
                                            tmp_path: Path) -> None:
    begun, flows = raw_lanes(merged)
    hand = 1 + STEPS * PER_STEP                       # the barrier, then the steps
    assert begun == {r: hand for r in range(WORLD)}
    result = draw(timeline, tmp_path / "all.png", window=EVERYTHING)
    assert result.ranks == list(range(WORLD)) and result.hidden_ranks == 0
    assert result.collectives == sum(begun.values()) == WORLD * hand
    # barrier and world all_reduce: 3 links each; tp/dp groups of 2: 1 link per group
    assert result.flows == links(flows, set(range(WORLD))) == 3 + STEPS * (3 + 2 + 2 + 2)
    assert result.compute > 0
    assert rank_bands(decode(result.out)) == rank_processes(merged) == WORLD


def test_default_window_is_one_profiler_step(timeline: Timeline, tmp_path: Path) -> None:
    result = draw(timeline, tmp_path / TIMELINE_PNG)
    assert result.what.startswith("ProfilerStep#")
    assert result.collectives == WORLD * PER_STEP                # one step, every rank
    assert result.flows == 3 + 2 + 2 + 2
    tall = decode(result.out).shape[0]
    two = draw(timeline, tmp_path / "two.png", ranks=[1, 3])
    assert two.ranks == [1, 3] and two.collectives == 2 * PER_STEP
    assert two.flows == 1 + 1            # world all_reduce, dp broadcast ([1, 3]); tp: apart
    image = decode(two.out)
    assert image.shape[0] < tall and rank_bands(image) == 2


def test_gpu_kernels_in_the_compute_lane(gpu_merged: Path, tmp_path: Path) -> None:
    """The 2 x H200 fixture: every non-NCCL kernel and memcpy of the profiler's own traces is a
    compute box, every comm-lane slice a collective box."""
    kernels = 0
    for rank in (0, 1):
        with gzip.open(GPU_EAGER / f"trace_rank{rank}.json.gz") as f:
            events = json.load(f)["traceEvents"]
        kernels += sum(1 for e in events if e.get("ph") == "X"
                       and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                       and "nccl" not in e["name"].lower())
    begun, flows = raw_lanes(gpu_merged)
    tl = read_timeline(gpu_merged)
    assert {ln.title for ln in tl.lanes if not ln.comm} == {"GPU kernels (compute)"}
    result = draw(tl, tmp_path / "gpu.png", window=EVERYTHING)
    assert result.compute == kernels > 0
    assert result.collectives == sum(begun.values())
    assert result.flows == links(flows, {0, 1})
    decode(result.out)


def test_cli_and_report(merged: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli.png"
    assert cli.main(["preview", str(merged), "-o", str(out), "--window", "0:100000",
                     "--ranks", "0-1"]) == 0
    assert "cli.png: ranks 0-1" in capsys.readouterr().err
    decode(out)
    assert cli.main(["preview", str(merged), "--ranks", "0,9"]) == 2
    assert "rank(s) 9 not in this trace" in capsys.readouterr().err
    cut = tmp_path / "cut.pftrace"           # its last packet cut short: one clear error
    cut.write_bytes(merged.read_bytes()[:-1])
    assert cli.main(["preview", str(cut), "-o", str(tmp_path / "cut.png")]) == 2
    err = capsys.readouterr().err
    assert str(cut) in err and "Traceback" not in err and not (tmp_path / "cut.png").exists()
    report = write_report(merged.parent, fmt="markdown", out=tmp_path / "report.md",
                          plots_dir=tmp_path / "plots")
    assert report.plots[0] == tmp_path / "plots" / TIMELINE_PNG
    assert "![timeline](plots/timeline.png)" in report.text
    decode(report.plots[0])
