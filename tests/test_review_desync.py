"""Desyncs on a real gloo job where the ranks disagree, and the classification rules.

The job (2 ranks, three groups):
- world group: three identical all_reduces, no desync;
- group ``reorder``: two matching all_reduces, then rank 0 reduces a float tensor and then an int
  tensor while rank 1 does int then float (the same bytes travel, so gloo completes both);
- group ``skip`` (3 s timeout): two matching all_reduces, then rank 1 skips the third and goes
  on to the broadcast. The mismatched ops are async and time out after 3 s, so the job ends.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from commviz import metadata as md
from commviz.cli import main as cli_main
from commviz.match.model import CommEvent, instance_key
from commviz.review.analyses.desync import find_desyncs
from commviz.review.analyses.reviewing import review_run
from harness import run_ranks


def _desync_job(rank: int, world: int, run_dir: str) -> list[str]:
    import commviz
    import commviz.distributed as dist

    commviz.start(run_dir, flush_interval=None)
    reorder = dist.new_group([0, 1], group_desc="reorder")
    skip = dist.new_group([0, 1], group_desc="skip", timeout=datetime.timedelta(seconds=3))
    f, i = torch.ones(8), torch.ones(8, dtype=torch.int32)
    for _ in range(3):
        dist.all_reduce(f)
    dist.all_reduce(f, group=reorder)
    dist.all_reduce(f, group=reorder)
    for t in ((f, i) if rank == 0 else (i, f)):
        dist.all_reduce(t, group=reorder)
    dist.all_reduce(f, group=skip)
    dist.all_reduce(f, group=skip)
    works = []
    if rank == 0:
        works.append(dist.all_reduce(torch.ones(8), group=skip, async_op=True))
    works.append(dist.broadcast(torch.ones(4), src=0, group=skip, async_op=True))
    errors = []
    for w in works:
        try:
            w.wait()
        except RuntimeError as exc:          # the gloo timeout of the mismatched ops
            errors.append(str(exc)[:80])
    commviz.flush()
    return errors


@pytest.fixture(scope="module")
def desync_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("desync") / "run"
    errors = run_ranks(_desync_job, 2, str(run_dir), timeout=90)
    assert all(errors), "the skipped collective should have timed out on both ranks"
    return run_dir


def _by_desc(review):
    return {d.pg_desc: d for d in review.desyncs}


def test_reorder_reported_at_its_sequence_number(desync_run):
    d = _by_desc(review_run(desync_run))["reorder"]
    assert d.seq == 3 and d.kind == "order"
    sides = {s.ranks: s.signature for s in d.sides}
    assert sides[(0,)].dtype == "Float" and sides[(1,)].dtype == "Int"
    assert "seq 3" in d.message


def test_skip_reported_at_its_sequence_number(desync_run):
    d = _by_desc(review_run(desync_run))["skip"]
    assert d.seq == 3 and d.kind == "missing"
    sides = {s.ranks: s.signature for s in d.sides}
    assert sides[(0,)].op == "all_reduce" and sides[(1,)].op == "broadcast"
    assert "ranks [1] skipped 1" in d.detail


def test_timed_out_calls_get_no_bandwidth(desync_run):
    review = review_run(desync_run)
    skip = {i.seq: i for i in review.instances if i.pg_desc == "skip"}
    assert skip[1].bandwidth is not None
    for seq in (3, 4):                           # rank 0's lonely all_reduce, the broadcast
        assert skip[seq].comm_ns is None and skip[seq].bandwidth is None


def test_matching_group_has_no_desync(desync_run):
    review = review_run(desync_run)
    assert sorted(_by_desc(review)) == ["reorder", "skip"]


def test_cli_fails_on_desync_only_when_asked(desync_run, tmp_path, capsys):
    args = ["report", str(desync_run), "--no-plots", "-o", str(tmp_path / "r.md"),
            "--format", "markdown"]
    assert cli_main(args) == 0
    assert capsys.readouterr().out == ""               # -o: the file is the only output
    assert "Desyncs" in (tmp_path / "r.md").read_text()
    assert cli_main([*args, "--fail-on-desync"]) == 1
    err = capsys.readouterr().err
    assert "(reorder) first differs at seq 3 [order]" in err
    assert "(skip) first differs at seq 3 [missing]" in err


# -- classification rules on hand-made events ----------------------------------------------------

def _ev(rank: int, seq: int, op: str = "all_reduce", n: int = 8, dtype: str = "Float",
        ranks: str = "[0, 1]", **extra) -> CommEvent:
    args = {md.PG_NAME: "7", md.PG_DESC: "g", md.PG_RANKS: ranks, md.KIND: "collective",
            md.OP: op, md.SEQ: seq, md.IN_NELEMS: n, md.OUT_NELEMS: n, md.DTYPE: dtype, **extra}
    t = 1000 * seq
    return CommEvent(rank=rank, pg="7", op=op, start_ns=t, end_ns=t + 10, args=args,
                     key=instance_key(args))


def _both(n: int) -> list[CommEvent]:
    return [_ev(r, s) for r in (0, 1) for s in range(1, n + 1)]


def test_identical_sequences_agree():
    assert find_desyncs(_both(5)) == []


@pytest.mark.parametrize("change, kind", [
    ({"op": "broadcast", "root": 0}, "type"),
    ({"n": 16}, "size"),
    ({"dtype": "BFloat16"}, "dtype"),
    ({md.REDUCE_OP: "max"}, "args"),
])
def test_first_differing_field(change, kind):
    change = dict(change)
    root = change.pop("root", None)
    extra = {md.ROOT: root} if root is not None else {}
    events = _both(5)
    events = [e for e in events if not (e.rank == 1 and e.seq == 4)]
    events.append(_ev(1, 4, **change, **extra))
    (d,) = find_desyncs(events)
    assert (d.seq, d.kind) == (4, kind)


def test_rank_that_stopped_early_is_missing_the_rest():
    events = [e for e in _both(6) if not (e.rank == 1 and e.seq > 4)]
    (d,) = find_desyncs(events)
    assert (d.seq, d.kind) == (5, "missing")
    assert [s.ranks for s in d.sides] == [(0,), (1,)] and d.sides[1].signature is None


def test_member_without_any_call_of_the_group_is_missing_from_the_start():
    other = _ev(1, 1, op="barrier")
    other.pg = "8"
    other.args[md.PG_NAME] = "8"
    events = [_ev(0, s) for s in (1, 2)] + [other]
    (d,) = [d for d in find_desyncs(events) if d.pg == "7"]
    assert (d.seq, d.kind) == (1, "missing")


def test_ring_buffer_that_dropped_old_calls_is_not_a_desync():
    events = [e for e in _both(6) if not (e.rank == 0 and e.seq < 3)]
    assert find_desyncs(events) == []


def test_uneven_all_to_allv_sizes_are_not_compared():
    events = [_ev(0, 1, op="all_to_all_single", n=6, **{md.IN_SPLIT: "[2, 4]"}),
              _ev(1, 1, op="all_to_all_single", n=10, **{md.IN_SPLIT: "[4, 6]"})]
    assert find_desyncs(events) == []


def test_skip_among_repeated_collectives_is_a_skip_not_a_reorder():
    # rank 0: AR BC AR BC AR BC; rank 1 skipped the AR at seq 3: AR BC BC AR BC
    pattern = ["all_reduce", "broadcast"] * 3
    events = [_ev(0, s + 1, op=op) for s, op in enumerate(pattern)]
    rank1 = pattern[:2] + pattern[3:]
    events += [_ev(1, s + 1, op=op) for s, op in enumerate(rank1)]
    (d,) = find_desyncs(events)
    assert (d.seq, d.kind) == (3, "missing")
    assert "ranks [1] skipped 1" in d.detail
