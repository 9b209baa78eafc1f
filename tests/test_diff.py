"""``commviz diff`` on real gloo runs of one program (``_job``): a baseline, a rerun of it with
nothing changed, a run where one call's message is 32 times as large and one rank sleeps before
another call every step, and a 4-rank run that makes its groups in the other order and runs
fewer steps. What diff must say follows from the program itself: which line's call changed
(its origin is that line), which rank slept, how many calls each line makes per step, which
groups torch numbered how (each rank reports its groups' names as torch gives them) - never
from commviz's own output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commviz import cli
from commviz.errors import SourceError
from commviz.match.artifact import matched_path
from commviz.merge.table import table_path
from commviz.review.diff import GROUP, ORIGIN, Change, NoiseRule, diff_runs
from commviz.review.diffout import plot_diff, render
from harness import run_ranks

pytestmark = pytest.mark.slow

# Floats in the message the changed run makes GROW times larger. A and B run minutes apart while
# the other test worker's jobs come and go, which moves a gloo all_reduce's time by up to half:
# A's message is small (1 MiB, a ms or two a step: whatever the load, an unchanged rerun moves it
# by less than the noise floor; 16 MiB once moved 10 ms) and B's large (32 MiB: 16 MiB doubled was
# once lost in the load on CI's 2 cores).
BIG, GROW = 1 << 18, 32
LATE_RANK, LATE_S = 1, 0.05      # the rank that sleeps, before the world all_reduce, each step
STEPS = 16
# Gloo ranks sharing two busy cores jitter by milliseconds a step (GPU jobs by microseconds):
# the noise floor of these comparisons (``NoiseRule.min_ns``, 1 ms by default) is raised to it.
RULE = NoiseRule(min_ns=5_000_000)


def _job(rank: int, world: int, run_dir: str, steps: int, big: int, late: bool,
         pairs_first: bool) -> dict[str, str]:
    import time

    import torch
    import torch.distributed as dist

    import commviz
    from commviz.merge import write_shard
    from commviz.merge.table import write_table

    commviz.start(run_dir)
    spans = [list(range(r, r + 2)) for r in range(0, world, 2)]
    made = {}
    for what in (("pairs", "tp") if pairs_first else ("tp", "pairs")):
        mine = None
        for ranks in spans:                        # every rank makes every group, in order
            g = dist.new_group(ranks, group_desc="tp") if what == "tp" else dist.new_group(ranks)
            if rank in ranks:
                mine = g
        made[what] = mine
    tp, pairs = made["tp"], made["pairs"]
    x = torch.ones(big)
    small = torch.ones(256)
    out = torch.zeros(512)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with commviz.profile(run_dir, schedule=schedule) as prof:
        for _ in range(steps + 1):
            dist.all_reduce(x, group=tp)                           # LINE big
            if late and rank == LATE_RANK:
                time.sleep(LATE_S)
            dist.all_reduce(small)                                 # LINE late
            dist.all_gather_into_tensor(out, small, group=pairs)   # LINE pairs
            dist.broadcast(small, src=0)                           # LINE broadcast
            prof.step()
    commviz.gather(run_dir)
    write_shard(run_dir, rank)                   # on the rank's node, as a launch does
    write_table(run_dir, rank)
    return {what: dist.distributed_c10d._get_process_group_name(g) for what, g in made.items()}


def _line(tag: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# LINE {tag}"))


def _origin(keys: list[str], tag: str) -> str:
    """The one key naming this file's line ``tag`` (a call site origin: "file:line")."""
    found = [k for k in keys if "test_diff.py" in k and k.endswith(f":{_line(tag)}")]
    assert len(found) == 1, (tag, keys)
    return found[0]


def _run(tmp_path_factory, name: str, world: int = 2, steps: int = STEPS, big: int = BIG,
         late: bool = False, pairs_first: bool = False) -> tuple[Path, list[dict[str, str]]]:
    run_dir = tmp_path_factory.mktemp("diff") / name
    names = run_ranks(_job, world, str(run_dir), steps, big, late, pairs_first)
    return run_dir, names


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _run(tmp_path_factory, "a")


@pytest.fixture(scope="module")
def again(tmp_path_factory):
    return _run(tmp_path_factory, "a2")


@pytest.fixture(scope="module")
def changed(tmp_path_factory):
    return _run(tmp_path_factory, "b", big=GROW * BIG, late=True)


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    return _run(tmp_path_factory, "c", world=4, steps=STEPS - 1, pairs_first=True)


def test_the_changed_origins_come_first_with_their_cause(base, changed, tmp_path: Path) -> None:
    out = tmp_path / "diff.json"
    assert cli.main(["diff", str(base[0]), str(changed[0]), "--format", "json",
                     "--noise-ms", str(RULE.min_ns / 1e6), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    regressions = doc["regressions"]
    keys = [r["origin"] for r in regressions + doc["unchanged"] + doc["improvements"]]
    big, late = _origin(keys, "big"), _origin(keys, "late")
    assert {r["origin"] for r in regressions[:2]} == {big, late}, regressions
    got = {r["origin"]: r for r in regressions}
    # the grown message: more transfer time, its size GROW times A's (4 bytes a float)
    assert got[big]["cause"] == "transfer"
    assert got[big]["delta_comm_ns"] > max(got[big]["delta_wait_ns"], 0)
    assert got[big]["a"]["sizes"] == [4 * BIG] and got[big]["b"]["sizes"] == [4 * GROW * BIG]
    assert got[big]["late_ranks"] == []                      # nobody made late there
    # the late rank: more waiting, for the rank that slept
    assert got[late]["late_ranks"] == [LATE_RANK]
    # named at its root with the watcher's cause (commviz.live.cause), and nobody else
    assert got[late]["cause"] == "late"
    assert [(n["rank"], n["cause"]) for n in got[late]["named"]] == [(LATE_RANK, "late")]
    assert got[big]["named"] == []
    assert got[late]["delta_wait_ns"] > got[late]["delta_comm_ns"]
    # runs alike in shape: each line called once a step on each rank, in both runs
    for r in regressions + doc["unchanged"]:
        assert r["a"]["calls_per_step"] == r["b"]["calls_per_step"] == 1
    assert doc["a"]["steps"] and len(doc["a"]["steps"]) == len(doc["b"]["steps"]) == STEPS
    assert doc["noise_rule"]["min_ns"] == RULE.min_ns and "5 ms" in doc["noise_rule"]["text"]
    assert doc["only_a"] == doc["only_b"] == []
    assert out.with_suffix(".png").stat().st_size > 0          # the picture beside the report


def test_markdown_and_table_lead_with_the_regressions(base, changed, tmp_path: Path) -> None:
    d = diff_runs(base[0], changed[0], rule=RULE)
    keys = [r.key for r in d.rows]
    big, late = _origin(keys, "big"), _origin(keys, "late")
    md_text = render(d, "markdown", plot_diff(d, tmp_path / "d.png"), tmp_path)
    first = md_text.split("### ")[0]                        # the lines a reviewer reads first
    assert first.index(f"`{big}`") > 0 and first.index(f"`{late}`") > 0
    assert f"waiting for rank {LATE_RANK}" in first and "Noise rule:" in first
    assert "![B against A per origin](d.png)" in md_text
    table = render(d, "table")
    assert table.index("Regressions") < table.index(big) and "Noise rule:" in table


def test_unchanged_runs_list_no_regression(base, again) -> None:
    d = diff_runs(base[0], again[0], rule=RULE)
    assert d.of(Change.REGRESSION) == [], [(r.key, r.delta_ns, r.noise_ns) for r in d.rows]
    assert d.of(Change.ONLY_A) == d.of(Change.ONLY_B) == []


def test_other_sizes_steps_and_group_numbering_match(base, bigger) -> None:
    (a_dir, a_names), (c_dir, c_names) = base, bigger
    # torch numbered the groups differently (made in the other order, and twice as many)
    assert a_names[0]["tp"] != c_names[0]["tp"] and a_names[0]["pairs"] != c_names[0]["pairs"]
    d = diff_runs(a_dir, c_dir, rule=RULE)
    assert d.of(Change.ONLY_A) == d.of(Change.ONLY_B) == []
    keys = [r.key for r in d.rows]
    for tag in ("big", "late", "pairs", "broadcast"):       # per rank and step: once, both
        row = next(r for r in d.rows if r.key == _origin(keys, tag))
        assert row.a.calls_per_step == row.b.calls_per_step == 1
    assert (d.a.ranks, d.b.ranks, len(d.a.steps), len(d.b.steps)) == (2, 4, STEPS, STEPS - 1)
    by_group = diff_runs(a_dir, c_dir, by=GROUP)
    # the world, the described "tp" pairs, the undescribed pairs: each found in both runs
    assert len(by_group.rows) == 3
    assert by_group.of(Change.ONLY_A) == by_group.of(Change.ONLY_B) == []
    assert "tp" in {r.key for r in by_group.rows}


def test_a_missing_run_or_unreadable_table_is_one_error_naming_it(base, tmp_path: Path,
                                                                   capsys) -> None:
    with pytest.raises(SourceError, match="nowhere"):
        diff_runs(tmp_path / "nowhere", base[0])
    broken = tmp_path / "broken"
    shutil.copytree(base[0], broken)
    matched_path(broken, 1).unlink()                        # nothing to rebuild it from
    table_path(broken, 1).write_text('{"schema": "commviz.comm", "rows": [')
    assert cli.main(["diff", str(base[0]), str(broken), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "comm_rank1.json" in err and "Traceback" not in err
    d = diff_runs(base[0], base[0], by=ORIGIN)               # a run against itself: all unchanged
    assert {r.change for r in d.rows} == {Change.UNCHANGED}


def test_a_run_dir_of_records_alone_compares_as_with_its_tables(base, changed,
                                                                 tmp_path: Path) -> None:
    """A job that only called ``commviz.start`` leaves its records and no comm tables: diff
    reads them as ``commviz report`` does, and says what it says with the tables."""
    bare = tmp_path / "bare"
    shutil.copytree(changed[0], bare)
    for path in [*bare.glob("comm_rank*.json"), *bare.glob("matched_rank*.json")]:
        path.unlink()
    with_tables = diff_runs(base[0], changed[0], rule=RULE)
    without = diff_runs(base[0], bare, rule=RULE)
    assert [r.key for r in without.of(Change.REGRESSION)] == \
        [r.key for r in with_tables.of(Change.REGRESSION)]
    late = next(r for r in without.rows if r.key == _origin([r.key for r in without.rows], "late"))
    assert [(s.rank, str(s.cause)) for s in late.named] == [(LATE_RANK, "late")]
