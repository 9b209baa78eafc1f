"""An all_to_all's uneven splits, compared pairwise: what rank i sends to j (its input split
for j) must be what j takes from i (its output split for i).

On the run kept from 4 x H100 where rank 1 dispatched step 5's tokens with the previous step's
output splits (``fixtures/gpu/verdict-4xh100/a2a_splits``), torch's Flight Recorder analyzer
finds that all_to_all (seq 10); the report's desync table names it, rank 1 on a side of its
own. The rules on hand-made events: splits as rows of dim 0 or as the list form's numels, an
even split ("[]"), a rank that sends wrong, and two ranks where nothing tells which is wrong.
A healthy run's uneven all_to_alls (``experts``) are no desync: ``test_proof_gpu.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nccl_verdict import flight

from commviz import metadata as md
from commviz.match.model import CommEvent, instance_key
from commviz.review.analyses.desync import find_desyncs

KEPT = Path(__file__).parent / "fixtures" / "gpu" / "verdict-4xh100" / "a2a_splits"
BAD, SEQ = 1, 10                          # broken_mesh.py: rank 1, step 5's dispatch


def test_kept_nccl_run_desync_is_flight_recorders(tmp_path: Path) -> None:
    import shutil

    run = shutil.copytree(KEPT, tmp_path / "run")
    fl = flight(run, tmp_path / "fr")
    assert fl.findings is not None and ("default_pg", SEQ) in fl.findings, fl.findings
    got = subprocess.run([sys.executable, "-m", "commviz", "report", str(run), "--no-plots",
                          "--format", "json", "-o", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    (d,) = json.loads((tmp_path / "r.json").read_text())["desyncs"]
    assert (d["pg_desc"], d["seq"], d["kind"]) == ("default_pg", SEQ, "size"), d
    sides = {tuple(s["ranks"]): s["collective"] for s in d["sides"]}
    assert sides.keys() == {(0, 2, 3), (BAD,)}, d
    # rank 1's own call, as Flight Recorder has its sizes (rows x 16)
    (entry,) = [e for e in fl.entries[BAD] if e["collective_seq_id"] == SEQ]
    rows, width = entry["output_sizes"][0]
    assert sides[(BAD,)]["sizes"]["out_total"] == rows * width
    assert sum(sides[(BAD,)]["sizes"]["out_split"]) == rows


def _a2a(rank: int, send: list[int], take: list[int], *, op: str = "all_to_all_single",
         row: int = 1, ranks: str = "[0, 1, 2]") -> CommEvent:
    args = {md.PG_NAME: "0", md.PG_DESC: "default_pg", md.PG_RANKS: ranks,
            md.KIND: "collective", md.OP: op, md.SEQ: 1, md.DTYPE: "Float",
            md.IN_NELEMS: sum(send) * row, md.OUT_NELEMS: sum(take) * row,
            md.IN_SPLIT: str(send), md.OUT_SPLIT: str(take)}
    return CommEvent(rank=rank, pg="0", op=op, start_ns=0, end_ns=10, args=args,
                     key=instance_key(args))


# each rank's (send, take) splits of one all_to_all over 3 ranks that pair up
PAIRED = {0: ([1, 2, 3], [1, 4, 7]), 1: ([4, 5, 6], [2, 5, 8]), 2: ([7, 8, 9], [3, 6, 9])}


@pytest.mark.parametrize("op, row", [("all_to_all_single", 16), ("all_to_all", 1)])
def test_splits_that_pair_up_are_no_desync(op: str, row: int) -> None:
    assert find_desyncs([_a2a(r, s, t, op=op, row=row) for r, (s, t) in PAIRED.items()]) == []


def test_an_even_split_pairs_with_uneven_ones() -> None:
    events = [_a2a(0, [2, 2, 2], [2, 1, 3]), _a2a(1, [1, 1, 1], [2, 1, 1]),
              _a2a(2, [3, 1, 1], [2, 1, 1])]
    events[0].args[md.IN_SPLIT] = "[]"           # 6 rows, split evenly: 2 each
    assert find_desyncs(events) == []


def test_a_rank_that_takes_wrong_is_the_one_named() -> None:
    events = [_a2a(r, s, t) for r, (s, t) in PAIRED.items()]
    events[1] = _a2a(1, [4, 5, 6], [8, 5, 2])    # a stale table: takes 8 from 0, 2 from 2
    (d,) = find_desyncs(events)
    assert (d.seq, d.kind) == (1, "size")
    assert [s.ranks for s in d.sides] == [(0, 2), (1,)]
    assert "rank 1 takes [8, 5, 2]" in d.detail and "which send it [2, 5, 8]" in d.detail


def test_a_rank_that_sends_wrong_is_the_one_named() -> None:
    events = [_a2a(r, s, t) for r, (s, t) in PAIRED.items()]
    events[2] = _a2a(2, [9, 8, 7], [3, 6, 9])    # sends 9 to 0, which takes 7
    (d,) = find_desyncs(events)
    assert [s.ranks for s in d.sides] == [(0, 1), (2,)]
    assert "rank 2 sends [9, 8, 7]" in d.detail and "which take [7, 8, 9] from it" in d.detail


def test_two_ranks_that_disagree_are_both_named() -> None:
    events = [_a2a(0, [1, 2], [1, 3], ranks="[0, 1]"), _a2a(1, [4, 5], [2, 5], ranks="[0, 1]")]
    (d,) = find_desyncs(events)
    assert [s.ranks for s in d.sides] == [(0,), (1,)]
