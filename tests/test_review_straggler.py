"""A rank made slow on purpose: 3 gloo ranks, rank 1 sleeps 200 ms before world collectives
#3 and #5. The review must name rank 1 the straggler of exactly those two, with the skew and the
others' wait about the injected delay; the summary tracks, plots and CLI work on the same run.

Tolerance: the ranks share one host (offset 0, one clock), so the measured skew is the sleep
plus scheduling noise: how late the other ranks reach the call and how long ``time.sleep``
overshoots. On a loaded 2-core CI machine that noise stays far below 50 ms, a quarter of the
injected 200 ms, so |skew - 200 ms| < 50 ms. The straggler threshold in the exact-set check is
50 ms for the same reason: the report's default (1 ms, 5x the median skew) is meant for real
GPU jobs and can flag genuine multi-ms scheduling hiccups on an overloaded test machine.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from commviz.cli import main as cli_main
from commviz.review.render import plots
from commviz.review.analyses.reviewing import load_inputs, review_run
from commviz.review.render.report_formats import write_report
from commviz.merge.summary import summary_tracks
from harness import run_ranks

WORLD = 3
LATE_RANK = 1
DELAY_S = 0.2
CALLS = 8
FIRST = 2            # the warm-up barrier is the world group's collective 1, in torch's numbering
SLOW = (4, 6)        # world sequence numbers of the all_reduces the late rank delays
TOLERANCE_NS = 50_000_000
THRESHOLD_MS = 50


def _slow_rank_job(rank: int, world: int, run_dir: str) -> None:
    import torch.distributed as td

    import commviz
    import commviz.distributed as dist

    commviz.start(run_dir, flush_interval=None)
    pair = dist.new_group([0, 2], group_desc="pair")
    # connection setup happens on the first collective of a group; an unrecorded barrier takes
    # it (its number too, as torch's), so the first all_reduce is not skewed by it
    with commviz.unrecorded():
        td.barrier()
    if rank in (0, 2):
        td.barrier(group=pair)
    t = torch.ones(256)
    for seq in range(FIRST, FIRST + CALLS):
        if rank == LATE_RANK and seq in SLOW:
            time.sleep(DELAY_S)
        dist.all_reduce(t)
        if rank in (0, 2):
            dist.broadcast(t, src=0, group=pair)
    commviz.flush()


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straggler") / "run"
    run_ranks(_slow_rank_job, WORLD, str(run_dir))
    return run_dir


def _world(review):
    return {i.seq: i for i in review.instances if i.pg == "0"}


def test_straggler_named_on_exactly_the_slowed_collectives(slow_run):
    review = review_run(slow_run, straggler_min_ns=THRESHOLD_MS * 1_000_000)
    world = _world(review)
    assert sorted(world) == list(range(FIRST, FIRST + CALLS))
    named = {seq: i.straggler for seq, i in world.items() if i.straggler is not None}
    assert named == {seq: LATE_RANK for seq in SLOW}
    assert not any(i.straggler is not None for i in review.instances if i.pg != "0")


def test_skew_and_waits_match_the_injected_delay(slow_run):
    world = _world(review_run(slow_run))
    for seq in SLOW:
        inst = world[seq]
        assert inst.late_rank == LATE_RANK
        assert abs(inst.skew_ns - DELAY_S * 1e9) < TOLERANCE_NS
        for rank, wait in inst.wait_ns.items():
            expected = 0 if rank == LATE_RANK else DELAY_S * 1e9
            assert abs(wait - expected) < TOLERANCE_NS, (seq, rank, wait)


def test_default_threshold_also_flags_the_slowed_collectives(slow_run):
    world = _world(review_run(slow_run))
    for seq in SLOW:
        assert world[seq].straggler == LATE_RANK


def test_rank_and_group_summaries_blame_the_late_rank(slow_run):
    review = review_run(slow_run, straggler_min_ns=THRESHOLD_MS * 1_000_000)
    top = review.rank_rows[0]
    assert top.rank == LATE_RANK and top.late == len(SLOW)
    assert abs(top.caused_ns - len(SLOW) * DELAY_S * 1e9) < len(SLOW) * TOLERANCE_NS
    world = next(g for g in review.groups if g.pg == "0")
    assert list(world.stragglers) == [LATE_RANK]
    assert world.stragglers[LATE_RANK][0] == len(SLOW)
    assert review.groups[0].pg == "0"          # the group that waited most comes first
    assert review.desyncs == []


def test_summary_tracks(slow_run):
    events, _, _, _ = load_inputs(slow_run)
    tracks = summary_tracks(events)
    world = [s for s in tracks.slices if s.pg == "0"]
    assert len(world) == CALLS
    by_seq = {s.args["commviz.seq"]: s for s in world}
    for seq in SLOW:
        s = by_seq[seq]
        assert s.args["commviz.late_rank"] == LATE_RANK
        assert s.args["commviz.straggler"] == LATE_RANK
        assert abs(s.args["commviz.skew_ns"] - DELAY_S * 1e9) < TOLERANCE_NS
        assert s.end_ns - s.start_ns >= s.args["commviz.skew_ns"]
    # slices sharing a (group, row) never overlap: a track of them nests properly
    rows: dict = {}
    for s in sorted(tracks.slices, key=lambda s: s.start_ns):
        key = (s.pg, s.row)
        assert s.start_ns >= rows.get(key, 0)
        rows[key] = s.end_ns
    counters = [c for c in tracks.counters if c.pg == "0"]
    assert counters and all(c.value >= 0 for c in counters)
    assert max(c.value for c in counters) > 0
    assert counters[-1].value == pytest.approx(0, abs=1e-6)
    assert [c.ts_ns for c in counters] == sorted(c.ts_ns for c in counters)


def test_plots_are_written(slow_run, tmp_path):
    result = write_report(slow_run, fmt="markdown", plots_dir=tmp_path / "plots",
                          out=tmp_path / "report.md")
    names = sorted(p.name for p in result.plots)
    assert names == sorted([plots.SKEW_PNG, plots.BANDWIDTH_PNG, plots.WAIT_PNG])
    for path in result.plots:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    text = (tmp_path / "report.md").read_text()
    assert f"![{plots.WAIT_PNG[:-4]}](plots/{plots.WAIT_PNG})" in text


def test_cli_formats_and_exit_codes(slow_run, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli_main(["report", str(slow_run), "--format", "json", "-o", str(out), "--no-plots",
                     "--straggler-ms", str(THRESHOLD_MS), "--fail-on-desync"])
    assert code == 0
    assert capsys.readouterr().out == ""             # -o: the file is the only output
    doc = json.loads(out.read_text())
    assert doc["ranks"] == [0, 1, 2] and doc["desyncs"] == []
    flagged = sorted(i["seq"] for i in doc["instances"] if i["straggler"] == LATE_RANK)
    assert flagged == list(SLOW)

    assert cli_main(["report", str(slow_run), "--no-plots", "-o", str(tmp_path / "r.txt")]) == 0
    assert capsys.readouterr().out == ""
    table = (tmp_path / "r.txt").read_text()
    assert "Process groups" in table and "Collective instances" in table

    assert cli_main(["report", str(slow_run), "--format", "markdown", "--plots",
                     str(tmp_path / "pngs"), "-o", str(tmp_path / "r.md")]) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "r.md").read_text().startswith("# commviz report")
    assert sorted(p.name for p in (tmp_path / "pngs").iterdir()) == sorted(
        [plots.SKEW_PNG, plots.BANDWIDTH_PNG, plots.WAIT_PNG])

    # without -o the report is printed and also written into the run dir
    assert cli_main(["report", str(slow_run), "--no-plots"]) == 0
    assert capsys.readouterr().out == (slow_run / "report.txt").read_text()


def test_cli_errors_name_the_directory(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert cli_main(["report", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["report", str(empty)]) == 2
    assert str(empty) in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "commviz_rank0.pkl").write_bytes(b"not a pickle")
    assert cli_main(["report", str(broken)]) == 2
    assert "commviz_rank0.pkl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["report", str(empty), "--format", "html"])


def test_stragglers_table_names_the_late_rank_and_the_line_that_called(slow_run):
    """The report's stragglers table: the late rank and, as origin, the job's own call line
    (read from this file's source, not from commviz)."""
    import inspect

    from commviz.review.render.report_formats import render_markdown
    from test_review_labels import _rows

    source, first = inspect.getsourcelines(_slow_rank_job)
    line = first + next(n for n, text in enumerate(source) if "dist.all_reduce(t)" in text)
    review = review_run(slow_run, straggler_min_ns=THRESHOLD_MS * 1_000_000)
    rows = _rows(render_markdown(review), "Stragglers")
    assert len(rows) == len(SLOW), rows
    for row in rows:
        assert row["late rank"] == str(LATE_RANK) and row["group"] == "0 (default_pg)", row
        assert row["origin"] == f"test_review_straggler.py:{line}", row
