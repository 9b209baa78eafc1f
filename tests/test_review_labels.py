"""What the review says about calls that measured no transfer: async collectives and the
sends and receives of batch_isend_irecv (their spans cover only the launch), and calls that
raised (gloo has no all_reduce BAND of floats). Real gloo ranks record them; the rows are read
from the rendered report."""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import torch

import commviz
import commviz.distributed as cdist
from commviz.review.render import plots
from commviz.review.analyses.reviewing import review_run
from commviz.review.render.report_formats import render_markdown
from harness import run_ranks

GAP_S = 0.4          # a pause between two phases of the job, like a warm-up


def _job(rank: int, world: int, run_dir: str) -> None:
    commviz.start(run_dir, flush_interval=None)
    x = torch.ones(256)
    for _ in range(3):
        cdist.all_reduce(x)
    time.sleep(GAP_S)
    for _ in range(3):
        cdist.all_reduce(x)
    cdist.all_reduce(x, async_op=True).wait()
    peer = 1 - rank
    ops = [cdist.P2POp(cdist.isend, torch.ones(64), peer),
           cdist.P2POp(cdist.irecv, torch.empty(64), peer)]
    for work in cdist.batch_isend_irecv(ops):
        work.wait()
    try:                                   # gloo has no bitwise AND of floats: the call raises
        cdist.all_reduce(torch.ones(4), op=cdist.ReduceOp.BAND)
    except (RuntimeError, ValueError):
        pass
    commviz.flush()


def _rows(text: str, section: str) -> list[dict[str, str]]:
    """A markdown table of the report, each row by its column headers."""
    lines = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0].splitlines()
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines
             if ln.startswith("| ") and not ln.startswith("|---")]
    return [dict(zip(cells[0], row)) for row in cells[1:]]


def test_launch_only_failed_and_names(tmp_path: Path) -> None:
    run_ranks(_job, 2, str(tmp_path))
    review = review_run(tmp_path)
    text = render_markdown(review)
    rows = _rows(text, "Collective instances")
    by_name = {r["collective"]: r for r in rows}
    assert not any("#None" in r["collective"] for r in rows)
    failed = [r for r in rows if r["collective"].endswith("(FAILED)")]
    assert [r["collective"].split(" #")[0] for r in failed] == ["all_reduce"]
    assert failed[0]["comm time"] == "failed" and failed[0]["busbw GB/s"] == "-"
    assert rows[0] is failed[0] or rows[0] == failed[0]        # failed calls are listed first
    p2p = [r for r in rows if r["collective"].startswith(("send ", "recv "))]
    assert len(p2p) == 2 and all(r["comm time"] == "launch only" for r in p2p)
    async_seq = next(i.seq for i in review.instances if i.events[0].args.get("commviz.async_op"))
    assert by_name[f"all_reduce #{async_seq}"]["comm time"] == "launch only"
    measured = [r for r in rows if r["collective"].startswith("all_reduce #") and r not in failed
                and r["collective"] != f"all_reduce #{async_seq}"]
    assert len(measured) == 6
    assert all(r["comm time"].endswith(("ns", "µs", "ms", " s")) for r in measured)
    per_type = {(r["group"], r["op"], r["count"]): r["comm time"]
                for r in _rows(text, "Collectives by group")}
    world = "0 (default_pg)"
    assert per_type[(world, "send", "1")] == per_type[(world, "recv", "1")] == "launch only"
    assert per_type[(world, "all_reduce", "1")] == "1 failed"             # the 16-byte BAND one
    assert per_type[(world, "all_reduce", "7")].endswith("(+1 launch only)")


def test_skew_plot_breaks_at_the_pause(tmp_path: Path) -> None:
    run_ranks(_job, 2, str(tmp_path))
    review = review_run(tmp_path)
    sync = [i for i in review.instances if i.op == "all_reduce" and not i.launch_only]
    x = [(i.first_start_ns - sync[0].first_start_ns) / 1e9 for i in sync]
    gx, _ = plots.with_gaps(x, [i.skew_ns for i in sync])
    breaks = np.flatnonzero(np.isnan(gx))
    assert len(breaks) == 1                       # one break, at the sleep between the phases
    before, after = gx[breaks[0] - 1], gx[breaks[0] + 1]
    assert after - before >= GAP_S
    assert plots.plot_skew(review.instances, tmp_path / "skew.png").stat().st_size > 0


MESH = Path(__file__).parent / "fixtures" / "gpu" / "proof-4x" / "fsdp-tp"


def test_a_device_meshs_hashed_groups_are_told_apart_in_a_few_digits(tmp_path: Path) -> None:
    """DeviceMesh names each of its groups by a 40-digit hash (torch's Flight Recorder dumps
    of the real 4 x H200 FSDP x TP run, ``pg_config``): the report's group column shows the
    hash's first 8 digits and the mesh dimension, each group still apart, with torch's ranks."""
    run = tmp_path / "run"
    shutil.copytree(MESH, run)
    config: dict[str, dict] = {}
    for path in (run / "flight_recorder").glob("rank_*"):        # torch's own dump (trusted)
        config.update(pickle.loads(path.read_bytes())["pg_config"])
    hashed = {name: c for name, c in config.items()
              if len(name) == 40 and all(ch in "0123456789abcdef" for ch in name)}
    assert len(hashed) == 4
    text = render_markdown(review_run(run))
    rows = {r["group"]: r for r in _rows(text, "Process groups")}
    for name, c in hashed.items():
        assert name not in text
        (title,) = [t for t in rows if t.startswith(f"{name[:8]}… (mesh_")]
        assert rows[title]["ranks"] == ",".join(map(str, json.loads(c["ranks"])))
